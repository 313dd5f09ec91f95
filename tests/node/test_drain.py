"""SIGTERM from the kubelet drains a runtime pod's in-flight requests: none is lost.

The lane's window is long (15 s) and its batches large, so the requests sent to the pod sit in its
queue, counted by its own ``batchpilot_queue_depth``; then the pod is deleted. The kubelet runs
the preStop sleep first (the pod keeps serving while the Services' endpoints drop it), then stops
the container (SIGTERM); the server flushes its queue without waiting out the window, and every
queued request is answered 200, well before its window would have closed."""

from __future__ import annotations

import concurrent.futures
import time
import urllib.request
from pathlib import Path

import pytest

from batchpilot_localdev.realnode import RealNode
from batchpilot_operator.children import ENDPOINT_REMOVAL_SECONDS, RUNTIME_PORT
from bpnode import events, infer, pod_ip, ready_pods, real_policy
from bptest import NO_PROMETHEUS, Kube, start_operator

pytestmark = [pytest.mark.cluster, pytest.mark.realnode, pytest.mark.slow]

WINDOW = 15.0
IN_FLIGHT = 12


def queue_depth(ip: str) -> float:
    with urllib.request.urlopen(f"http://{ip}:{RUNTIME_PORT}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("batchpilot_queue_depth{") and 'lane="interactive"' in line
    )


def test_sigterm_from_the_kubelet_drains_every_queued_request(
    kube: Kube, node: RealNode, namespace: str, tmp_path: Path
) -> None:
    op = start_operator(kube, namespace, tmp_path, NO_PROMETHEUS)
    try:
        lane = {
            "name": "interactive",
            "maxBatchSize": 64,
            "maxQueueDelay": f"{WINDOW:g}s",
            "maxQueueLength": 256,
            "requestTimeout": "30s",
        }
        kube.apply(
            real_policy(replicas=1, lanes=[lane], slo={"p99Latency": "60s", "maxQueueAge": "30s"}), "-n", namespace
        )
        (pod,) = kube.wait_for(lambda: ready_pods(kube, namespace, "shop", "stable", 1), 180, "a ready pod")
        ip, name = pod_ip(pod), pod["metadata"]["name"]
        with concurrent.futures.ThreadPoolExecutor(IN_FLIGHT) as pool:
            sent = time.monotonic()
            futures = [pool.submit(infer, ip, "tiny", 60.0) for _ in range(IN_FLIGHT)]
            kube.wait_for(lambda: queue_depth(ip) == IN_FLIGHT, WINDOW / 2, f"{IN_FLIGHT} requests queued")
            assert not any(f.done() for f in futures)
            deleted = time.monotonic()
            kube.kubectl("delete", "pod", name, "-n", namespace, "--wait=false")
            answers = [f.result() for f in futures]  # raises on any error: a lost request fails the test
            answered = time.monotonic()
            answered_in = answered - sent
        assert len(answers) == IN_FLIGHT and all(len(a["outputs"][0]["data"]) == 512 for a in answers)
        # Flushed by the drain, not by the window closing.
        assert answered_in < WINDOW, f"answered {answered_in:.1f}s after sending: the window ran out, no drain"
        # ... and only after the preStop sleep: until then the deleted pod held its queue as usual.
        assert answered - deleted >= ENDPOINT_REMOVAL_SECONDS, f"answered {answered - deleted:.1f}s after the delete"
        # The kubelet stopped the container (SIGTERM, then waits out the grace period).
        killing = kube.wait_for(
            lambda: [e for e in events(kube, namespace, name) if e["reason"] == "Killing"], 30, "the kubelet's Killing"
        )
        assert killing[0]["source"]["component"] == "kubelet" or killing[0].get("reportingComponent") == "kubelet"
        # Its replacement serves.
        (new,) = kube.wait_for(lambda: ready_pods(kube, namespace, "shop", "stable", 1), 180, "a new ready pod")
        assert new["metadata"]["name"] != name
        infer(pod_ip(new), timeout=WINDOW + 10)  # alone in its batch: it waits out the window
    finally:
        op.stop()
