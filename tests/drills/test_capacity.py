"""Drills 6 and 7: capacity faults, on a cluster of four fake GPU nodes of one GPU each.

7. A canary that never becomes ready (unschedulable: it asks for more GPUs than any node
   has) is rolled back at ``spec.rollout.progressDeadline`` with reason CanaryNotReady, the
   scheduler's message in the Event and the ledger; the stable is untouched and the canary's
   Deployment (its GPU requests) goes away. Before progressDeadline existed it was Stalled
   forever, holding its share of the GPUs.
6. Partial region loss: half the GPU nodes stop reporting (kwok stops heart-beating them, as
   when a zone's kubelets are cut off) while a change rolls out. The stable track losing a pod
   shows as the Degraded condition naming the node; the canary that then cannot be scheduled
   is rolled back at the deadline (CanaryNotReady), stable untouched; when the nodes come
   back the stable is whole again and Degraded clears.

No analysis runs here (the canary never gets ready), so there is no Prometheus, runtime
process or traffic: the faults are the cluster's own.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from bpdrill import Drill
from bpdrill_stack import DrillStack, condition, policy

pytestmark = [pytest.mark.cluster]

DEADLINE = "20s"
CLUSTER = {"gpu_nodes": 4, "gpus_per_node": 1, "node_monitor_grace_period": 10, "node_lease_seconds": 8}


def _events(s: DrillStack, reason: str) -> list[str]:
    return [e["message"] for e in s.events() if e["reason"] == reason]


def _pods(s: DrillStack, track: str) -> list[dict[str, Any]]:
    import json

    out = s.kube.kubectl("get", "pods", "-n", s.namespace, "-l", f"batchpilot.dev/track={track}", "-o", "json").stdout
    items: list[dict[str, Any]] = json.loads(out)["items"]
    return items


def _ready_stable(s: DrillStack) -> int:
    dep = s.deployment("stable") or {}
    return int((dep.get("status") or {}).get("readyReplicas") or 0)


def test_unschedulable_canary_rolled_back_at_progress_deadline(tmp_path: Path, drill: Drill) -> None:
    drill.fault = "a change asks for 2 GPUs per pod on nodes of 1 GPU: the canary pod is Unschedulable"
    drill.expected = (
        f"rolled back at progressDeadline ({DEADLINE}) with reason CanaryNotReady and the scheduler's message in "
        "the Event and ledger; stable untouched; canary Deployment gone; not retried"
    )
    with DrillStack.start(tmp_path, runtime=False, **CLUSTER) as s:
        op = s.operator()
        s.apply(policy(progressDeadline=DEADLINE))
        first = s.wait(lambda st: st.get("phase") == "Healthy", 120, "the first revision Healthy")["stableRevision"]
        greedy = policy("4ms", progressDeadline=DEADLINE)
        greedy["spec"]["resources"] = {"gpus": 2}
        s.apply(greedy)
        t0 = time.monotonic()
        canary = s.wait(lambda st: st.get("canaryRevision") not in (None, first), 60, "the canary")["canaryRevision"]
        pending = s.kube.wait_for(
            lambda: [
                c
                for p in _pods(s, "canary")
                for c in (p.get("status") or {}).get("conditions", [])
                if c["type"] == "PodScheduled" and c.get("reason") == "Unschedulable"
            ],
            60,
            "the canary pod Unschedulable",
        )
        detected = time.monotonic() - t0
        rolled = s.wait(lambda st: st.get("phase") == "RolledBack", 120, "the CanaryNotReady rollback")
        rolled_after = time.monotonic() - t0
        last = rolled["history"][-1]
        assert (last["revision"], last["outcome"], last["reason"]) == (canary, "RolledBack", "CanaryNotReady")
        assert "Unschedulable" in last["evidence"] and "Insufficient nvidia.com/gpu" in last["evidence"], last
        assert "0/1 canary pods ready 20s (progressDeadline)" in last["evidence"]
        entry = next(e for e in reversed(rolled["ledger"]) if e["kind"] == "RolledBack")
        assert entry["reason"] == "CanaryNotReady" and "Unschedulable" in entry["evidence"]
        s.kube.wait_for(lambda: _events(s, "RolledBack"), 30, "the RolledBack Event")
        (event,) = _events(s, "RolledBack")
        assert "CanaryNotReady" in event and "Insufficient nvidia.com/gpu" in event, event
        # stable untouched and whole again; the canary's GPU request is gone
        assert rolled["stableRevision"] == first
        s.kube.wait_for(lambda: s.deployment("canary") is None, 60, "the canary Deployment deleted")
        s.kube.wait_for(lambda: not _pods(s, "canary"), 60, "no canary pod left")
        s.kube.wait_for(lambda: _ready_stable(s) == 2, 60, "the stable at 2/2 ready")
        stable = s.deployment("stable")
        assert (
            stable is not None and stable["spec"]["template"]["metadata"]["labels"]["batchpilot.dev/revision"] == first
        )
        recovered = time.monotonic() - t0
        assert op.metric("batchpilot_operator_rollbacks_total", reason="CanaryNotReady") == 1
        # not retried: further reconciles leave it RolledBack with no canary
        n = op.metric("batchpilot_operator_reconciles_total", namespace=s.namespace)
        s.kube.wait_for(
            lambda: op.metric("batchpilot_operator_reconciles_total", namespace=s.namespace) >= n + 3,
            60,
            "three more reconciles",
        )
        again = s.status()
        assert again["phase"] == "RolledBack" and not again.get("canaryRevision")
        assert s.audit is not None and not s.audit.violations, s.audit.violations
        drill.observed = (
            f"pod Unschedulable after {detected:.1f}s ({pending[0].get('message', '')[:80]}); rolled back "
            f"(CanaryNotReady) {rolled_after:.1f}s after the change; stable {first} untouched, 2/2 ready "
            f"{recovered:.1f}s after; Event: {event[:160]}"
        )
        drill.detected(detected)
        drill.recovered(rolled_after)
        drill.figures = {"progress_deadline_s": 20, "stable_whole_again_s": round(recovered, 1)}


def _set_managed(s: DrillStack, nodes: list[str], managed: bool) -> None:
    """Cut kwok (the nodes' "kubelets") off from ``nodes``, or give them back. kwok picks its
    nodes by annotation when it starts (it does not drop a node whose annotation changes
    under it), so it is restarted around the change; the other nodes miss one or two
    heartbeats, well inside their grace period."""
    s.cluster.stop_component("kwok")
    value = "fake" if managed else "lost"
    for node in nodes:
        s.kube.kubectl("annotate", "node", node, f"kwok.x-k8s.io/node={value}", "--overwrite")
    s.cluster.start_component("kwok")


def _report_ready(s: DrillStack, pod: str) -> None:
    import json

    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    conditions = [
        {"type": t, "status": "True", "lastTransitionTime": now}
        for t in ("Initialized", "Ready", "ContainersReady", "PodScheduled")
    ]
    s.kube.kubectl(
        "patch",
        "pod",
        pod,
        "-n",
        s.namespace,
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps({"status": {"conditions": conditions}}),
    )


def _node_ready(s: DrillStack, node: str) -> str:
    return s.kube.kubectl(
        "get", "node", node, "-o", "jsonpath={.status.conditions[?(@.type=='Ready')].status}"
    ).stdout.strip()


@pytest.mark.long_drill
def test_partial_region_loss_mid_canary(tmp_path: Path, drill: Drill) -> None:
    drill.fault = (
        "mid-canary, 2 of 4 GPU nodes (the canary's and one stable pod's) stop heart-beating (kwok no longer "
        "manages them, as when a zone's kubelets are cut off)"
    )
    drill.expected = (
        "Degraded condition (StableUnderCapacity) naming the lost node, a Warning Event and the gauge the alert "
        "reads; the canary without its pod waits, then is rolled back at progressDeadline (CanaryNotReady); stable "
        "revision untouched; Degraded clears when the nodes return"
    )
    with DrillStack.start(tmp_path, runtime=False, **CLUSTER) as s:
        op = s.operator()
        three = policy(progressDeadline=DEADLINE)
        three["spec"]["replicas"] = 3
        s.apply(three)
        first = s.wait(lambda st: st.get("phase") == "Healthy", 120, "3 stable pods Healthy")["stableRevision"]
        change = policy("4ms", progressDeadline=DEADLINE)
        change["spec"]["replicas"] = 3
        s.apply(change)  # step 1: 25% -> 1 canary pod, 2 stable
        s.wait(lambda st: (st.get("rollout") or {}).get("stepStartedAt"), 120, "the canary pod ready, step running")
        s.kube.wait_for(lambda: _ready_stable(s) == 2 and len(_pods(s, "stable")) == 2, 60, "the stable at 2 pods")
        (canary_pod,) = _pods(s, "canary")
        stable_nodes = sorted(p["spec"]["nodeName"] for p in _pods(s, "stable"))
        lost = [canary_pod["spec"]["nodeName"], stable_nodes[0]]
        t0 = time.monotonic()
        _set_managed(s, lost, managed=False)
        s.kube.wait_for(lambda: all(_node_ready(s, n) != "True" for n in lost), 120, "the lost nodes NotReady")
        nodes_down = time.monotonic() - t0
        degraded = s.wait(
            lambda st: (
                (c := condition(st, "Degraded")) is not None and c["status"] == "True" and "not Ready" in c["message"]
            ),
            120,
            "the Degraded condition naming the lost node",
        )
        detected = time.monotonic() - t0
        cond = condition(degraded, "Degraded")
        assert cond is not None and cond["reason"] == "StableUnderCapacity" and stable_nodes[0] in cond["message"], cond
        assert op.metric("batchpilot_operator_policy_degraded", reason="StableUnderCapacity") == 1
        s.kube.wait_for(lambda: _events(s, "Degraded"), 30, "the Degraded Event")
        rolled = s.wait(lambda st: st.get("phase") == "RolledBack", 180, "the canary rolled back (CanaryNotReady)")
        rolled_after = time.monotonic() - t0
        last = rolled["history"][-1]
        assert (last["outcome"], last["reason"]) == ("RolledBack", "CanaryNotReady"), last
        assert f"node {lost[0]} is not Ready" in last["evidence"], last
        assert rolled["stableRevision"] == first
        assert _events(s, "CanaryPodsLost"), "the canary losing its pod left a Warning"
        s.kube.wait_for(lambda: s.deployment("canary") is None, 60, "the canary Deployment deleted")
        # still short while the nodes are away: 3 stable pods wanted, one on a lost node
        still = s.wait(
            lambda st: (c := condition(st, "Degraded")) is not None and c["status"] == "True", 60, "Degraded held"
        )
        still_msg = (condition(still, "Degraded") or {}).get("message", "")
        drill.figures["degraded_while_away"] = still_msg[:200]
        # the region comes back
        t_back = time.monotonic()
        _set_managed(s, lost, managed=True)
        s.kube.wait_for(lambda: all(_node_ready(s, n) == "True" for n in lost), 120, "the nodes Ready again")
        # A returning kubelet reports its pods Ready again; kwok does not re-ready a pod it
        # already started, so the drill plays that part for the pods on the returned nodes.
        for pod in _pods(s, "stable"):
            if pod["spec"].get("nodeName") in lost and not pod["metadata"].get("deletionTimestamp"):
                _report_ready(s, pod["metadata"]["name"])
        whole = s.wait(
            lambda st: (c := condition(st, "Degraded")) is not None and c["status"] == "False",
            240,
            "Degraded cleared with the nodes back",
        )
        recovered = time.monotonic() - t_back
        assert whole["stableRevision"] == first and _ready_stable(s) == 3
        assert op.metric("batchpilot_operator_policy_degraded", reason="StableUnderCapacity") == 0
        assert s.audit is not None and not s.audit.violations, s.audit.violations
        drill.observed = (
            f"nodes NotReady {nodes_down:.1f}s after the cut; Degraded ({cond['message'][:120]}) at {detected:.1f}s; "
            f"canary rolled back (CanaryNotReady: {last['evidence'][:140]}) at {rolled_after:.1f}s; stable "
            f"{first} untouched; Degraded while away ({still_msg[:80]}), cleared {recovered:.1f}s after the nodes "
            "returned"
        )
        drill.detected(detected)
        drill.recovered(recovered)
        drill.figures.update({"nodes_not_ready_s": round(nodes_down, 1), "rolled_back_s": round(rolled_after, 1)})
