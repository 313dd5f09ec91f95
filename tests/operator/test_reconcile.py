"""Steady-state reconcile against the real control plane: the operator runs as a process,
children appear with owners and labels, pods become Ready on fake GPU nodes, a spec change
makes a new revision, an idle resync writes nothing, and deleting the policy removes all."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bptest import INTERACTIVE_LANE, Kube, OperatorProcess, policy, start_operator

pytestmark = pytest.mark.cluster

POLICY: dict[str, Any] = policy(
    "ranker",
    lanes=[{**INTERACTIVE_LANE, "priority": 10}],
    rollout={"steps": [{"weight": 50, "pause": "1h"}], "analysisInterval": "10s"},
)


@pytest.fixture
def operator(kube: Kube, namespace: str, tmp_path: Path) -> Iterator[OperatorProcess]:
    # No Prometheus here: steady state needs none (a canary's analysis would report Error).
    op = start_operator(kube, namespace, tmp_path, prometheus_url="http://127.0.0.1:9")
    yield op
    op.stop()


def status_of(kube: Kube, namespace: str, name: str = "ranker") -> dict[str, Any]:
    obj = kube.get("batchingpolicy", name, namespace)
    return (obj or {}).get("status") or {}


def ready_replicas(kube: Kube, namespace: str, name: str) -> int:
    dep = kube.get("deployment", name, namespace)
    return int(((dep or {}).get("status") or {}).get("readyReplicas", 0))


def test_policy_reconciles_into_owned_children(kube: Kube, namespace: str, operator: OperatorProcess) -> None:
    kube.apply(POLICY, "-n", namespace)
    policy = kube.get("batchingpolicy", "ranker", namespace)
    assert policy is not None
    uid = policy["metadata"]["uid"]

    status = kube.wait_for(
        lambda: (s := status_of(kube, namespace)).get("phase") == "Healthy" and s, 90, "phase Healthy"
    )
    revision = status["stableRevision"]
    assert status["observedGeneration"] == policy["metadata"]["generation"]
    conditions = {c["type"]: c["status"] for c in status["conditions"]}
    assert conditions["Ready"] == "True"
    assert conditions.get("Stalled", "False") == "False"

    # The immutable revision ConfigMap holds a runtime config the runtime can load.
    cm = kube.get("configmap", f"ranker-{revision}", namespace)
    assert cm is not None and cm["immutable"] is True
    config = json.loads(cm["data"]["config.json"])
    assert config["revision"] == revision and config["lanes"][0]["maxQueueDelay"] == "2ms"

    dep = kube.get("deployment", "ranker-stable", namespace)
    svc = kube.get("service", "ranker", namespace)
    assert dep is not None and svc is not None
    for obj in (cm, dep, svc):
        (owner,) = obj["metadata"]["ownerReferences"]
        assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == (
            "BatchingPolicy",
            "ranker",
            uid,
            True,
        )
        assert obj["metadata"]["labels"]["batchpilot.dev/policy"] == "ranker"
        assert any(f["manager"] == "batchpilot" for f in obj["metadata"]["managedFields"])
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert pod_labels["batchpilot.dev/revision"] == revision
    assert pod_labels["batchpilot.dev/track"] == "stable"
    assert svc["spec"]["selector"] == {"batchpilot.dev/policy": "ranker"}
    container = dep["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert container["securityContext"]["readOnlyRootFilesystem"] is True

    # Pods are scheduled on the fake GPU nodes and become Ready: Deployment status is real.
    kube.wait_for(lambda: ready_replicas(kube, namespace, "ranker-stable") == 2, 90, "2 ready stable pods")
    pods = json.loads(kube.kubectl("get", "pods", "-n", namespace, "-o", "json").stdout)["items"]
    assert {p["spec"]["nodeName"] for p in pods} <= {"gpu-node-0", "gpu-node-1"}

    # The spec itself is never written by the operator.
    managers = {
        f["manager"]
        for f in kube.get("batchingpolicy", "ranker", namespace)["metadata"]["managedFields"]
        if f.get("subresource") != "status"
    }
    assert "batchpilot" not in managers


def test_idle_resync_writes_nothing(kube: Kube, namespace: str, operator: OperatorProcess) -> None:
    kube.apply(POLICY, "-n", namespace)
    kube.wait_for(lambda: status_of(kube, namespace).get("phase") == "Healthy", 90, "phase Healthy")
    kube.wait_for(lambda: ready_replicas(kube, namespace, "ranker-stable") == 2, 90, "2 ready stable pods")

    def versions() -> dict[str, str]:
        out = {}
        for kind in ("batchingpolicy", "deployment", "service", "configmap"):
            items = json.loads(kube.kubectl("get", kind, "-n", namespace, "-o", "json").stdout)["items"]
            for item in items:
                out[f"{kind}/{item['metadata']['name']}"] = item["metadata"]["resourceVersion"]
        return out

    # Let the operator settle (the last reconcile wrote nothing), then watch three more.
    kube.wait_for(
        lambda: operator.metric("batchpilot_operator_reconciles_total", namespace=namespace, wrote="false") >= 1,
        60,
        "a reconcile without writes",
    )
    before = versions()
    idle = operator.metric("batchpilot_operator_reconciles_total", namespace=namespace, wrote="false")
    writes = operator.metric("batchpilot_operator_reconciles_total", namespace=namespace, wrote="true")
    kube.wait_for(
        lambda: operator.metric("batchpilot_operator_reconciles_total", namespace=namespace, wrote="false") >= idle + 3,
        60,
        "three more resyncs",
    )
    assert operator.metric("batchpilot_operator_reconciles_total", namespace=namespace, wrote="true") == writes
    assert versions() == before


def test_spec_change_makes_new_revision_and_delete_collects_children(
    kube: Kube, namespace: str, operator: OperatorProcess
) -> None:
    kube.apply(POLICY, "-n", namespace)
    first = kube.wait_for(lambda: status_of(kube, namespace).get("stableRevision"), 90, "a stable revision")

    changed = copy.deepcopy(POLICY)
    changed["spec"]["lanes"][0]["maxQueueDelay"] = "4ms"
    kube.apply(changed, "-n", namespace)
    second = kube.wait_for(
        lambda: (r := status_of(kube, namespace).get("desiredRevision")) != first and r,
        60,
        "a new desired revision",
    )
    cm = kube.wait_for(lambda: kube.get("configmap", f"ranker-{second}", namespace), 60, "the new revision's ConfigMap")
    assert json.loads(cm["data"]["config.json"])["lanes"][0]["maxQueueDelay"] == "4ms"
    assert kube.get("configmap", f"ranker-{first}", namespace) is not None  # stable still serves it

    kube.kubectl("delete", "batchingpolicy", "ranker", "-n", namespace, "--wait=true", "--timeout=60s")

    def gone() -> bool:
        left = kube.kubectl(
            "get",
            "deployments,services,configmaps",
            "-n",
            namespace,
            "-l",
            "batchpilot.dev/policy=ranker",
            "-o",
            "name",
        ).stdout.split()
        return not left

    kube.wait_for(gone, 90, "garbage collection of the children")
