"""Table-driven tests of the pure rollout planner. Time is injected; nothing sleeps.

A tiny simulated world (``converge``) makes the observed Deployments match what the
previous decision asked for, so scenarios run through whole rollouts; analyses are built by
the real verdict code (``analysis.verdicts``) from fake measurements.
"""

from __future__ import annotations

import copy
import dataclasses
from datetime import datetime, timedelta
from typing import Any

import pytest

from batchpilot_operator.analysis import (
    AnalysisResult,
)
from batchpilot_operator.rollout import (
    CANARY_READY_DEADLINE,
    POLL_SECONDS,
    Commands,
    Decision,
    Observed,
    PlanInputs,
    TrackObserved,
    analysis_due,
    analysis_target,
    plan,
    pods_needed,
    split_replicas,
)
from batchpilot_operator.spec import PolicySpec
from batchpilot_operator.status import (
    ANALYSIS_LIMIT,
    DECISION_LIMIT,
    LedgerEntry,
    Phase,
    Status,
    trim_ledger,
)
from batchpilot_operator.tune.calibration import Check, RevisionCheck
from bp_plan import NS, POLICY, Sim, at, converge, measured
from bptest import make_spec


def healthy(spec: PolicySpec, **kw: Any) -> Sim:
    sim = Sim(spec, **kw)
    sim.tick(at(0))
    d = sim.tick(at(1))
    assert d.status.phase is Phase.HEALTHY
    return sim


def start_canary(sim: Sim, now: datetime, new_spec: PolicySpec) -> Decision:
    sim.set_spec(new_spec)
    sim.tick(now)  # canary created, pods not ready yet
    return sim.tick(now)  # pods ready: step clock starts


def reasons(d: Decision) -> list[str]:
    return [e.reason for e in d.events]


def cond(status: Status, type_: str) -> tuple[str, str]:
    c = status.condition(type_)  # type: ignore[arg-type]
    assert c is not None
    return c.status, c.reason


# --------------------------------------------------------------------------- replicas


@pytest.mark.parametrize(
    ("total", "weight", "stable", "canary", "effective"),
    [
        (1, 25, 1, 1, 50),  # one replica: temporarily one of each
        (1, 100, 0, 1, 100),
        (2, 10, 1, 1, 50),
        (2, 50, 1, 1, 50),
        (4, 25, 3, 1, 25),
        (4, 50, 2, 2, 50),
        (4, 99, 1, 4, 80),  # stable keeps one pod until 100
        (10, 25, 7, 3, 30),  # 2.5 rounds half up
        (10, 10, 9, 1, 10),
        (10, 1, 9, 1, 10),  # at least one canary pod
        (100, 1, 99, 1, 1),
        (3, 100, 0, 3, 100),
        (5, 0, 5, 0, 0),
    ],
)
def test_split_replicas(total: int, weight: int, stable: int, canary: int, effective: int) -> None:
    s = split_replicas(total, weight)
    assert (s.stable, s.canary, s.effective_weight) == (stable, canary, effective)


@pytest.mark.parametrize(("total", "weight"), [(0, 10), (3, -1), (3, 101)])
def test_split_replicas_rejects(total: int, weight: int) -> None:
    with pytest.raises(ValueError):
        split_replicas(total, weight)


# --------------------------------------------------------------------------- first revision


def test_first_revision_rolls_out_directly_as_stable() -> None:
    spec = make_spec()
    sim = Sim(spec)
    d = sim.tick(at(0), converge_after=False)
    assert d.status.phase is Phase.PENDING
    assert (d.stable_revision, d.stable_replicas, d.canary_revision, d.canary_replicas) == (
        spec.revision(),
        4,
        None,
        0,
    )
    assert d.requeue_after == POLL_SECONDS
    assert cond(d.status, "Reconciling") == ("True", "Pending")
    assert cond(d.status, "Ready")[0] == "False"
    # partly ready: still pending
    sim.observed = Observed(stable=TrackObserved(spec.revision(), 4, 2))
    assert sim.plan(at(1), converge_after=False).status.phase is Phase.PENDING
    sim.observed = Observed(stable=TrackObserved(spec.revision(), 4, 4))
    d = sim.plan(at(2))
    assert d.status.phase is Phase.HEALTHY
    assert d.status.stable_revision == spec.revision()
    assert "Initialized" in reasons(d)
    assert [h.outcome for h in d.status.history] == ["Promoted"]
    assert cond(d.status, "Ready") == ("True", "Healthy")
    assert cond(d.status, "Stalled")[0] == "False"
    assert d.status.observed_generation == 1
    assert all(c.observed_generation == 1 for c in d.status.conditions)
    assert d.requeue_after is None
    # steady: nothing new happens
    d2 = sim.tick(at(100))
    assert d2.events == () and d2.status.history == d.status.history


def test_first_revision_replaced_before_ready_rolls_the_new_one_directly() -> None:
    sim = Sim(make_spec())
    sim.tick(at(0), converge_after=False)
    sim.observed = Observed(stable=TrackObserved(make_spec().revision(), 4, 1))
    sim.set_spec(make_spec(batch=16))
    d = sim.plan(at(5), converge_after=False)
    assert d.status.phase is Phase.PENDING and d.stable_revision == make_spec(batch=16).revision()
    assert d.canary_revision is None


def test_empty_status_adopts_running_stable_and_canaries_desired() -> None:
    old, new = make_spec(), make_spec(batch=16)
    sim = Sim(new)
    sim.observed = Observed(stable=TrackObserved(old.revision(), 4, 4))
    d = sim.plan(at(0), converge_after=False)
    assert d.status.stable_revision == old.revision()
    assert d.canary_revision == new.revision()
    assert "Adopted" in reasons(d) and "CanaryStarted" in reasons(d)
    assert d.status.phase is Phase.PROGRESSING


# --------------------------------------------------------------------------- canary progression


def test_new_revision_starts_canary_at_step_0_waiting_for_pods() -> None:
    sim = healthy(make_spec())
    old = sim.status.stable_revision
    new = make_spec(batch=16)
    sim.set_spec(new)
    d = sim.tick(at(10), converge_after=False)
    assert d.status.phase is Phase.PROGRESSING
    assert (d.stable_revision, d.stable_replicas) == (old, 3)
    assert (d.canary_revision, d.canary_replicas) == (new.revision(), 1)
    assert d.status.current_step_index == 0 and d.status.step_count == 2
    assert (d.status.step_weight, d.status.canary_weight) == (25, 25)
    assert d.status.rollout is not None and d.status.rollout.step_started_at is None
    assert "waiting for canary pods (0/1 ready)" in d.status.message
    assert d.requeue_after == POLL_SECONDS
    assert not analysis_due(new, d.status, at(1000))
    assert set(d.keep_revisions) == {old, new.revision()}
    # pods ready: the step clock starts now, first analysis one interval later
    sim.observed = converge(d)
    d = sim.plan(at(20))
    assert d.status.rollout is not None and d.status.rollout.step_started_at == at(20)
    assert not analysis_due(new, d.status, at(49))
    assert analysis_due(new, d.status, at(50))
    assert d.requeue_after == 30


def test_warmup_opens_the_first_analysis_window_after_the_pods_have_served() -> None:
    """spec.rollout.warmup: the step clock (pause and first analysis) starts that long after
    the canary's pods are all ready, at every step, and the status says so meanwhile."""
    new = make_spec(batch=16, warmup="20s")
    sim = healthy(make_spec(warmup="20s"))
    sim.set_spec(new)
    d = sim.tick(at(10), converge_after=False)
    sim.observed = converge(d)
    d = sim.plan(at(20))  # pods ready at 20: the clock starts at 40
    r = d.status.rollout
    assert r is not None and r.step_started_at == at(40)
    assert "warming up until 2026-11-30T01:00:40Z (spec.rollout.warmup)" in d.status.message
    assert not analysis_due(new, d.status, at(69))
    assert analysis_due(new, d.status, at(70))
    assert d.requeue_after == 50
    # the same plan a moment later during the warm-up is a fixed point
    sim.observed = converge(d)
    again = sim.plan(at(25))
    assert again.status.rollout is not None and again.status.rollout.step_started_at == at(40)
    d = sim.tick(at(70))
    assert d.analysis_outcomes == ("Successful",)
    assert "warming up" not in d.status.message
    d = sim.tick(at(100))  # pause (60 s) ends at 100: the next step's pods start
    assert d.status.current_step_index == 1
    d = sim.tick(at(101))  # ready at 101: its clock starts at 121
    assert d.status.rollout is not None and d.status.rollout.step_started_at == at(121)
    assert not analysis_due(new, d.status, at(150))


def test_full_rollout_promotes_through_all_steps() -> None:
    sim = healthy(make_spec())
    old = sim.status.stable_revision
    new = make_spec(batch=16)
    start_canary(sim, at(0), new)  # step clock starts at 0
    d = sim.tick(at(30))
    assert d.analysis_outcomes == ("Successful",)
    assert d.status.rollout is not None and d.status.rollout.passed_lanes == ["interactive"]
    assert d.status.current_step_index == 0  # the pause (60s) is not over
    assert "step pause ends at 2026-11-30T01:01:00Z" in d.status.message
    d = sim.tick(at(60))
    assert "StepAdvanced" in reasons(d)
    assert d.status.current_step_index == 1
    assert (d.stable_replicas, d.canary_replicas, d.status.canary_weight) == (2, 2, 50)
    assert d.status.rollout is not None and d.status.rollout.step_started_at is None
    d = sim.tick(at(61))  # pods of step 2 ready
    assert d.status.rollout is not None and d.status.rollout.step_started_at == at(61)
    sim.tick(at(91))
    d = sim.tick(at(121))
    assert "Promoted" in reasons(d)
    assert d.rollout_outcomes == ("Promoted",)
    assert d.status.stable_revision == new.revision()
    assert d.stable_revision == new.revision() and d.stable_replicas == 4
    assert d.status.rollout is None
    assert d.status.history[-1].outcome == "Promoted"
    promoted = [e for e in d.status.ledger if e.kind == "Promoted"]
    assert len(promoted) == 1 and "p99" in (promoted[0].evidence or "")
    assert old in d.keep_revisions
    d = sim.tick(at(122))
    assert d.status.phase is Phase.HEALTHY and d.canary_revision is None
    assert cond(d.status, "Ready") == ("True", "Healthy")


def test_promotion_keeps_canary_until_stable_is_ready() -> None:
    sim = healthy(make_spec(), roundtrip=True)
    new = make_spec(batch=16)
    start_canary(sim, at(0), new)
    sim.commands = Commands(promote="bob@t1")
    d = sim.tick(at(5), converge_after=False)
    assert d.status.stable_revision == new.revision()
    # the world: stable Deployment still rolling (new revision, 1 of 4 ready); canary has 1 pod
    sim.observed = Observed(stable=TrackObserved(new.revision(), 4, 1), canary=TrackObserved(new.revision(), 1, 1))
    d = sim.plan(at(6), converge_after=False)
    assert d.status.phase is Phase.PROGRESSING
    assert (d.canary_revision, d.canary_replicas) == (new.revision(), 1)
    assert d.requeue_after == POLL_SECONDS
    sim.observed = Observed(stable=TrackObserved(new.revision(), 4, 4), canary=TrackObserved(new.revision(), 1, 1))
    d = sim.plan(at(7))
    assert d.status.phase is Phase.HEALTHY and d.canary_revision is None and d.canary_replicas == 0
    assert d.rollout_outcomes == ()  # promoted once, not again


def test_a_promotion_waiting_for_a_gpu_says_so() -> None:
    # The stable rolls to the promoted revision beside the canary's pods: on a pool sized to the
    # steps its surge pod finds no GPU, and the phase message carries the scheduler's reason.
    sim = healthy(make_spec(), roundtrip=True)
    new = make_spec(batch=16)
    start_canary(sim, at(0), new)
    sim.commands = Commands(promote="bob@t1")
    sim.tick(at(5), converge_after=False)
    sim.observed = Observed(stable=TrackObserved(new.revision(), 4, 3), canary=TrackObserved(new.revision(), 1, 1))
    assert pods_needed(new, sim.status, sim.observed, at(6)) == ("stable",)
    why = "pod chat-stable-x: Unschedulable: 0/1 nodes are available: 1 Insufficient nvidia.com/gpu"
    inputs = PlanInputs(
        spec=new, generation=sim.generation, status=sim.status, observed=sim.observed, now=at(6), commands=sim.commands
    )
    d = plan(dataclasses.replace(inputs, pod_trouble={"stable": why}))
    assert d.status.phase is Phase.PROGRESSING and (d.canary_revision, d.canary_replicas) == (new.revision(), 1)
    assert d.status.message.endswith(f"; waiting on {why}"), d.status.message
    assert "waiting on" not in plan(inputs).status.message  # a pod merely starting says nothing


def test_two_lanes_step_needs_a_successful_analysis_of_every_lane() -> None:
    sim = healthy(make_spec(lanes=2))
    new = make_spec(lanes=2, batch=16)
    start_canary(sim, at(0), new)
    thin = {"background": {"samples": 3}}
    d = sim.tick(at(30), per_lane=thin)
    assert d.analysis_outcomes == ("Inconclusive",)
    d = sim.tick(at(60), per_lane=thin)
    assert d.status.current_step_index == 0  # background never passed: the step extends
    assert d.status.rollout is not None and d.status.rollout.passed_lanes == ["interactive"]
    assert "awaiting a Successful analysis of lane(s) background" in d.status.message
    d = sim.tick(at(90))
    assert d.status.current_step_index == 1


def test_successful_analysis_needed_even_when_pause_is_over() -> None:
    sim = healthy(make_spec())
    start_canary(sim, at(0), make_spec(batch=16))
    d = sim.tick(at(30), samples=10)
    d = sim.tick(at(60), samples=10)
    assert d.status.current_step_index == 0 and d.analysis_outcomes == ("Inconclusive",)
    d = sim.tick(at(75))  # not due: no analysis, no advance
    assert d.analysis_outcomes == () and d.status.current_step_index == 0
    d = sim.tick(at(90))
    assert d.status.current_step_index == 1


# --------------------------------------------------------------------------- inconclusive


def test_inconclusive_streak_stalls_but_never_rolls_back() -> None:
    sim = healthy(make_spec(maxInconclusive=3))
    start_canary(sim, at(0), make_spec(batch=16, maxInconclusive=3))
    stalled_events = 0
    for i in range(1, 11):
        d = sim.tick(at(30 * i), samples=0)
        stalled_events += reasons(d).count("Stalled")
        assert d.analysis_outcomes == ("Inconclusive",)
        if i < 3:
            assert cond(d.status, "Stalled")[0] == "False"
    assert d.status.phase is Phase.PROGRESSING
    assert cond(d.status, "Stalled") == ("True", "InconclusiveLimit")
    assert stalled_events == 1  # the transition, not every analysis
    assert d.status.rollout is not None and d.status.rollout.inconclusive_streak == 10
    assert d.status.failed_revisions == [] and d.canary_revision == make_spec(batch=16).revision()
    assert next(e for e in d.status.ledger if e.kind == "Stalled").reason == "InconclusiveLimit"
    stalled = d.status.condition("Stalled")
    assert stalled is not None and "the canary got no request; check the route" in stalled.message
    d = sim.tick(at(330))
    assert cond(d.status, "Stalled")[0] == "False"
    assert d.status.current_step_index == 1


def test_a_breach_both_tracks_share_passes_the_step_without_stalling() -> None:
    # Every window breaches the p99 SLO on both tracks alike (a CPU slower than the SLO
    # assumes): each passes the step, none counts toward maxInconclusive, and the canary
    # advances when the step's pause is over instead of showing Stalled on the way.
    long_step = [{"weight": 25, "pause": "300s"}, {"weight": 50, "pause": "60s"}]
    sim = healthy(make_spec(maxInconclusive=3, steps=long_step))
    start_canary(sim, at(0), make_spec(batch=16, maxInconclusive=3, steps=long_step))
    for i in range(1, 10):
        d = sim.tick(at(30 * i), p99=9.0, stable_values={"p99": 9.0})
        assert d.analysis_outcomes == ("Inconclusive",)
        assert cond(d.status, "Stalled")[0] == "False", d.status.message
        assert d.status.rollout is not None and d.status.rollout.inconclusive_streak == 0
        assert d.status.current_step_index == 0
    d = sim.tick(at(300), p99=9.0, stable_values={"p99": 9.0})
    d = sim.tick(at(330), p99=9.0, stable_values={"p99": 9.0})
    assert d.status.current_step_index == 1, d.status.message
    # Windows that hold the step still count, across a shared breach between them (it
    # neither counts nor resets): 3 thin windows stall the rollout, as without it.
    sim = healthy(make_spec(maxInconclusive=3, steps=long_step))
    start_canary(sim, at(0), make_spec(batch=16, maxInconclusive=3, steps=long_step))
    for i, kw in enumerate(
        [{"samples": 0}, {"p99": 9.0, "stable_values": {"p99": 9.0}}, {"samples": 0}, {"samples": 0}], start=1
    ):
        d = sim.tick(at(30 * i), **kw)
    assert d.status.rollout is not None and d.status.rollout.inconclusive_streak == 3
    assert cond(d.status, "Stalled") == ("True", "InconclusiveLimit")


def test_a_stall_on_thin_traffic_says_what_would_gather_enough() -> None:
    # 10 requests a 30 s window against minSamples 50: the tally of 4 windows holds 40, never
    # enough; at 1/3 request a second a 38 s window would gather 50 over 4 of them.
    sim = healthy(make_spec())
    start_canary(sim, at(0), make_spec(batch=16))
    for i in range(1, 4):
        d = sim.tick(at(30 * i), samples=10)
    stalled = d.status.condition("Stalled")
    assert stalled is not None and stalled.reason == "InconclusiveLimit", stalled
    assert "lane interactive's canary got 10 requests in the last 30s window (0.33/s)" in stalled.message
    assert "an analysisInterval of 38s or more gathers them, or a larger step weight" in stalled.message
    assert "holding, not rolling back" in stalled.message


def test_a_stall_on_a_quiet_stable_with_max_p99_increase_says_what_would_gather_enough() -> None:
    # maxP99Increase compares the canary with the stable's p99 of each window; a stable of 20
    # requests a 30 s window (minSamples 50) has none, so no window passes the step: the stall
    # names the stable's rate and the interval that would give it a p99, not the canary's.
    sim = healthy(make_spec(maxP99Increase=0.25, maxInconclusive=3))
    start_canary(sim, at(0), make_spec(batch=16, maxP99Increase=0.25, maxInconclusive=3))
    for i in range(1, 4):
        d = sim.tick(at(30 * i), samples=500, stable_values={"samples": 20})
        assert d.analysis_outcomes == ("Inconclusive",)
    stalled = d.status.condition("Stalled")
    assert stalled is not None and stalled.reason == "InconclusiveLimit", stalled
    assert "lane interactive's stable got 20 requests in the last 30s window (0.67/s)" in stalled.message
    assert "an analysisInterval of 75s or more gathers them, or a lower minSamples" in stalled.message
    # The same quiet stable without maxP99Increase: judged on the SLOs, the step passes.
    sim = healthy(make_spec(maxInconclusive=3))
    start_canary(sim, at(0), make_spec(batch=16, maxInconclusive=3))
    for i in range(1, 4):
        d = sim.tick(at(30 * i), samples=500, stable_values={"samples": 20})
    assert cond(d.status, "Stalled")[0] == "False"


def test_nan_or_no_data_is_inconclusive_not_failed() -> None:
    sim = healthy(make_spec())
    start_canary(sim, at(0), make_spec(batch=16))
    d = sim.tick(at(30), p99=float("nan"), samples=float("nan"))
    assert d.analysis_outcomes == ("Inconclusive",)
    assert d.status.rollout is not None and d.status.rollout.failures == 0


# --------------------------------------------------------------------------- failures


def test_failed_analyses_reach_failure_limit_and_roll_back_with_evidence() -> None:
    sim = healthy(make_spec())
    stable = sim.status.stable_revision
    new = make_spec(batch=16)
    start_canary(sim, at(0), new)
    d = sim.tick(at(30), p99=0.412)
    assert d.analysis_outcomes == ("Failed",) and "AnalysisFailed" in reasons(d)
    assert d.status.rollout is not None and d.status.rollout.failures == 1
    assert "failures 1/2" in d.status.message
    d = sim.tick(at(60), samples=1)  # an Inconclusive in between: failures stay counted
    assert d.status.rollout is not None and d.status.rollout.failures == 1
    d = sim.tick(at(90), p99=0.5)
    assert d.rollout_outcomes == ("RolledBack",)
    assert d.status.phase is Phase.ROLLED_BACK
    assert d.canary_revision is None and d.canary_replicas == 0
    assert (d.stable_revision, d.stable_replicas) == (stable, 4)
    assert "0.5s > 0.2s" in d.status.message and new.revision() in d.status.message
    assert d.status.failed_revisions[-1].revision == new.revision()
    assert d.status.history[-1].outcome == "RolledBack"
    assert d.status.history[-1].reason == "AnalysisFailed" and "0.5s > 0.2s" in d.status.history[-1].evidence
    assert cond(d.status, "Stalled") == ("True", "RolledBack")
    assert cond(d.status, "Ready") == ("False", "RolledBack")
    assert any(e.type == "Warning" and e.reason == "RolledBack" for e in d.events)
    analysis_entries = [e for e in d.status.ledger if e.kind == "Analysis" and e.outcome == "Failed"]
    assert [e.value for e in analysis_entries] == [0.412, 0.5]
    assert all(e.query and "histogram_quantile(0.99" in e.query for e in analysis_entries)
    assert analysis_entries[0].stable_value == 0.05 and analysis_entries[0].threshold == 0.2
    assert d.requeue_after is None


def test_queue_age_breach_fails_too() -> None:
    sim = healthy(make_spec(failureLimit=1))
    start_canary(sim, at(0), make_spec(batch=16, failureLimit=1))
    d = sim.tick(at(30), queue_age=0.3)
    assert d.status.phase is Phase.ROLLED_BACK
    assert "queue age: canary 0.3s > 0.05s" in d.status.message


def test_error_rate_breach_fails_a_fast_canary() -> None:
    # Latency and queue age well inside the SLO, but 5% of requests answered with an error.
    sim = healthy(make_spec(failureLimit=2))
    start_canary(sim, at(0), make_spec(batch=16, failureLimit=2))
    first = sim.tick(at(30), error_rate=0.05)
    assert first.status.phase is Phase.PROGRESSING and first.status.rollout is not None
    assert first.status.rollout.failures == 1
    lane = first.status.last_analysis.lanes[0] if first.status.last_analysis else None
    assert lane is not None and (lane.error_rate, lane.max_error_rate, lane.requests) == (0.05, 0.01, 500)
    d = sim.tick(at(60), error_rate=0.05)
    assert d.status.phase is Phase.ROLLED_BACK
    assert "error rate: canary 5% > 1%" in d.status.message
    failed = [e for e in d.status.ledger if e.kind == "Analysis" and e.outcome == "Failed"]
    assert {e.metric for e in failed} == {"errorRate"} and all(e.value == 0.05 for e in failed)


def test_rolled_back_revision_is_not_retried() -> None:
    sim = healthy(make_spec(failureLimit=1))
    bad = make_spec(batch=16, failureLimit=1)
    start_canary(sim, at(0), bad)
    d = sim.tick(at(30), p99=1.0)
    assert d.status.phase is Phase.ROLLED_BACK
    for t in (31, 100, 1000, 10000):
        d = sim.tick(at(t))
        assert d.status.phase is Phase.ROLLED_BACK and d.canary_revision is None
        assert d.events == () and d.rollout_outcomes == ()
    # a non-revision change (replicas) keeps it rolled back
    sim.set_spec(make_spec(batch=16, failureLimit=1, replicas=6))
    d = sim.tick(at(10001))
    assert d.status.phase is Phase.ROLLED_BACK and d.stable_replicas == 6 and d.canary_revision is None
    assert d.status.observed_generation == sim.generation
    # another revision canaries
    other = make_spec(batch=32, failureLimit=1, replicas=6)
    sim.set_spec(other)
    d = sim.tick(at(10002))
    assert d.canary_revision == other.revision() and d.status.phase is Phase.PROGRESSING
    # back to the bad one mid-canary: the canary is dropped, no canary of the bad revision
    sim.set_spec(make_spec(batch=16, failureLimit=1, replicas=6))
    d = sim.tick(at(10003))
    assert d.canary_revision is None and d.status.phase is Phase.ROLLED_BACK
    assert d.rollout_outcomes == ("Superseded",)


def test_retry_command_clears_the_failed_mark_once() -> None:
    sim = healthy(make_spec(failureLimit=1))
    bad = make_spec(batch=16, failureLimit=1)
    start_canary(sim, at(0), bad)
    sim.tick(at(30), p99=1.0)
    sim.commands = Commands(retry="alice@2026-11-30T02:00:00Z")
    d = sim.tick(at(40))
    assert "Retry" in reasons(d)
    assert d.canary_revision == bad.revision() and d.status.phase is Phase.PROGRESSING
    assert d.status.failed_revisions == []
    assert d.status.handled_commands["retry"] == "alice@2026-11-30T02:00:00Z"
    entry = [e for e in d.status.ledger if e.kind == "Command"][-1]
    assert entry.reason == "retry" and entry.evidence == "alice@2026-11-30T02:00:00Z"
    assert d.status.rollout is not None and d.status.rollout.failures == 0
    sim.tick(at(40))
    d = sim.tick(at(70), p99=1.0)  # fails again: rolled back, the same retry value does nothing
    assert d.status.phase is Phase.ROLLED_BACK
    d = sim.tick(at(80))
    assert d.status.phase is Phase.ROLLED_BACK and d.events == ()


def test_retry_of_a_revision_that_did_not_fail_is_ignored() -> None:
    sim = healthy(make_spec())
    sim.commands = Commands(retry="x@1")
    d = sim.tick(at(5))
    assert "CommandIgnored" in reasons(d) and d.status.phase is Phase.HEALTHY
    assert sim.tick(at(6)).events == ()


# --------------------------------------------------------------------------- metrics errors


def test_error_under_hold_stalls_and_resumes() -> None:
    sim = healthy(make_spec())
    start_canary(sim, at(0), make_spec(batch=16))
    sim.tick(at(30))  # lane passed
    d = sim.tick(at(60), error=True)
    assert d.analysis_outcomes == ("Error",)
    assert cond(d.status, "Stalled") == ("True", "MetricsUnavailable")
    assert "Stalled" in reasons(d)
    assert d.status.current_step_index == 0  # pause over and lane passed, but held
    assert d.status.rollout is not None and d.status.rollout.metrics_error_since == at(60)
    for t in range(90, 3600, 30):
        d = sim.tick(at(t), error=True)
        assert d.status.phase is Phase.PROGRESSING and d.canary_revision is not None
        assert "Stalled" not in reasons(d)
    assert d.status.rollout is not None
    assert d.status.rollout.failures == 0 and d.status.rollout.metrics_error_since == at(60)
    assert "holding" in d.status.message
    d = sim.tick(at(3600))
    assert "MetricsRestored" in reasons(d)
    assert cond(d.status, "Stalled")[0] == "False"
    assert d.status.current_step_index == 1
    assert d.status.rollout is not None and d.status.rollout.metrics_error_since is None


@pytest.mark.parametrize(
    ("last_error_at", "rolled_back"),
    [(60 + 570, False), (60 + 600, True)],
)
def test_error_under_rollback_waits_for_the_deadline(last_error_at: int, rolled_back: bool) -> None:
    mu = {"action": "Rollback", "deadline": "10m"}
    sim = healthy(make_spec(onMetricsUnavailable=mu))
    new = make_spec(batch=16, onMetricsUnavailable=mu)
    start_canary(sim, at(0), new)
    sim.tick(at(30))
    for t in range(60, last_error_at + 1, 30):
        d = sim.tick(at(t), error=True)
    if rolled_back:
        assert d.status.phase is Phase.ROLLED_BACK
        assert d.status.failed_revisions[-1].reason == "MetricsUnavailable"
        assert d.rollout_outcomes == ("RolledBack",)
    else:
        assert d.status.phase is Phase.PROGRESSING
        assert cond(d.status, "Stalled") == ("True", "MetricsUnavailable")
        assert "rolling back at 2026-11-30T01:11:00Z" in d.status.message
        assert d.requeue_after == 30  # next analysis before the deadline


def test_rollback_deadline_is_checked_without_an_analysis() -> None:
    mu = {"action": "Rollback", "deadline": "5m"}
    sim = healthy(make_spec(onMetricsUnavailable=mu))
    start_canary(sim, at(0), make_spec(batch=16, onMetricsUnavailable=mu))
    sim.tick(at(30), error=True)
    d = sim.plan(at(329))
    assert d.status.phase is Phase.PROGRESSING
    d = sim.plan(at(330))
    assert d.status.phase is Phase.ROLLED_BACK


def test_metrics_returning_before_the_deadline_resets_the_streak() -> None:
    mu = {"action": "Rollback", "deadline": "2m"}
    sim = healthy(make_spec(onMetricsUnavailable=mu))
    start_canary(sim, at(0), make_spec(batch=16, onMetricsUnavailable=mu))
    sim.tick(at(30), error=True)
    sim.tick(at(60), error=True)
    sim.tick(at(90), samples=1)  # Inconclusive: metrics are back
    d = sim.tick(at(120), error=True)
    d = sim.tick(at(150), error=True)
    assert d.status.phase is Phase.PROGRESSING  # 30s into the new streak
    assert d.status.rollout is not None and d.status.rollout.metrics_error_since == at(120)


# --------------------------------------------------------------------------- spec changes mid-canary


def test_new_revision_mid_canary_supersedes() -> None:
    sim = healthy(make_spec())
    stable = sim.status.stable_revision
    r2, r3 = make_spec(batch=16), make_spec(batch=32)
    start_canary(sim, at(0), r2)
    sim.tick(at(30), p99=0.5)  # one failure on r2
    sim.tick(at(60))
    sim.tick(at(61))
    assert sim.status.current_step_index == 1
    sim.set_spec(r3)
    d = sim.tick(at(70), converge_after=False)
    assert d.rollout_outcomes == ("Superseded",)
    assert d.status.history[-1].revision == r2.revision() and d.status.history[-1].outcome == "Superseded"
    assert d.stable_revision == stable and d.canary_revision == r3.revision()
    r = d.status.rollout
    assert r is not None and (r.step_index, r.failures, r.passed_lanes, r.revision) == (
        0,
        0,
        [],
        r3.revision(),
    )
    assert d.status.failed_revisions == []
    # an analysis of the superseded revision that arrives late is ignored
    late = AnalysisResult(time=at(71), window="30s", canary_revision=r2.revision(), stable_revision=stable)
    d = sim.plan(at(200), late)
    assert d.analysis_outcomes == ()


def test_revert_to_stable_revision_drops_the_canary() -> None:
    sim = healthy(make_spec())
    start_canary(sim, at(0), make_spec(batch=16))
    sim.set_spec(make_spec())
    d = sim.tick(at(10))
    assert d.canary_revision is None and d.status.phase is Phase.HEALTHY
    assert d.rollout_outcomes == ("Superseded",)
    assert "reverted" in d.status.history[-1].reason


def test_non_revision_change_continues_the_rollout_with_new_settings() -> None:
    sim = healthy(make_spec())
    new = make_spec(batch=16)
    start_canary(sim, at(0), new)
    sim.tick(at(30))
    changed = make_spec(batch=16, replicas=10, steps=[{"weight": 25, "pause": "2m"}, {"weight": 50}])
    assert changed.revision() == new.revision()
    sim.set_spec(changed)
    d = sim.tick(at(60))
    assert d.rollout_outcomes == () and d.status.current_step_index == 0  # pause is now 2m
    assert (d.stable_replicas, d.canary_replicas, d.status.canary_weight) == (7, 3, 30)
    assert d.status.rollout is not None and d.status.rollout.passed_lanes == ["interactive"]
    # steps shortened under a canary at step 2: clamped to the new last step
    sim.tick(at(120))
    sim.tick(at(121))
    assert sim.status.current_step_index == 1
    sim.set_spec(make_spec(batch=16, replicas=10, steps=[{"weight": 40, "pause": "30s"}]))
    d = sim.tick(at(122))
    assert d.status.current_step_index == 0 and d.status.step_weight == 40 and d.status.step_count == 1


# --------------------------------------------------------------------------- manual commands


def test_pause_holds_the_step_clock_and_resume_continues() -> None:
    sim = healthy(make_spec())
    new = make_spec(batch=16)
    start_canary(sim, at(0), new)
    sim.tick(at(30))  # lane passed, 30s of the step left
    sim.commands = Commands(pause="carol@t")
    d = sim.tick(at(40))
    assert d.status.phase is Phase.PAUSED and "Paused" in reasons(d)
    assert cond(d.status, "Reconciling") == ("True", "Paused")
    assert d.requeue_after is None
    assert not analysis_due(new, d.status, at(500))
    d = sim.tick(at(500))
    assert d.status.phase is Phase.PAUSED and d.events == () and d.analysis_outcomes == ()
    sim.commands = Commands()
    d = sim.tick(at(1000))
    assert "Resumed" in reasons(d) and d.status.phase is Phase.PROGRESSING
    r = d.status.rollout
    assert r is not None and r.step_started_at == at(960)  # 960s held
    assert d.status.current_step_index == 0  # 40s into the step: 20s left
    assert "step pause ends at 2026-11-30T01:17:00Z" in d.status.message  # 960 + 60
    d = sim.tick(at(1020))
    assert d.status.current_step_index == 1
    assert [e.kind for e in d.status.ledger if e.kind in ("Paused", "Resumed")] == ["Paused", "Resumed"]
    resumed = next(e for e in d.status.ledger if e.kind == "Resumed")
    assert resumed.evidence == "pause annotation removed; step clock held 960s"  # no resume annotation


def test_resume_credits_who_resumed_but_not_a_stale_resume() -> None:
    sim = healthy(make_spec())
    start_canary(sim, at(0), make_spec(batch=16))
    sim.tick(at(30))
    sim.commands = Commands(pause="carol@2026-11-30T01:00:40Z")
    sim.tick(at(40))
    sim.commands = Commands(resume="dave@2026-11-30T01:01:30Z")
    d = sim.tick(at(100))
    resumed = [e for e in d.status.ledger if e.kind == "Resumed"]
    assert [e.evidence for e in resumed] == ["by dave@2026-11-30T01:01:30Z; step clock held 60s"]
    assert "resumed (by dave@2026-11-30T01:01:30Z)" in " ".join(e.message for e in d.events)
    # Paused again later, then the pause annotation removed by hand: dave's old resume is older
    # than this pause, so nobody is credited.
    sim.commands = Commands(pause="erin@2026-11-30T01:02:00Z", resume="dave@2026-11-30T01:01:30Z")
    sim.tick(at(120))
    sim.commands = Commands(resume="dave@2026-11-30T01:01:30Z")
    d = sim.tick(at(150))
    last_resume = [e for e in d.status.ledger if e.kind == "Resumed"][-1]
    assert last_resume.time == at(150) and last_resume.evidence.startswith("pause annotation removed;")


def test_pause_false_is_not_paused_and_pause_before_canary_holds_the_new_canary() -> None:
    assert not Commands(pause="false").paused and not Commands(pause="").paused
    assert Commands(pause="true").paused
    sim = healthy(make_spec())
    sim.commands = Commands(pause="true")
    d = sim.tick(at(5))
    assert d.status.phase is Phase.HEALTHY and d.status.paused
    sim.set_spec(make_spec(batch=16))
    sim.tick(at(10))
    d = sim.tick(at(20))
    assert d.status.phase is Phase.PAUSED
    assert d.status.rollout is not None and d.status.rollout.paused_at == at(20)
    d = sim.tick(at(200))
    assert d.status.current_step_index == 0 and d.analysis_outcomes == ()


def test_promote_command_promotes_now_once() -> None:
    sim = healthy(make_spec(), roundtrip=True)
    new = make_spec(batch=16)
    start_canary(sim, at(0), new)
    sim.commands = Commands(promote="dave@2026-11-30T01:00:05Z")
    d = sim.tick(at(5))
    assert d.rollout_outcomes == ("Promoted",)
    assert d.status.stable_revision == new.revision()
    assert d.status.history[-1].reason == "PromotedManually"
    assert "promoted by dave@2026-11-30T01:00:05Z" in d.status.history[-1].evidence
    for t in (6, 7, 100):
        d = sim.tick(at(t))
        assert d.rollout_outcomes == () and d.events == ()
    assert [h.outcome for h in d.status.history] == ["Promoted", "Promoted"]


def test_abort_command_rolls_back_and_marks_failed() -> None:
    sim = healthy(make_spec())
    new = make_spec(batch=16)
    start_canary(sim, at(0), new)
    sim.commands = Commands(abort="erin@t")
    d = sim.tick(at(5))
    assert d.rollout_outcomes == ("Aborted",)
    assert d.status.phase is Phase.ROLLED_BACK and d.canary_revision is None
    assert d.status.failed_revisions[-1].reason == "Aborted"
    assert d.status.history[-1].outcome == "Aborted"
    assert "aborted by erin@t" in d.status.message
    d = sim.tick(at(6))
    assert d.status.phase is Phase.ROLLED_BACK and d.events == ()


@pytest.mark.parametrize("command", ["promote", "abort"])
def test_promote_or_abort_without_canary_is_ignored_and_recorded(command: str) -> None:
    sim = healthy(make_spec())
    sim.commands = Commands(**{command: "frank@t"})
    d = sim.tick(at(5))
    assert reasons(d) == ["CommandIgnored"] and d.status.phase is Phase.HEALTHY
    assert d.status.ledger[-1].kind == "Command" and d.status.ledger[-1].evidence == "frank@t"
    # a leftover annotation does not act on a later canary
    sim.set_spec(make_spec(batch=16))
    d = sim.tick(at(6))
    assert d.status.phase is Phase.PROGRESSING and d.rollout_outcomes == ()


def test_commands_from_annotations() -> None:
    c = Commands.from_annotations({"batchpilot.dev/pause": "true", "batchpilot.dev/promote": "a@1", "other": "x"})
    assert c == Commands(pause="true", promote="a@1")
    assert Commands.from_annotations(None) == Commands()


# --------------------------------------------------------------------------- restart safety


def _scenario(sim: Sim) -> list[Decision]:
    """A rollout with a failure, an Inconclusive, an outage, a pause, and a promotion."""
    sim.tick(at(0))
    sim.tick(at(1))
    sim.set_spec(make_spec(batch=16))
    sim.tick(at(2))
    sim.tick(at(3))
    sim.tick(at(33), p99=0.3)
    sim.tick(at(63), samples=2)
    sim.tick(at(93), error=True)
    sim.tick(at(100))
    sim.commands = Commands(pause="true")
    sim.tick(at(110))
    sim.commands = Commands()
    sim.tick(at(150))
    for t in range(153, 400, 10):
        sim.tick(at(t))
    return sim.decisions


def test_restart_mid_step_resumes_exactly() -> None:
    plain = _scenario(Sim(make_spec()))
    restarted = _scenario(Sim(make_spec(), roundtrip=True))
    assert [d.status.to_dict() for d in plain] == [d.status.to_dict() for d in restarted]
    assert [(d.events, d.rollout_outcomes, d.analysis_outcomes) for d in plain] == [
        (d.events, d.rollout_outcomes, d.analysis_outcomes) for d in restarted
    ]
    promotions = [o for d in plain for o in d.rollout_outcomes]
    assert promotions == ["Promoted"]
    assert plain[-1].status.phase is Phase.HEALTHY


def test_replaying_the_same_inputs_is_idempotent_no_double_promotion() -> None:
    sim = healthy(make_spec())
    new = make_spec(batch=16)
    start_canary(sim, at(0), new)
    sim.tick(at(30))
    sim.tick(at(60))
    sim.tick(at(61))
    sim.tick(at(91))
    result = measured(new, sim.status, at(121))
    inputs = PlanInputs(
        spec=new,
        generation=sim.generation,
        status=sim.status,
        observed=sim.observed,
        now=at(121),
        analysis=result,
    )
    first = plan(inputs)
    assert first.rollout_outcomes == ("Promoted",)
    # the operator crashed after writing status but before the next reconcile: replay with the new
    # status and the same (now stale) analysis
    again = plan(
        PlanInputs(
            spec=new,
            generation=sim.generation,
            status=Status.from_dict(first.status.to_dict()),
            observed=converge(first),
            now=at(121),
            analysis=result,
        )
    )
    assert again.rollout_outcomes == () and "Promoted" not in reasons(again)
    # the crash happened before status was written: the same inputs give the same decision
    assert plan(inputs) == first


def _merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch, as the apiserver applies it."""
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for k, v in patch.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = _merge_patch(out.get(k), v)
    return out


def test_status_patch_clears_stale_fields_when_merged() -> None:
    sim = healthy(make_spec())
    start_canary(sim, at(0), make_spec(batch=16))
    stored: dict[str, Any] = {"kopf": {"progress": {}}}
    for t, kw in [(30, {"error": True}), (60, {}), (61, {}), (91, {}), (121, {}), (122, {})]:
        d = sim.tick(at(t), **kw)
        stored = _merge_patch(stored, d.status.to_patch())
        assert {k: v for k, v in stored.items() if k != "kopf"} == d.status.to_dict()
    assert "rollout" not in stored and "canaryRevision" not in stored and stored["kopf"] == {"progress": {}}
    assert Status.from_dict(copy.deepcopy(stored)) == sim.status


# --------------------------------------------------------------------------- misc


def test_ledger_keeps_every_decision_before_analyses() -> None:
    """Many more analyses than the ledger holds (a long rollout, a slow machine): the analyses
    are bounded, and every decision of every revision is still there, in order."""
    sim = healthy(make_spec(maxInconclusive=1000))
    decisions: list[str] = []  # every decision the planner made, as it made it

    def tick(d: Decision) -> Decision:
        for e in d.status.ledger:
            line = e.model_dump_json()
            if e.kind != "Analysis" and line not in decisions:
                decisions.append(line)
        return d

    decisions += [e.model_dump_json() for e in sim.status.ledger if e.kind != "Analysis"]
    good, bad = make_spec(batch=16, maxInconclusive=1000), make_spec(batch=32, maxInconclusive=1000)
    tick(start_canary(sim, at(10), good))
    t, analyses = 10, 0
    for _ in range(40):  # Inconclusive analyses hold the first step
        t += 30
        d = tick(sim.tick(at(t), samples=1))
        analyses += sum(e.kind == "Analysis" for e in d.status.ledger if e.time == at(t))
    while sim.status.stable_revision != good.revision():  # now good samples: steps, promotion
        t += 30
        tick(sim.tick(at(t)))
    tick(start_canary(sim, at(t + 10), bad))
    t += 10
    for _ in range(40):
        t += 30
        tick(sim.tick(at(t), samples=1))
    while sim.status.phase is not Phase.ROLLED_BACK:
        t += 30
        tick(sim.tick(at(t), p99=1.0))
    ledger = sim.status.ledger
    assert analyses > 2 * ANALYSIS_LIMIT
    assert sum(e.kind == "Analysis" for e in ledger) == ANALYSIS_LIMIT
    assert ledger[-1].kind == "RolledBack"
    kept = [e.model_dump_json() for e in ledger if e.kind != "Analysis"]
    assert kept == decisions
    kinds = [(LedgerEntry.model_validate_json(e).kind, LedgerEntry.model_validate_json(e).revision) for e in kept]
    assert kinds[0] == ("Initial", make_spec(maxInconclusive=1000).revision())
    for kind in ("CanaryStarted", "StepAdvanced", "Promoted"):
        assert (kind, good.revision()) in kinds
    assert kinds.index(("CanaryStarted", good.revision())) < kinds.index(("Promoted", good.revision()))
    assert ("CanaryStarted", bad.revision()) in kinds and kinds[-1] == ("RolledBack", bad.revision())


def test_decisions_are_bounded_newest_kept() -> None:
    entries = [LedgerEntry(time=at(i), kind="Paused" if i % 2 else "Analysis", revision="r") for i in range(400)]
    kept = trim_ledger(entries)
    assert [e.kind for e in kept].count("Paused") == DECISION_LIMIT
    assert [e.kind for e in kept].count("Analysis") == ANALYSIS_LIMIT
    assert kept == sorted(kept, key=lambda e: e.time) and kept[-1] == entries[-1]
    assert min(e.time for e in kept if e.kind == "Paused") == at(399 - 2 * (DECISION_LIMIT - 1))


def test_history_limit_prunes_revision_configmaps() -> None:
    sim = healthy(make_spec(historyLimit=2, steps=[{"weight": 50, "pause": "0s"}]))
    revisions = [sim.status.stable_revision]
    t = 10
    for batch in (16, 32, 48, 64):
        spec = make_spec(batch=batch, historyLimit=2, steps=[{"weight": 50, "pause": "0s"}])
        start_canary(sim, at(t), spec)
        d = sim.tick(at(t + 30))
        assert d.rollout_outcomes == ("Promoted",)
        revisions.append(spec.revision())
        t += 100
    d = sim.tick(at(t))
    assert d.keep_revisions == (revisions[-1], revisions[-2], revisions[-3])


def test_degraded_when_stable_has_no_ready_pod() -> None:
    sim = healthy(make_spec())
    sim.observed = Observed(stable=TrackObserved(sim.status.stable_revision, 4, 0))
    d = sim.plan(at(10), converge_after=False)
    assert d.status.phase is Phase.DEGRADED and d.requeue_after == POLL_SECONDS
    assert cond(d.status, "Ready") == ("False", "Degraded")
    sim.observed = Observed(stable=TrackObserved(sim.status.stable_revision, 4, 2))
    d = sim.plan(at(11), converge_after=False)
    assert d.status.phase is Phase.HEALTHY
    assert cond(d.status, "Ready") == ("False", "StableScaling")
    assert cond(d.status, "Reconciling")[0] == "True"
    d = sim.plan(at(12))
    d = sim.plan(at(13))
    ready = d.status.condition("Ready")
    assert ready is not None and ready.status == "True" and ready.last_transition_time == at(13)
    ready = sim.plan(at(14)).status.condition("Ready")
    assert ready is not None and ready.last_transition_time == at(13)


def test_canary_not_ready_is_rolled_back_at_the_progress_deadline() -> None:
    sim = healthy(make_spec())
    stable = sim.status.stable_revision
    new = make_spec(batch=16)
    sim.set_spec(new)
    sim.tick(at(0), converge_after=False)  # canary asked for; its pods never become ready
    sim.observed = Observed(stable=TrackObserved(stable, 3, 3), canary=TrackObserved(new.revision(), 1, 0))
    assert CANARY_READY_DEADLINE == new.rollout.progress_deadline == 600.0  # the default
    trouble = {"canary": "pod chat-canary-x: Unschedulable: 0/2 nodes are available: 2 Insufficient nvidia.com/gpu"}
    d = sim.plan(at(599), converge_after=False)
    assert d.status.rollout is not None and cond(d.status, "Stalled")[0] == "False"
    assert d.canary_revision == new.revision() and d.requeue_after == POLL_SECONDS
    d = plan(
        PlanInputs(
            spec=new,
            generation=sim.generation,
            status=sim.status,
            observed=sim.observed,
            now=at(600),
            pod_trouble=trouble,
        )
    )
    assert d.status.rollout is None and d.status.phase is Phase.ROLLED_BACK
    assert (d.canary_revision, d.canary_replicas) == (None, 0), "the canary's GPUs are given back"
    assert (d.stable_revision, d.stable_replicas) == (stable, 4), "stable untouched, back to full size"
    assert d.rollout_outcomes == ("RolledBack",) and d.rollback_reasons == ("CanaryNotReady",)
    (event,) = [e for e in d.events if e.reason == "RolledBack"]
    assert "CanaryNotReady" in event.message and "Insufficient nvidia.com/gpu" in event.message
    entry = d.status.ledger[-1]
    assert (entry.kind, entry.reason) == ("RolledBack", "CanaryNotReady")
    assert entry.evidence is not None and "0/1 canary pods ready 600s (progressDeadline)" in entry.evidence
    assert "Unschedulable: 0/2 nodes" in entry.evidence
    assert d.status.is_failed(new.revision()), "not canaried again until the spec changes or a retry"


def test_progress_deadline_is_per_step_and_configurable() -> None:
    spec = make_spec(progressDeadline="2m")
    assert spec.rollout.progress_deadline == 120.0
    sim = healthy(spec)
    new = make_spec(batch=16, progressDeadline="2m")
    start_canary(sim, at(0), new)
    # step 1 passes; step 2's extra canary pods never become ready
    sim.tick(at(30))
    d = sim.tick(at(60))
    assert d.status.rollout is not None and d.status.rollout.step_index == 1
    entered = 60
    sim.observed = Observed(stable=sim.observed.stable, canary=TrackObserved(new.revision(), 2, 1))
    d = sim.plan(at(entered + 119), converge_after=False)
    assert d.status.rollout is not None
    d = sim.plan(at(entered + 120), converge_after=False)
    assert d.status.rollout is None and d.rollback_reasons == ("CanaryNotReady",)
    assert "1/2 canary pods ready 120s (progressDeadline) after step 2" in (d.status.ledger[-1].evidence or "")
    assert "no pod reported a reason" in (d.status.ledger[-1].evidence or "")


def test_canary_pods_lost_mid_step_wait_again_under_the_deadline() -> None:
    sim = healthy(make_spec(replicas=4))
    new = make_spec(batch=16, replicas=4)
    start_canary(sim, at(0), new)
    r = sim.status.rollout
    assert r is not None and r.step_started_at == at(0)
    stable = sim.observed.stable
    # the canary's node goes away: its one pod is no longer ready (the Deployment still wants it)
    sim.observed = Observed(stable=stable, canary=TrackObserved(new.revision(), 1, 0))
    d = sim.plan(at(20), converge_after=False)
    assert d.status.rollout is not None and d.status.rollout.step_started_at is None
    assert d.status.rollout.step_entered_at == at(20) and "CanaryPodsLost" in reasons(d)
    assert not analysis_due(new, d.status, at(100)), "no analysis of a canary without its pods"
    d = sim.plan(at(20 + 599), converge_after=False)
    assert d.status.rollout is not None and "CanaryPodsLost" not in reasons(d)
    d = sim.plan(at(20 + 600), converge_after=False, result=None)
    assert d.rollback_reasons == ("CanaryNotReady",)
    # a resize the spec asked for is not a loss: the step goes on
    sim2 = healthy(make_spec(replicas=4))
    start_canary(sim2, at(0), new)
    sim2.set_spec(make_spec(batch=16, replicas=10))
    d = sim2.plan(at(5), converge_after=False)
    assert d.status.rollout is not None and d.status.rollout.step_started_at == at(0)


def test_progress_deadline_waits_while_paused() -> None:
    sim = healthy(make_spec())
    new = make_spec(batch=16)
    sim.set_spec(new)
    sim.tick(at(0), converge_after=False)
    sim.observed = Observed(stable=sim.observed.stable, canary=TrackObserved(new.revision(), 1, 0))
    sim.commands = Commands(pause="alice@2026-11-30T01:00:10Z")
    d = sim.plan(at(1000), converge_after=False)
    assert d.status.rollout is not None and d.status.phase is Phase.PAUSED


def test_canary_ready_in_time_is_not_rolled_back() -> None:
    sim = healthy(make_spec())
    new = make_spec(batch=16)
    sim.set_spec(new)
    sim.tick(at(0), converge_after=False)
    sim.observed = Observed(stable=sim.observed.stable, canary=TrackObserved(new.revision(), 1, 1))
    d = sim.plan(at(599), converge_after=False)
    assert d.status.rollout is not None and d.status.rollout.step_started_at == at(599)
    d = sim.plan(at(700), converge_after=False)  # the step clock runs: no deadline any more
    assert d.status.rollout is not None and d.rollback_reasons == ()


@pytest.mark.parametrize("text", ["0s", "-1m", "soon"])
def test_progress_deadline_must_be_a_positive_duration(text: str) -> None:
    with pytest.raises(ValueError):
        make_spec(progressDeadline=text)


def test_pods_needed_only_in_trouble() -> None:
    from batchpilot_operator.rollout import canary_deadline_passed

    sim = healthy(make_spec())
    stable = sim.status.stable_revision
    assert pods_needed(sim.spec, sim.status, sim.observed, at(2)) == ()
    short = Observed(stable=TrackObserved(stable, 4, 3))
    assert pods_needed(sim.spec, sim.status, short, at(2)) == ("stable",)
    new = make_spec(batch=16)
    sim.set_spec(new)
    sim.tick(at(10), converge_after=False)
    assert not canary_deadline_passed(new, sim.status, at(609))
    assert canary_deadline_passed(new, sim.status, at(610))
    assert pods_needed(new, sim.status, Observed(stable=TrackObserved(stable, 3, 3)), at(610)) == ("canary",)


def test_degraded_condition_when_stable_loses_pods() -> None:
    sim = healthy(make_spec())
    stable = sim.status.stable_revision
    sim.observed = Observed(stable=TrackObserved(stable, 4, 2))
    why = "pod chat-stable-a: node gpu-node-1 is not Ready; pod chat-stable-b: node gpu-node-1 is not Ready"
    d = plan(
        PlanInputs(
            spec=sim.spec,
            generation=sim.generation,
            status=sim.status,
            observed=sim.observed,
            now=at(5),
            pod_trouble={"stable": why},
        )
    )
    assert cond(d.status, "Degraded") == ("True", "StableUnderCapacity")
    degraded = d.status.condition("Degraded")
    assert degraded is not None and "2/4 ready pods" in degraded.message and "gpu-node-1" in degraded.message
    assert reasons(d) == ["Degraded"]
    again = sim.plan(at(6), converge_after=False)
    assert cond(again.status, "Degraded") == ("True", "StableUnderCapacity") and "Degraded" not in reasons(again)
    sim.observed = Observed(stable=TrackObserved(stable, 4, 4))
    back = sim.plan(at(7), converge_after=False)
    assert cond(back.status, "Degraded") == ("False", "StableAtCapacity")
    # a scale-up the operator itself asked for (Deployment not yet at its new size) is no loss
    fresh = healthy(make_spec())
    fresh.observed = Observed(stable=TrackObserved(fresh.status.stable_revision, 2, 2))
    d = fresh.plan(at(8), converge_after=False)
    assert d.status.condition("Degraded") is None


def test_analysis_not_due_is_ignored() -> None:
    sim = healthy(make_spec())
    new = make_spec(batch=16)
    start_canary(sim, at(0), new)
    early = measured(new, sim.status, at(10), p99=9.0)
    d = sim.plan(at(10), early)
    assert d.analysis_outcomes == () and d.status.rollout is not None and d.status.rollout.failures == 0


def test_requeue_after_points_at_the_next_deadline() -> None:
    sim = healthy(make_spec(analysisInterval="20s", steps=[{"weight": 25, "pause": "50s"}, {"weight": 50}]))
    start_canary(
        sim,
        at(0),
        make_spec(batch=16, analysisInterval="20s", steps=[{"weight": 25, "pause": "50s"}, {"weight": 50}]),
    )
    assert sim.decisions[-1].requeue_after == 20
    assert sim.tick(at(20)).requeue_after == 20
    assert sim.tick(at(40)).requeue_after == 10  # pause ends at 50
    assert sim.tick(at(50)).requeue_after == POLL_SECONDS  # advanced: waiting for pods


def test_status_round_trip_and_camel_case() -> None:
    sim = healthy(make_spec())
    start_canary(sim, at(0), make_spec(batch=16))
    d = sim.tick(at(30))
    data = d.status.to_dict()
    for key in ("observedGeneration", "stableRevision", "canaryRevision", "currentStepIndex", "canaryWeight"):
        assert key in data
    assert data["rollout"]["stepStartedAt"] == "2026-11-30T01:00:00Z"
    assert data["lastAnalysis"]["lanes"][0]["p99LatencySlo"] == 0.2
    queue_age = next(e for e in reversed(data["ledger"]) if e.get("metric") == "queueAge")
    assert queue_age["stableValue"] == 0.005
    assert data["lastAnalysis"]["lanes"][0]["maxErrorRate"] == 0.01
    assert Status.from_dict(data) == d.status
    assert Status.from_dict(None) == Status()


def test_naive_now_is_rejected() -> None:
    with pytest.raises(ValueError):
        plan(PlanInputs(spec=make_spec(), generation=1, status=Status(), observed=Observed(), now=datetime(2026, 1, 1)))


def test_rolled_back_then_spec_reverted_to_stable_is_healthy() -> None:
    sim = healthy(make_spec(failureLimit=1))
    start_canary(sim, at(0), make_spec(batch=16, failureLimit=1))
    assert sim.tick(at(30), p99=1.0).status.phase is Phase.ROLLED_BACK
    sim.set_spec(make_spec(failureLimit=1))
    d = sim.tick(at(40))
    assert d.status.phase is Phase.HEALTHY and cond(d.status, "Stalled")[0] == "False"
    assert cond(d.status, "Ready") == ("True", "Healthy")


@pytest.mark.parametrize("seed", range(40))
def test_random_walks_keep_the_invariants(seed: int) -> None:
    """Seeded random sequences of spec changes, analyses, commands, outages and restarts."""
    import json
    import random

    rng = random.Random(seed)
    specs = [make_spec(batch=b, replicas=rng.choice([1, 2, 5]), failureLimit=2) for b in (8, 16, 32)]
    sim = Sim(specs[0])
    t = 0.0
    started: set[str] = set()
    promotions: list[str] = []
    for _ in range(60):
        t += rng.choice([1, 5, 30, 30, 61, 700])
        roll = rng.random()
        if roll < 0.12:
            sim.set_spec(rng.choice(specs))
        elif roll < 0.18:
            name = rng.choice(["promote", "abort", "retry", "pause", "resume"])
            value = f"user@{t}"
            if name == "pause":
                sim.commands = Commands(pause="true")
            elif name == "resume":
                sim.commands = Commands()
            else:
                sim.commands = Commands(pause=sim.commands.pause, **{name: value})
        kind = rng.choice(["ok", "ok", "bad", "thin", "error"])
        kw: dict[str, Any] = {
            "ok": {},
            "bad": {"p99": 0.9},
            "thin": {"samples": 1},
            "error": {"error": True},
        }[kind]
        before = sim.status
        result = measured(sim.spec, before, at(t), **kw) if analysis_due(sim.spec, before, at(t)) else None
        inputs = PlanInputs(
            spec=sim.spec,
            generation=sim.generation,
            status=before,
            observed=sim.observed,
            now=at(t),
            analysis=result,
            commands=sim.commands,
        )
        d = plan(inputs)
        # restart safety: the same decision from a status that went through the API
        restarted = plan(
            PlanInputs(
                spec=inputs.spec,
                generation=inputs.generation,
                status=Status.from_dict(json.loads(json.dumps(before.to_dict(), allow_nan=False))),
                observed=inputs.observed,
                now=inputs.now,
                analysis=inputs.analysis,
                commands=inputs.commands,
            )
        )
        assert restarted.status.to_dict() == d.status.to_dict()
        assert (restarted.events, restarted.rollout_outcomes) == (d.events, d.rollout_outcomes)
        st = d.status
        json.dumps(st.to_patch(), allow_nan=False)
        if st.rollout is not None:
            started.add(st.rollout.revision)
            assert not st.is_failed(st.rollout.revision)
            assert st.rollout.revision != st.stable_revision
            assert d.canary_revision == st.rollout.revision and d.canary_replicas >= 1
            assert d.stable_replicas >= 1 and d.stable_replicas + d.canary_replicas >= sim.spec.replicas
        if st.phase is Phase.ROLLED_BACK:
            assert st.is_failed(sim.spec.revision()) and d.canary_revision is None
        if st.stable_revision is not None:
            assert d.stable_revision == st.stable_revision
        assert sum(e.kind == "Analysis" for e in st.ledger) <= ANALYSIS_LIMIT
        assert sum(e.kind != "Analysis" for e in st.ledger) <= DECISION_LIMIT
        promotions += [st.stable_revision or "" for o in d.rollout_outcomes if o == "Promoted"]
        assert all(p in started for p in promotions)
        sim.decisions.append(d)
        sim.status = d.status
        sim.observed = converge(d) if rng.random() < 0.9 else sim.observed
        # a re-plan with nothing due settles (the handler re-runs on its own status writes)
        settle, observed = d.status, sim.observed
        for offset in (0.5, 0.6):
            again = plan(
                PlanInputs(
                    spec=sim.spec,
                    generation=sim.generation,
                    status=settle,
                    observed=observed,
                    now=at(t + offset),
                    commands=sim.commands,
                )
            )
            if offset == 0.6:
                assert again.status.to_dict() == settle.to_dict() and again.events == ()
            settle = again.status
    # every promotion was of a distinct canary run: never two in a row for the same run
    assert len(promotions) <= sum(1 for d in sim.decisions for e in d.events if e.reason == "CanaryStarted")


class FixedPointSim(Sim):
    """After every step, checks that re-planning with nothing due changes nothing."""

    checked = 0

    def plan(self, now: datetime, result: AnalysisResult | None = None, *, converge_after: bool = True) -> Decision:
        d = super().plan(now, result, converge_after=converge_after)
        status, observed = self.status, self.observed
        for offset in (0.5, 0.6):
            again = plan(
                PlanInputs(
                    spec=self.spec,
                    generation=self.generation,
                    status=status,
                    observed=observed,
                    now=now + timedelta(seconds=offset),
                    commands=self.commands,
                )
            )
            if offset == 0.6:
                assert again.status.to_dict() == status.to_dict()
                assert again.events == () and again.rollout_outcomes == ()
            status, observed = again.status, converge(again)
        FixedPointSim.checked += 1
        return d


def test_status_is_a_fixed_point_when_nothing_is_due() -> None:
    """The handler re-runs on its own status writes (kopf.on.event): a re-plan must settle."""
    FixedPointSim.checked = 0
    decisions = _scenario(FixedPointSim(make_spec()))
    assert FixedPointSim.checked == len(decisions) > 30


def test_the_models_check_of_each_revision_is_recorded_beside_the_verdict() -> None:
    sim = healthy(make_spec(), roundtrip=True)
    start_canary(sim, at(0), make_spec(batch=16))
    assert sim.status.rollout is not None
    canary, stable = analysis_target(sim.status) or ("", "")
    plain = measured(sim.spec, sim.status, at(30))
    checked = dataclasses.replace(
        plain,
        model=(
            RevisionCheck(canary, "canary", "interactive", check=Check(0, 400, 0.090, 0.100, 0.020, 0.025, 1.0)),
            RevisionCheck(stable, "stable", "interactive", skipped="120 answered requests in the window"),
        ),
    )
    d = sim.plan(at(30), checked)
    assert d.status.last_analysis is not None
    (lane,) = d.status.last_analysis.lanes
    assert lane.outcome == plain.outcome.value  # evidence beside the verdict, never part of it
    assert lane.predicted_p99_latency == pytest.approx(0.090) and lane.stable_predicted_p99_latency is None
    assert lane.model is not None and "canary p99 90 ms predicted, 100 ms observed (-10%" in lane.model
    assert "stable not checked (120 answered requests" in lane.model
    entries = {e.metric: e for e in d.status.ledger if e.kind == "Analysis" and e.revision == canary}
    p99, qa = entries["p99Latency"], entries["queueAge"]
    assert (p99.predicted_value, p99.model_error) == (pytest.approx(0.090), pytest.approx(-0.1))
    assert (qa.predicted_value, qa.model_error) == (pytest.approx(0.020), pytest.approx(-0.2))
    assert p99.stable_predicted_value is None and entries["errorRate"].predicted_value is None
    dumped = Status.from_dict(d.status.to_dict())  # survives the status round trip
    assert dumped.last_analysis is not None and dumped.last_analysis.lanes[0].model == lane.model
    # and `kubectl batchpilot status` prints it under the analysis table
    from rich.console import Console

    from batchpilot_operator.oncall import render

    obj = {"metadata": {"name": POLICY, "namespace": NS, "generation": 1}, "spec": {}, "status": d.status.to_dict()}
    console = Console(width=200, record=True)
    console.print(render.status_view(render.summary(obj)))
    assert f"lane interactive: {lane.model}" in console.export_text()
