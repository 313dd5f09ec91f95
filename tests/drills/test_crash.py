"""Drill 1: the operator SIGKILLed at every rollout transition, and the leader killed mid-canary.

Each operator process is started with one crash point armed (``BATCHPILOT_CRASH_AT``, see
``batchpilot_operator/crashpoints.py``) and SIGKILLs itself there; the next one is started
with the next point armed, so one rollout (a good change promoted through two steps, then a
bad change rolled back) meets every point once. The outcome must be what an uncrashed run
gives (tests/operator/test_canary_e2e.py runs that one): the good change promoted once, the
bad one rolled back at exactly failureLimit Failed analyses, no decision recorded twice,
and, all along, no pod running a revision whose ConfigMap is missing.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from bpdrill import Drill
from bpdrill_stack import BAD, DrillStack, duplicate_decisions, kill, policy, wait_exit

pytestmark = [pytest.mark.cluster, pytest.mark.prometheus, pytest.mark.slow]

# (point armed, what the test does to get there), in the order one rollout meets them.
CHAIN = (
    "configmap-written",  # the first revision's ConfigMap, before its Deployment
    "canary-created",  # the good change's canary Deployment
    "analysis-recorded",  # its first analysis
    "step-advanced",  # step 1 -> 2
    "promotion-half-done",  # promoted: status written, stable switched, canary not yet gone
    "analysis-recorded",  # the bad change: an analysis (a Failed one counts) recorded
    "rollback-half-done",  # rolled back: status written, canary still running
)


def test_operator_crash_at_every_rollout_transition(tmp_path: Path, drill: Drill) -> None:
    drill.fault = "operator SIGKILLed at each crash point: " + ", ".join(CHAIN)
    drill.expected = (
        "after each restart the rollout carries on to the uncrashed outcome: good change promoted once, bad change "
        "rolled back at failureLimit Failed analyses; no duplicate ledger entry; no pod without its ConfigMap"
    )
    with DrillStack.start(tmp_path, gpu_nodes=2) as s:
        assert s.harness is not None and s.audit is not None
        s.start_traffic()
        first_policy, good, bad = policy(), policy("4ms"), policy(**BAD)
        crashes: list[tuple[str, float]] = []
        ops = 0

        def crash_at(point: str, act: object = None) -> None:
            """Start an operator armed at ``point``, run ``act``, wait for it to SIGKILL itself."""
            nonlocal ops
            op = s.operator(env={"BATCHPILOT_CRASH_AT": point})
            ops += 1
            if callable(act):
                act()
            code = wait_exit(op, 240)
            assert code == -9, f"operator armed at {point} exited {code}, not SIGKILL:\n{op.log()[-2000:]}"
            assert f"crash point {point} reached" in op.log()
            crashes.append((point, time.monotonic()))

        def healthy_then(change: dict[str, object], stable_not: str | None) -> None:
            s.wait(
                lambda st: st.get("phase") == "Healthy" and st.get("stableRevision") not in (None, stable_not),
                240,
                f"Healthy after the crash at {crashes[-1][0]}",
            )
            s.harness.wait_ready("shop", 2, timeout=120)  # type: ignore[union-attr]
            s.apply(change)

        began = time.monotonic()
        crash_at(CHAIN[0], lambda: s.apply(first_policy))
        crash_at(CHAIN[1], lambda: healthy_then(good, None))
        first = s.status()["stableRevision"]
        for point in CHAIN[2:5]:
            crash_at(point)
        crash_at(CHAIN[5], lambda: healthy_then(bad, first))
        good_rev = s.status()["stableRevision"]
        crash_at(CHAIN[6])
        s.operator()  # unarmed: finishes the rollback
        ops += 1
        done = s.wait(
            lambda st: st.get("phase") == "RolledBack" and not st.get("canaryRevision"),
            180,
            "the bad change rolled back after the crash half-way through the rollback",
        )
        s.kube.wait_for(lambda: s.deployment("canary") is None, 60, "the canary Deployment gone")
        recovered = time.monotonic() - crashes[-1][1]
        sent, failed, lost = s.traffic()
        s.audit.stop()

        # The uncrashed outcome.
        assert done["stableRevision"] == good_rev != first
        bad_rev = done["desiredRevision"]
        assert bad_rev not in (first, good_rev)
        outcomes = [(h["revision"], h["outcome"]) for h in done["history"]]
        assert outcomes == [(first, "Promoted"), (good_rev, "Promoted"), (bad_rev, "RolledBack")], outcomes
        ledger = done["ledger"]
        assert not duplicate_decisions(ledger), duplicate_decisions(ledger)
        kinds = [(e["kind"], e["revision"]) for e in ledger if e["kind"] != "Analysis"]
        assert kinds.count(("Promoted", good_rev)) == 1, "no double promotion"
        assert kinds.count(("CanaryStarted", good_rev)) == 1 and kinds.count(("CanaryStarted", bad_rev)) == 1
        assert kinds.count(("StepAdvanced", good_rev)) == 1
        rollback = next(e for e in ledger if e["kind"] == "RolledBack")
        assert rollback["reason"] == "AnalysisFailed", rollback
        failed_analyses = {e["time"] for e in s.ledger.entries(revision=bad_rev, outcome="Failed")}
        assert len(failed_analyses) == 2, f"failure count kept across the crash: {sorted(failed_analyses)}"
        assert s.audit.checks > 100 and not s.audit.violations, s.audit.violations
        # The Deployments match the status: stable runs the good revision, nothing else runs.
        stable = s.deployment("stable")
        assert stable is not None
        assert stable["spec"]["template"]["metadata"]["labels"]["batchpilot.dev/revision"] == good_rev

        drill.observed = (
            f"{len(CHAIN)} crashes, {ops} operator processes; promoted {good_rev} once, rolled back {bad_rev} "
            f"after {len(failed_analyses)} Failed analyses (failureLimit 2); 0 duplicate ledger entries; "
            f"ConfigMap audit: {s.audit.checks} checks, {len(s.audit.violations)} violations"
        )
        drill.detected(0.0)  # the crash is the process's own exit
        drill.recovered(recovered)
        drill.requests_sent, drill.requests_failed, drill.requests_lost = sent, failed, lost
        # seconds from each crash to the next transition reached (the next crash) or, for the
        # last one, to the rollback complete: restart, cache sync, and the rollout's own pace
        times = [t for _, t in crashes] + [crashes[-1][1] + recovered]
        for i, (point, t) in enumerate(crashes):
            drill.figures[f"{i + 1}_{point}_to_next_s"] = round(times[i + 1] - t, 1)
        drill.figures["operator_processes"] = ops
        drill.figures["audit_checks"] = s.audit.checks
        drill.figures["whole_drill_s"] = round(time.monotonic() - began, 1)


@pytest.mark.long_drill  # CI has the hand-over already (tests/operator/test_control_loop.py)
def test_leader_killed_mid_canary_standby_finishes(tmp_path: Path, drill: Drill) -> None:
    drill.fault = "leader operator (of 2, --leader-elect) SIGKILLed mid-canary"
    drill.expected = "the standby takes the Lease within its 15 s duration and finishes the rollout: promoted once"
    with DrillStack.start(tmp_path, gpu_nodes=2) as s:
        assert s.harness is not None and s.audit is not None
        s.start_traffic()
        election = ("--leader-elect", f"--leader-election-namespace={s.namespace}", "--leader-election-id=drill")
        ids = {"a": "drill-a", "b": "drill-b"}
        a = s.operator(env={"BATCHPILOT_IDENTITY": ids["a"]}, extra_args=election)
        s.kube.wait_for(lambda: a.metric("batchpilot_operator_leader", identity=ids["a"]) == 1, 60, "a leads")
        b = s.operator(env={"BATCHPILOT_IDENTITY": ids["b"]}, extra_args=election)
        s.apply(policy())
        first = s.wait(lambda st: st.get("phase") == "Healthy", 180, "the first revision Healthy")["stableRevision"]
        s.harness.wait_ready("shop", 2, timeout=120)
        s.apply(policy("4ms"))
        mid = s.wait(
            lambda st: st.get("canaryRevision") not in (None, first) and st.get("currentStepIndex") == 0,
            120,
            "the canary at step 1",
        )
        kill(a)
        killed = time.monotonic()
        s.kube.wait_for(lambda: b.metric("batchpilot_operator_leader", identity=ids["b"]) == 1, 60, "b to take over")
        took_over = time.monotonic() - killed
        done = s.wait(
            lambda st: st.get("phase") == "Healthy" and st.get("stableRevision") == mid["canaryRevision"],
            240,
            "the standby to finish the rollout",
        )
        recovered = time.monotonic() - killed
        sent, failed, lost = s.traffic()
        s.audit.stop()
        kinds = [(e["kind"], e["revision"]) for e in done["ledger"] if e["kind"] != "Analysis"]
        assert kinds.count(("Promoted", mid["canaryRevision"])) == 1
        assert not duplicate_decisions(done["ledger"])
        assert not s.audit.violations, s.audit.violations
        drill.observed = (
            f"standby leading {took_over:.1f}s after the kill; promoted {mid['canaryRevision']} once, "
            f"{recovered:.1f}s after the kill"
        )
        drill.detected(took_over)
        drill.recovered(recovered)
        drill.requests_sent, drill.requests_failed, drill.requests_lost = sent, failed, lost
