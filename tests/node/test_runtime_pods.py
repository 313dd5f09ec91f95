"""The operator's runtime pods run by a real kubelet and containerd, in a namespace that enforces
the restricted Pod Security Standard: admitted, started from the image `make images` built,
Ready only once their readiness probe answers, serving inference at their pod IPs, and sent
traffic by their Service's EndpointSlices only once ready (stable and canary pods alike). The
kubelet is a node, not the admin."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client, config, watch

from batchpilot_localdev.load import TraceReplay
from batchpilot_localdev.nodeimages import RUNTIME_IMAGE
from batchpilot_localdev.realnode import NODE_NAME, PodEndpoints, RealNode
from batchpilot_operator.children import RUNTIME_PORT
from bpnode import infer, is_ready, pod_ip, pods, ready_pods, real_policy
from bptest import NO_PROMETHEUS, Kube, policy_status, start_operator

pytestmark = [pytest.mark.cluster, pytest.mark.realnode, pytest.mark.slow]


def _time(stamp: str) -> dt.datetime:
    return dt.datetime.fromisoformat(stamp.replace("Z", "+00:00"))


def test_policy_pods_run_on_the_real_node_and_serve(kube: Kube, node: RealNode, namespace: str, tmp_path: Path) -> None:
    op = start_operator(kube, namespace, tmp_path, NO_PROMETHEUS)
    try:
        kube.apply(real_policy(), "-n", namespace)
        stable = kube.wait_for(lambda: ready_pods(kube, namespace, "shop", "stable", 2), 180, "2 ready stable pods")
        status = kube.wait_for(
            lambda: (st := policy_status(kube, namespace, "shop")).get("phase") == "Healthy" and st, 60, "Healthy"
        )
        revision = status["stableRevision"]
        for pod in stable:
            assert pod["spec"]["nodeName"] == NODE_NAME
            (container,) = pod["status"]["containerStatuses"]
            assert container["image"] == RUNTIME_IMAGE and container["imageID"].startswith("sha256:")
            assert container["restartCount"] == 0 and container["ready"]
            # The kubelet's readiness probe, not a fake: Ready came after the container started
            # (the model is loaded and warmed first), and the container runs as the restricted
            # profile wants (non-root; the kubelet would refuse a root image with runAsNonRoot).
            started = _time(container["state"]["running"]["startedAt"])
            ready = next(c for c in pod["status"]["conditions"] if c["type"] == "Ready")
            assert _time(ready["lastTransitionTime"]) >= started
            assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
            answer = infer(pod_ip(pod))
            assert answer["model_version"] == revision
            assert len(answer["outputs"][0]["data"]) == 512
        # The namespace really enforces the restricted profile: a privileged pod is refused.
        refused = kube.apply(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "privileged"},
                "spec": {
                    "containers": [{"name": "c", "image": RUNTIME_IMAGE, "securityContext": {"privileged": True}}]
                },
            },
            "-n",
            namespace,
            check=False,
        )
        assert refused.returncode != 0
        assert 'violates PodSecurity "restricted:latest"' in refused.stderr, refused.stderr
        assert not [p for p in pods(kube, namespace, "shop") if p["metadata"]["name"] == "privileged"]
    finally:
        op.stop()


def test_the_kubelet_is_a_node_not_the_admin(kube: Kube, node: RealNode) -> None:
    # The kubelet's own credentials (a client certificate from the cluster's CA): it is
    # system:node:<name> in system:nodes, the Node authorizer keeps it off what its pods do not
    # need, and NodeRestriction admission keeps it off labels reserved to the cluster.
    kubelet = [kube.kubectl_bin, f"--kubeconfig={node.workdir / 'kubelet.kubeconfig'}"]

    def as_kubelet(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*kubelet, *args], capture_output=True, text=True, timeout=30, check=False)

    whoami = as_kubelet("auth", "whoami", "-o", "json")
    assert whoami.returncode == 0, whoami.stderr
    user = json.loads(whoami.stdout)["status"]["userInfo"]
    assert user["username"] == f"system:node:{NODE_NAME}" and "system:nodes" in user["groups"]
    assert as_kubelet("get", "node", NODE_NAME, "-o", "name").stdout.strip() == f"node/{NODE_NAME}"
    # can-i answers "no" with exit status 1; kubectl may append the authorizer's reason
    # ("no - can only read namespaced object of this type").
    for verb_and_resource in (("list", "secrets", "--all-namespaces"), ("delete", "namespaces")):
        answer = as_kubelet("auth", "can-i", *verb_and_resource)
        assert answer.returncode == 1 and answer.stdout.split(" - ")[0].strip() == "no", answer
    relabel = as_kubelet("label", "node", NODE_NAME, "node-restriction.kubernetes.io/pool=gpu")
    assert relabel.returncode != 0 and "is not allowed to modify labels" in relabel.stderr, relabel.stderr


def first_request_at(pod: dict[str, Any]) -> float:
    """When the pod's runtime got its first request, from its own arrival records."""
    doc = json.loads(urllib.request.urlopen(f"http://{pod_ip(pod)}:{RUNTIME_PORT}/admin/arrivals", timeout=10).read())
    (lane,) = doc["lanes"]
    assert lane["times"], f"pod {pod['metadata']['name']} got no request"
    return float(lane["base"] + lane["times"][0])


def canary_answers(replay: TraceReplay) -> int:
    return sum(s.ok for (_, track), s in list(replay.stats.items()) if track == "canary")


def test_readiness_gates_the_services_traffic(kube: Kube, node: RealNode, namespace: str, tmp_path: Path) -> None:
    # Requests flow from before the pods exist, routed as kube-proxy routes a Service: to the
    # ready endpoints of its EndpointSlices (PodEndpoints). A watch of those slices records
    # when the kubelet's readiness probe let each pod in; the pods' own arrival records say
    # when their first request came.
    seen: dict[str, list[tuple[float, bool]]] = {}  # pod -> (time, ready) as the slices said
    stop = threading.Event()
    api = config.new_client_from_config(config_file=str(kube.kubeconfig))  # type: ignore[no-untyped-call]

    def watch_slices() -> None:
        w = watch.Watch()  # type: ignore[no-untyped-call]
        try:
            for event in w.stream(  # type: ignore[no-untyped-call]
                client.DiscoveryV1Api(api).list_namespaced_endpoint_slice,
                namespace,
                label_selector="kubernetes.io/service-name=gate",
                timeout_seconds=300,
            ):
                now = time.time()
                for ep in event["object"].endpoints or []:
                    if ep.target_ref is not None:
                        seen.setdefault(ep.target_ref.name, []).append((now, bool(ep.conditions.ready)))
                if stop.is_set():
                    w.stop()  # type: ignore[no-untyped-call]
        except Exception:
            # The watch blocks between events: once the test is over it may still be open when
            # the cluster goes away. A break while the test still reads it is an error.
            if not stop.is_set():
                raise

    watcher = threading.Thread(target=watch_slices, daemon=True)
    watcher.start()
    op = start_operator(kube, namespace, tmp_path, NO_PROMETHEUS)
    endpoints = PodEndpoints(kube.kubeconfig, namespace, "gate").start()
    replay = TraceReplay([i / 20 for i in range(1, 12_000)], endpoints, model="tiny").start()
    try:
        kube.apply(real_policy("gate"), "-n", namespace)
        stable = kube.wait_for(lambda: ready_pods(kube, namespace, "gate", "stable", 2), 180, "2 ready stable pods")
        kube.wait_for(lambda: len(endpoints()) == 2, 30, "the replay routing to both pods")
        answered = sum(s.ok for s in list(replay.stats.values()))
        kube.wait_for(lambda: sum(s.ok for s in list(replay.stats.values())) >= answered + 60, 60, "60 more answers")
        # Read now: the canary's step scales the stable down, and a deleted pod's records go with it.
        first = {p["metadata"]["name"]: first_request_at(p) for p in stable}
        # A change: its canary pod joins the same Service while the stable serves (no
        # Prometheus here, so the rollout holds at its first step with the canary up).
        (lane,) = real_policy()["spec"]["lanes"]
        kube.apply(real_policy("gate", lanes=[{**lane, "maxQueueDelay": "3ms"}]), "-n", namespace)
        canary = kube.wait_for(
            lambda: [p for p in pods(kube, namespace, "gate", "canary") if is_ready(p)] or None,
            180,
            "a ready canary pod",
        )
        kube.wait_for(lambda: any(e.track == "canary" for e in endpoints()), 30, "the replay routing to the canary")
        served = canary_answers(replay)
        kube.wait_for(lambda: canary_answers(replay) >= served + 20, 60, "20 more answers from the canary")
        first |= {p["metadata"]["name"]: first_request_at(p) for p in canary}
    finally:
        replay.stop()
        endpoints.stop()
        stop.set()
        op.stop()
    assert replay.dropped_no_endpoint > 0  # requests were due while no pod was ready
    sent = sum(s.sent for s in replay.stats.values())
    # None failed, not even while a stable pod terminated to make room for the canary: its
    # preStop sleep kept it serving until the slices dropped it.
    assert sent > 0 and sum(s.errors for s in replay.stats.values()) == 0, dict(replay.stats)
    for pod in [*stable, *canary]:
        name = pod["metadata"]["name"]
        states = seen.get(name, [])
        ready_at = min((t for t, ready in states if ready), default=None)
        not_ready = [t for t, ready in states if not ready and (ready_at is None or t < ready_at)]
        # The slices listed the pod before its probe passed (model loading), not ready ...
        assert not_ready and ready_at is not None, states
        # ... and it got its first request only after the slices said ready (the routing
        # re-reads them every 0.5 s; the watch saw the change within its delivery time).
        assert first[name] > max(not_ready), (name, first[name], not_ready)
        assert first[name] >= ready_at - 0.25, (name, first[name], ready_at)
