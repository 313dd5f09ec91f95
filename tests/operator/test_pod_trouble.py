"""Why a track's pods are not ready, in words (children.pod_trouble, pure): the evidence of a
CanaryNotReady rollback and of the Degraded condition. Only trouble counts."""

from __future__ import annotations

from typing import Any

import pytest

from batchpilot_operator import crashpoints
from batchpilot_operator.children import pod_trouble


def pod(name: str, *, node: str | None = "gpu-node-0", deleting: bool = False, **status: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if deleting:
        meta["deletionTimestamp"] = "2026-11-30T01:00:00Z"
    return {"metadata": meta, "spec": {"nodeName": node} if node else {}, "status": status}


UNSCHEDULABLE = {
    "type": "PodScheduled",
    "status": "False",
    "reason": "Unschedulable",
    "message": "0/2 nodes are available: 2 Insufficient nvidia.com/gpu.",
}


def test_unschedulable_names_the_schedulers_message() -> None:
    text = pod_trouble([pod("p-canary-a", node=None, conditions=[UNSCHEDULABLE])])
    assert text == "pod p-canary-a: Unschedulable: 0/2 nodes are available: 2 Insufficient nvidia.com/gpu."


def test_crash_loop_names_the_container_and_restarts() -> None:
    crashing = pod(
        "p-canary-b",
        containerStatuses=[
            {
                "name": "runtime",
                "restartCount": 4,
                "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s restarting"}},
            }
        ],
    )
    assert pod_trouble([crashing]) == (
        "pod p-canary-b: CrashLoopBackOff (container runtime, 4 restarts): back-off 40s restarting"
    )


def test_lost_node_and_limits() -> None:
    on_lost = [pod(f"p-stable-{i}", node="gpu-node-1") for i in range(5)]
    text = pod_trouble(on_lost, lost_nodes=frozenset({"gpu-node-1"}))
    assert text.count("node gpu-node-1 is not Ready") == 3 and text.endswith("and 2 more")
    marked = pod(
        "p-stable-x",
        node="gpu-node-2",
        conditions=[{"type": "Ready", "status": "False", "reason": "NodeNotReady"}],
    )
    assert pod_trouble([marked]) == "pod p-stable-x: node gpu-node-2 is not Ready"
    # what the node lifecycle controller leaves: Ready False (no reason), containers still ready
    left = pod(
        "p-stable-y",
        node="gpu-node-3",
        conditions=[{"type": "Ready", "status": "False"}, {"type": "ContainersReady", "status": "True"}],
    )
    assert pod_trouble([left]) == "pod p-stable-y: node gpu-node-3 is not Ready"


def test_starting_and_terminating_pods_are_no_trouble() -> None:
    starting = pod(
        "p-stable-a",
        conditions=[{"type": "Ready", "status": "False", "reason": "ContainersNotReady"}],
        containerStatuses=[{"name": "runtime", "state": {"waiting": {"reason": "ContainerCreating"}}}],
    )
    gone = pod("p-canary-z", node=None, deleting=True, conditions=[UNSCHEDULABLE])
    assert pod_trouble([starting, gone]) == ""


def test_crash_points_refuse_unknown_names() -> None:
    assert crashpoints._armed(None) == frozenset()
    assert crashpoints._armed("canary-created, rollback-half-done") == {"canary-created", "rollback-half-done"}
    with pytest.raises(ValueError, match="unknown crash point"):
        crashpoints._armed("canary-creatd")
    crashpoints.reached("canary-created")  # not armed in this process: nothing happens


def test_stable_keeps_the_pod_fields_it_runs() -> None:
    from batchpilot_operator.children import applied_hash, build_deployment
    from bptest import make_spec

    old = make_spec().model_copy(update={})
    new = make_spec(batch=16)
    new = new.model_copy(update={"resources": new.resources.model_copy(update={"gpus": 2})})
    running = build_deployment("p", "ns", "uid", old, "stable", old.revision(), 4)
    fresh = build_deployment("p", "ns", "uid", new, "stable", old.revision(), 3)
    from batchpilot_operator.children import keep_running_pod_fields

    kept = keep_running_pod_fields(fresh, running)
    container = kept["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"] == running["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert container["resources"] != fresh["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert kept["spec"]["replicas"] == 3, "replicas follow the decision"
    assert applied_hash(kept) not in (None, applied_hash(fresh)), "restamped"
    again = keep_running_pod_fields(build_deployment("p", "ns", "uid", new, "stable", old.revision(), 3), kept)
    assert applied_hash(again) == applied_hash(kept), "stable: an unchanged resync writes nothing"


def test_an_oom_kill_is_named_while_crash_looping_and_while_restarting() -> None:
    # What a real kubelet reports for a container over its memory limit (tests/node).
    oom = {"terminated": {"reason": "OOMKilled", "exitCode": 137}}
    looping = pod(
        "p-canary-c",
        containerStatuses=[
            {
                "name": "runtime",
                "restartCount": 2,
                "ready": False,
                "lastState": oom,
                "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 20s restarting"}},
            }
        ],
    )
    assert pod_trouble([looping]) == (
        "pod p-canary-c: CrashLoopBackOff (container runtime, 2 restarts, last terminated OOMKilled "
        "(exit code 137)): back-off 20s restarting"
    )
    restarting = pod(
        "p-canary-d",
        containerStatuses=[
            {"name": "runtime", "restartCount": 1, "ready": False, "lastState": oom, "state": {"running": {}}}
        ],
    )
    assert pod_trouble([restarting]) == "pod p-canary-d: OOMKilled (container runtime, 1 restarts, exit code 137)"
    # Ready again after an old OOM kill: no trouble now.
    recovered = pod(
        "p-canary-e",
        containerStatuses=[
            {"name": "runtime", "restartCount": 1, "ready": True, "lastState": oom, "state": {"running": {}}}
        ],
    )
    assert pod_trouble([recovered]) == ""
