"""A pod on the demo's cluster is Ready only once its runtime process serves.

kwok reports a pod Ready the moment it runs, seconds before the runtime harness's process for
it has loaded its model: a rollout then moves weight onto pods that do not serve yet (in the
demo, 3 new canary pods of the 50% step took 15 s to answer while the route already sent the
canary half the traffic, all of it to the one canary process that did). With
``LocalCluster.start(ready_when_serving=True)`` kwok keeps the pod Running but not Ready until
the harness marks it serving (as a kubelet's readiness probe would): the Deployment's ready
count, which the operator reads, follows the process.

The other end of a pod's life, on every cluster: when its pod goes away the process is no
longer an endpoint at once, and keeps serving for the pod's ``preStop`` sleep before its SIGTERM,
as a kubelet runs the hook: a gateway that learns of the removal a moment later (Envoy through
Contour, in the demo) still reaches a live process, as on a cluster.
"""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from batchpilot_localdev.cluster import SERVING_ANNOTATION, LocalCluster
from batchpilot_localdev.harness import RuntimeHarness
from batchpilot_localdev.prometheus import PrometheusServer
from batchpilot_operator import children
from batchpilot_operator.spec import parse_spec
from bptest import TINY_MODEL, policy, wait_until

pytestmark = [pytest.mark.cluster]


def apply(cluster: LocalCluster, manifest: dict[str, Any]) -> None:
    manifest = dict(manifest, metadata={k: v for k, v in manifest["metadata"].items() if k != "ownerReferences"})
    cluster.kubectl("apply", "-f", "-", input=json.dumps(manifest))


def pod_state(cluster: LocalCluster, namespace: str) -> tuple[str | None, str | None, dict[str, str], dict[str, str]]:
    """(phase, pod IP, conditions by type, annotations) of the namespace's one pod."""
    items = json.loads(cluster.kubectl("get", "pods", "-n", namespace, "-o", "json"))["items"]
    if not items:
        return None, None, {}, {}
    pod = items[0]
    status = pod.get("status") or {}
    conditions = {c["type"]: c["status"] for c in status.get("conditions") or []}
    return status.get("phase"), status.get("podIP"), conditions, pod["metadata"].get("annotations") or {}


def ready_replicas(cluster: LocalCluster, namespace: str, name: str) -> int:
    deployment = json.loads(cluster.kubectl("get", "deployment", name, "-n", namespace, "-o", "json"))
    return int((deployment.get("status") or {}).get("readyReplicas") or 0)


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/v2/health/live", timeout=1) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


def test_a_pod_is_ready_only_once_its_runtime_process_serves(tmp_path: Path) -> None:
    cluster = LocalCluster.start(tmp_path / "cluster", gpu_nodes=1, ready_when_serving=True)
    harness: RuntimeHarness | None = None
    try:
        ns = "serving"
        cluster.kubectl("create", "namespace", ns)
        spec = parse_spec(policy("shop", model=dict(TINY_MODEL), replicas=1)["spec"])
        revision = spec.revision()
        apply(cluster, children.build_configmap("shop", ns, "uid", spec, revision))
        deployment = children.build_deployment("shop", ns, "uid", spec, "stable", revision, 1)
        apply(cluster, deployment)
        # Running with its IP (what the harness starts a process for), and not Ready: nothing serves it
        running = wait_until(
            lambda: (s := pod_state(cluster, ns))[0] == "Running" and s[1] and s, 60, "the pod running"
        )
        assert running[2].get("Ready") == "False" and SERVING_ANNOTATION not in running[3], running
        assert ready_replicas(cluster, ns, deployment["metadata"]["name"]) == 0
        harness = RuntimeHarness(cluster.kubeconfig, ns, tmp_path / "runtime", PrometheusServer(tmp_path / "prom"))
        harness.start()
        wait_until(
            lambda: ready_replicas(cluster, ns, deployment["metadata"]["name"]) == 1, 120, "the Deployment ready"
        )
        # ... only once its process answered its readiness endpoint
        assert [p.ready for p in harness.processes()] == [True]
        assert pod_state(cluster, ns)[3].get(SERVING_ANNOTATION) == "true"
        assert not harness.errors, harness.errors

        # The pod goes away: no longer an endpoint, the process serves out the preStop sleep
        (proc,) = harness.processes()
        assert proc.pre_stop_seconds == children.ENDPOINT_REMOVAL_SECONDS > 0
        deleted = time.monotonic()
        cluster.kubectl("scale", "deployment", deployment["metadata"]["name"], "-n", ns, "--replicas=0")
        wait_until(lambda: not harness.endpoints("shop"), 30, "the pod's process no longer an endpoint")
        assert answers(proc.url), "the process stopped serving as its pod went away"
        last = deleted
        while proc.proc.poll() is None and time.monotonic() - deleted < 60:
            if answers(proc.url):
                last = time.monotonic()
            time.sleep(0.1)
        assert proc.proc.poll() is not None, "the process outlived its pod by a minute"
        assert last - deleted >= children.ENDPOINT_REMOVAL_SECONDS - 0.5, (
            f"served {last - deleted:.1f}s after the delete"
        )
        assert not harness.processes() and not harness.stopping
        assert not harness.errors, harness.errors
    finally:
        if harness is not None:
            harness.stop()
        cluster.stop()
