"""The controller loop on the real control plane: children come from watch-fed caches, an
idle policy costs no API read, a child deleted by hand is repaired through its watch, and two
leader-elected operators hand over when the leader is killed.

Requests are counted where they land: the apiserver's audit log (the session cluster writes
one), attributed by the user agent each operator sends (``batchpilot-operator/<identity>``).
"""

from __future__ import annotations

import copy
import json
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from bptest import INTERACTIVE_LANE, NO_PROMETHEUS, Kube, OperatorProcess, policy, start_operator

pytestmark = pytest.mark.cluster

POLICY: dict[str, Any] = policy(
    "ranker",
    lanes=[dict(INTERACTIVE_LANE)],
    rollout={"steps": [{"weight": 50, "pause": "1h"}], "analysisInterval": "10s"},
)
READS = {"get", "list"}


def _ts(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def audit(kube: Kube, since: datetime, until: datetime, agent: str) -> list[dict[str, Any]]:
    """Requests received in [since, until) from user agents starting with ``agent``."""
    assert kube.audit_log is not None
    # The apiserver writes its audit log in batches: make a request after ``until`` and wait
    # for it to appear, so every request of the window is in the file.
    marker = f"audit-marker-{uuid.uuid4().hex[:8]}"
    kube.kubectl("get", "namespace", marker, check=False)

    def flushed() -> bool:
        return marker in kube.audit_log.read_text(errors="replace") if kube.audit_log.exists() else False

    kube.wait_for(flushed, 30, "the audit log to be written")
    found: dict[str, dict[str, Any]] = {}
    with kube.audit_log.open(errors="replace") as f:
        for line in f:
            if agent not in line:
                continue
            entry = json.loads(line)
            if not entry.get("userAgent", "").startswith(agent):
                continue
            if since <= _ts(entry["requestReceivedTimestamp"]) < until:
                found[entry["auditID"]] = entry
    return list(found.values())


def need_audit(kube: Kube) -> None:
    if kube.audit_log is None:
        pytest.skip("needs the local control plane's audit log")


def status_of(kube: Kube, namespace: str) -> dict[str, Any]:
    return ((kube.get("batchingpolicy", "ranker", namespace) or {}).get("status")) or {}


def healthy_and_ready(kube: Kube, namespace: str) -> None:
    """Healthy, both stable pods ready."""
    kube.wait_for(lambda: status_of(kube, namespace).get("phase") == "Healthy", 90, "phase Healthy")
    kube.wait_for(
        lambda: (
            int(
                (((kube.get("deployment", "ranker-stable", namespace) or {}).get("status")) or {}).get(
                    "readyReplicas", 0
                )
            )
            == 2
        ),
        90,
        "2 ready stable pods",
    )


def settle(kube: Kube, namespace: str, op: OperatorProcess) -> None:
    """Healthy, both stable pods ready, and the operator has nothing queued or due."""
    healthy_and_ready(kube, namespace)
    kube.wait_for(
        lambda: (
            status_of(kube, namespace).get("conditions")
            and op.metric("batchpilot_operator_workqueue_depth") == 0
            and op.metric("batchpilot_operator_requeues_pending") == 0
        ),
        60,
        "an idle work queue with no requeue pending",
    )


@pytest.fixture
def identity() -> str:
    return f"op-{uuid.uuid4().hex[:6]}"


def test_idle_policy_makes_no_api_reads(kube: Kube, namespace: str, tmp_path: Path, identity: str) -> None:
    """With a 1 s safety resync the policy is reconciled every second, from the caches only."""
    need_audit(kube)
    op = start_operator(kube, namespace, tmp_path, NO_PROMETHEUS, resync=1.0, env={"BATCHPILOT_IDENTITY": identity})
    try:
        kube.apply(POLICY, "-n", namespace)
        healthy_and_ready(kube, namespace)
        idle = lambda: op.metric("batchpilot_operator_reconciles_total", namespace=namespace, wrote="false")  # noqa: E731
        kube.wait_for(lambda: idle() >= 1, 60, "a reconcile that wrote nothing")
        start_idle, start_reads = idle(), op.metric("batchpilot_operator_api_requests_total", verb="GET")
        since = datetime.now(UTC)
        kube.wait_for(lambda: idle() >= start_idle + 8, 60, "eight more idle reconciles")
        until = datetime.now(UTC)
        assert op.metric("batchpilot_operator_api_requests_total", verb="GET") == start_reads
        requests = audit(kube, since, until, f"batchpilot-operator/{identity}")
        assert not [r for r in requests if r["verb"] != "watch"], requests
        # the window saw real reconciles, and the audit log does see this operator's requests
        assert idle() >= start_idle + 8
        assert audit(kube, datetime(2000, 1, 1, tzinfo=UTC), until, f"batchpilot-operator/{identity}")
    finally:
        op.stop()


def test_child_deleted_by_hand_is_recreated_through_its_watch(
    kube: Kube, namespace: str, tmp_path: Path, identity: str
) -> None:
    op = start_operator(kube, namespace, tmp_path, NO_PROMETHEUS, resync=0, env={"BATCHPILOT_IDENTITY": identity})
    try:
        kube.apply(POLICY, "-n", namespace)
        settle(kube, namespace, op)
        revision = status_of(kube, namespace)["stableRevision"]
        before = {
            kind_name: kube.get(*kind_name.split("/"), namespace)["metadata"]["uid"]  # type: ignore[index]
            for kind_name in ("service/ranker", "deployment/ranker-stable", f"configmap/ranker-{revision}")
        }
        # Nothing is due and the periodic resync is off: only a watch event can bring a reconcile.
        assert op.metric("batchpilot_operator_requeues_pending") == 0
        for kind_name in before:
            kube.kubectl("delete", kind_name, "-n", namespace, "--wait=false")

        def recreated() -> dict[str, str] | None:
            now = {k: ((kube.get(*k.split("/"), namespace) or {}).get("metadata") or {}).get("uid") for k in before}
            return now if all(now[k] and now[k] != before[k] for k in before) else None  # type: ignore[misc]

        kube.wait_for(recreated, 30, "the deleted children re-created by the operator")
        managers = {f["manager"] for f in kube.get("service", "ranker", namespace)["metadata"]["managedFields"]}  # type: ignore[index]
        assert "batchpilot" in managers
    finally:
        op.stop()


@pytest.mark.slow
def test_two_operators_only_the_leader_writes_and_killing_it_hands_over(
    kube: Kube, namespace: str, tmp_path: Path
) -> None:
    need_audit(kube)
    election = ("--leader-elect", f"--leader-election-namespace={namespace}", "--leader-election-id=bp-test")
    ids = {"a": f"op-a-{uuid.uuid4().hex[:6]}", "b": f"op-b-{uuid.uuid4().hex[:6]}"}
    ops: dict[str, OperatorProcess] = {}
    try:
        ops["a"] = start_operator(
            kube, namespace, tmp_path, NO_PROMETHEUS, extra_args=election, env={"BATCHPILOT_IDENTITY": ids["a"]}
        )
        kube.wait_for(lambda: ops["a"].metric("batchpilot_operator_leader", identity=ids["a"]) == 1, 60, "a leads")
        ops["b"] = start_operator(
            kube, namespace, tmp_path, NO_PROMETHEUS, extra_args=election, env={"BATCHPILOT_IDENTITY": ids["b"]}
        )
        kube.wait_for(lambda: f"held by {ids['a']}" in ops["b"].log(), 60, "b to see a holding the Lease")
        assert ops["b"].metric("batchpilot_operator_leader", identity=ids["b"]) == 0
        standby_since = datetime.now(UTC)

        kube.apply(POLICY, "-n", namespace)
        kube.wait_for(lambda: status_of(kube, namespace).get("phase") == "Healthy", 90, "phase Healthy")
        changed = copy.deepcopy(POLICY)
        changed["spec"]["lanes"][0]["maxQueueDelay"] = "4ms"
        kube.apply(changed, "-n", namespace)
        kube.wait_for(lambda: kube.get("deployment", "ranker-canary", namespace), 60, "the canary Deployment")

        # the standby polls the Lease every 2 s: let the window hold a few of its reads
        kube.wait_for(
            lambda: len(audit(kube, standby_since, datetime.now(UTC), f"batchpilot-operator/{ids['b']}")) >= 2,
            30,
            "the standby's Lease reads",
        )
        killed_at = datetime.now(UTC)
        ops["a"].proc.kill()  # SIGKILL: no release, the Lease must expire
        ops["a"].proc.wait()
        standby = audit(kube, standby_since, killed_at, f"batchpilot-operator/{ids['b']}")
        # the standby read the Lease and did nothing else: no watch, no write
        assert standby and {(r["verb"], r.get("objectRef", {}).get("resource")) for r in standby} == {
            ("get", "leases")
        }, standby
        leader = audit(kube, standby_since, killed_at, f"batchpilot-operator/{ids['a']}")
        assert {"patch", "create"} & {
            r["verb"] for r in leader if r.get("objectRef", {}).get("resource") == "deployments"
        }

        kube.wait_for(
            lambda: ops["b"].metric("batchpilot_operator_leader", identity=ids["b"]) == 1, 40, "b to take over"
        )
        lease = kube.get("lease", "bp-test", namespace)
        assert lease is not None and lease["spec"]["holderIdentity"] == ids["b"]
        # the new leader carries on: an abort rolls the canary back
        kube.kubectl(
            "annotate", "-n", namespace, "batchingpolicy", "ranker", "batchpilot.dev/abort=test@2026-11-30T00:00:00Z"
        )
        kube.wait_for(lambda: status_of(kube, namespace).get("phase") == "RolledBack", 60, "phase RolledBack")
        kube.wait_for(lambda: kube.get("deployment", "ranker-canary", namespace) is None, 60, "canary deleted")
        after = audit(kube, killed_at, datetime.now(UTC), f"batchpilot-operator/{ids['b']}")
        assert any(r["verb"] == "delete" and r.get("objectRef", {}).get("resource") == "deployments" for r in after), (
            after
        )

        # SIGTERM releases the Lease for the next replica at once
        ops["b"].stop()
        assert ops["b"].proc.returncode == 0, ops["b"].log()[-2000:]
        released = kube.get("lease", "bp-test", namespace)
        assert released is not None and not released["spec"].get("holderIdentity")
    finally:
        for op in ops.values():
            op.stop()
