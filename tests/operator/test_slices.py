"""Tenant slices and client-breaking changes in the canary verdict (issue 12). Pure: a dict
stands in for Prometheus, the real verdict code judges (run_analysis -> verdicts -> judge).

Each row of a table is (value, requests, bad events) of one (track, lane or lane[tenant],
objective) over the 30 s window; cumulative counters grow at that rate, so the sub-window
tests see the same shares in every sub-window.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime

import pytest

from batchpilot_operator.analysis import (
    NO_STABLE_4XX,
    AnalysisResult,
    LaneVerdict,
    Measurement,
    Outcome,
    plan_queries,
    run_analysis,
    slice_confidence,
)
from batchpilot_operator.spec import PolicySpec, TenantsSpec
from batchpilot_operator.status import Status
from bp_plan import Sim
from bptest import conclusive, make_spec

NOW = datetime(2026, 11, 30, 2, 0, tzinfo=UTC)
Row = tuple[float | None, float | None, float | None]
Table = dict[tuple[str, str, str], Row]


class SliceBackend:
    def __init__(self, table: Mapping[tuple[str, str, str], Row], error_on: str | None = None) -> None:
        self.table = table
        self.error_on = error_on
        self.queries = 0

    def row(self, track: str, key: str, metric: str) -> Row:
        if metric == "clientErrors" and (track, key, metric) not in self.table:
            served = self.table.get((track, key, "errorRate"), (None, None, None))[1]
            return (0.0, served, 0.0) if served is not None else (None, None, None)
        return self.table.get((track, key, metric), (None, None, None))

    def measure(self, queries: Sequence[str], at: float | None = None) -> Mapping[str, Measurement]:
        out: dict[str, Measurement] = {}
        for query in queries:
            self.queries += 1
            if self.error_on is not None and self.error_on in query:
                out[query] = Measurement(query, error="prometheus error: boom")
                continue
            track = "stable" if 'track="stable"' in query else "canary"
            lane = re.search(r'lane="([^"]*)"', query)
            tenant = re.search(r'tenant="([^"]*)"', query)
            assert lane is not None
            key = lane.group(1) + (f"[{tenant.group(1)}]" if tenant else "")
            if "queue_age" in query:
                metric = "queueAge"
            elif "latency" in query:
                metric = "p99Latency"
            elif "outcome!=" in query or "outcome=~" in query:
                metric = "errorRate"
            else:
                metric = "clientErrors"
            value, samples, bad = self.row(track, key, metric)
            if "increase(" not in query and "rate(" not in query and samples is not None:
                scale = ((at or NOW.timestamp()) - NOW.timestamp() + 1000) / 30
                samples, bad = samples * scale, (bad or 0.0) * scale
            if query.startswith("sum by (le)"):
                n, k = samples or 0.0, bad or 0.0
                out[query] = Measurement(query, buckets=((1e-6, n - k), (math.inf, n)) if samples else ())
            elif query.startswith("sum by (code)"):
                out[query] = Measurement(query, groups=(("400", bad),) if bad else None)
            elif ("outcome=~" in query or 'outcome="invalid"' in query) and query.startswith("sum("):
                out[query] = Measurement(query, value=bad)
            elif query.startswith("sum("):
                out[query] = Measurement(query, value=samples)
            else:
                out[query] = Measurement(query, value=value)
        return out


def tenant_spec(names: list[str] | None = None) -> PolicySpec:
    spec = make_spec(minSamples=50)
    return spec.model_copy(update={"tenants": TenantsSpec(names=names or ["a", "b"])})


def healthy(key: str, n: float, p99: float = 0.1, bad: float = 0.0) -> Table:
    """One lane key's rows on both tracks: ``n`` requests, ``bad`` of them over the p99 SLO."""
    rows: Table = {}
    for track in ("canary", "stable"):
        rows[(track, key, "p99Latency")] = (p99, n, bad)
        rows[(track, key, "queueAge")] = (0.004, n, 0.0)
        rows[(track, key, "errorRate")] = (0.0, n, 0.0)
    return rows


def base() -> Table:
    """Interactive lane: 1000 requests a window per track, tenant a 900, tenant b 100, no
    default or other traffic."""
    return healthy("interactive", 1000) | healthy("interactive[a]", 900) | healthy("interactive[b]", 100)


def analyse(table: Table, spec: PolicySpec | None = None) -> AnalysisResult:
    """One window judged by its own rule (the rollout's sequential evidence already conclusive:
    the planner tests below accumulate it for real)."""
    spec = spec or tenant_spec()
    return run_analysis(
        SliceBackend(table),
        spec,
        policy="chat",
        namespace="ml",
        canary_revision="c1",
        stable_revision="s0",
        now=NOW,
        history=conclusive(spec),
    )


def lane_of(result: AnalysisResult) -> LaneVerdict:
    (lane,) = result.lanes
    return lane


def slice_of(lane: LaneVerdict, tenant: str) -> LaneVerdict:
    return next(s for s in lane.slices if s.tenant == tenant)


# ---- the rules, one row each: (case, table edits, lane outcome, passes step, holds step, slice b's outcome)
def b_latency(canary_bad: float, stable_bad: float = 0.0, n: float = 100) -> Table:
    return {
        ("canary", "interactive[b]", "p99Latency"): (0.4, n, canary_bad),
        ("stable", "interactive[b]", "p99Latency"): (0.1, n, stable_bad),
    } | {
        (t, "interactive[b]", m): (0.0 if m == "errorRate" else 0.004, n, 0.0)
        for t in ("canary", "stable")
        for m in ("queueAge", "errorRate")
    }


RULES: list[tuple[str, Table, Outcome, bool, bool, Outcome]] = [
    ("every slice within its SLO", {}, Outcome.SUCCESSFUL, True, False, Outcome.SUCCESSFUL),
    # 9 of tenant b's 100 requests over the SLO on the canary, none on the stable: the total
    # (9 of 1000, under the 1% budget) passes, the slice fails the lane.
    ("a slice breached only by the canary", b_latency(9.0), Outcome.FAILED, False, True, Outcome.FAILED),
    # the same share, but tenant b sent 30 requests (< minSamples 50): thin, counts for nothing
    ("a thin slice", b_latency(3.0, n=30), Outcome.SUCCESSFUL, True, False, Outcome.INCONCLUSIVE),
    # both tracks breach tenant b alike (a burst, or what b sends): not the canary's doing
    ("a breach both tracks share", b_latency(9.0, 8.0), Outcome.INCONCLUSIVE, True, False, Outcome.INCONCLUSIVE),
    # a small excess over the budget, not clearly worse than a clean stable: held, not failed
    ("a breach not yet pinned", b_latency(2.0), Outcome.INCONCLUSIVE, False, True, Outcome.INCONCLUSIVE),
]


@pytest.mark.parametrize(("case", "edits", "outcome", "passes", "holds", "b_outcome"), RULES, ids=[r[0] for r in RULES])
def test_slice_verdict_rules(
    case: str, edits: Table, outcome: Outcome, passes: bool, holds: bool, b_outcome: Outcome
) -> None:
    lane = lane_of(analyse(base() | edits))
    assert [s.tenant for s in lane.slices] == ["a", "b", "default", "other"]
    total = lane.check("p99Latency")
    assert total is not None and total.outcome is Outcome.SUCCESSFUL, "the lane's total passes in every row"
    b = slice_of(lane, "b")
    assert (lane.outcome, lane.passes_step, lane.holds_step, b.outcome) == (outcome, passes, holds, b_outcome), case
    # Tenants that sent nothing are thin: Inconclusive for themselves, nothing for the lane.
    assert slice_of(lane, "default").thin and slice_of(lane, "other").thin


def test_a_slice_failure_names_the_tenant_in_the_evidence() -> None:
    result = analyse(base() | b_latency(9.0))
    assert result.outcome is Outcome.FAILED
    evidence = result.evidence(only=[Outcome.FAILED])
    assert evidence.startswith(
        "lane interactive tenant b p99 latency: canary 0.4s > 0.2s vs stable 0.1s; "
        "9% of 100 requests slower than the SLO vs 0% of 100 on stable; worse than stable with"
    ), evidence
    # The old analysis (no tenants declared: the lane's total only) passes the same traffic.
    old = analyse(base() | b_latency(9.0), make_spec(minSamples=50))
    assert old.outcome is Outcome.SUCCESSFUL and not lane_of(old).slices


def test_judged_slices_share_the_lanes_error_rate() -> None:
    """5 of tenant b's 100 canary requests over the SLO, none of the stable's: worse than the
    stable with 97.0% confidence. Alone among judged slices b is held to the lane's 95% and
    fails; beside tenant a, also judged, each slice is held to 97.5% (the lane's 5% split in
    two) and b's breach is not yet pinned on the canary. A thin slice takes no share."""
    a_thin = healthy("interactive[a]", 30)
    alone = slice_of(lane_of(analyse(base() | a_thin | b_latency(5.0))), "b")
    assert alone.outcome is Outcome.FAILED
    shared = slice_of(lane_of(analyse(base() | b_latency(5.0))), "b")
    check = shared.check("p99Latency")
    assert check is not None and check.outcome is Outcome.INCONCLUSIVE
    assert check.note == "not clearly worse than the stable track (needs 97.5% confidence)"
    assert check.confidence_worse is not None and 0.95 < check.confidence_worse < 0.975
    # The lane's total is still held to the lane's own confidence.
    total = lane_of(analyse(base() | b_latency(5.0))).check("p99Latency")
    assert total is not None and total.outcome is Outcome.SUCCESSFUL


@pytest.mark.parametrize(("judged", "expected"), [(0, 0.95), (1, 0.95), (2, 0.975), (9, 1 - 0.05 / 9)])
def test_slice_confidence_splits_the_lanes_error_rate(judged: int, expected: float) -> None:
    assert slice_confidence(0.95, judged) == pytest.approx(expected)


def test_the_slice_is_judged_on_its_own_tally() -> None:
    first = analyse(base() | b_latency(9.0))
    assert "interactive[b]/p99Latency/canary" in first.tally
    assert len(first.tally["interactive[b]/p99Latency/canary"]) == 5


# ---- client-breaking changes: the canary's 4xx share against the stable's
def rejects(track: str, key: str, n: float, rejected: float) -> Table:
    """``n`` requests of which ``rejected`` answered 4xx (so ``n - rejected`` served)."""
    served = n - rejected
    return {
        (track, key, "clientErrors"): (rejected / n, n, rejected),
        (track, key, "p99Latency"): (0.1 if served else None, served, 0.0),
        (track, key, "queueAge"): (0.004 if served else None, served, 0.0),
        (track, key, "errorRate"): (0.0 if served else None, served, 0.0),
    }


def test_a_canary_that_rejects_one_tenant_fails_with_the_tenant_and_4xx_share() -> None:
    # Tenant b sends 12-row requests; the canary's maxBatchSize 8 rejects every one with a 400.
    # Its latency, queue age and error rate see no b requests at all (thin): only the 4xx share
    # can tell, in the slice and in the lane's total (100 of 1000 rejected vs none).
    table = (
        base()
        | rejects("canary", "interactive[b]", 100, 100)
        | rejects("canary", "interactive", 1000, 100)
        | {("canary", "interactive", "p99Latency"): (0.1, 900, 0.0)}
    )
    result = analyse(table)
    lane = lane_of(result)
    b = slice_of(lane, "b")
    assert result.outcome is Outcome.FAILED and b.outcome is Outcome.FAILED
    assert [c.metric for c in b.canary if c.thin] == ["p99Latency", "queueAge", "errorRate"]
    rejected = b.check("clientErrors")
    assert rejected is not None and rejected.outcome is Outcome.FAILED
    assert rejected.describe().startswith(
        "lane interactive tenant b: rejected 100% (400) of 100 requests vs stable 0% of 100; "
        "worse than stable with >99.99% confidence"
    ), rejected.describe()
    total = lane.check("clientErrors")
    assert total is not None and total.outcome is Outcome.FAILED
    assert "lane interactive: rejected 10% (400) of 1000 requests vs stable 0% of 1000" in total.describe()
    # The old analysis, which counted 4xx neither way, would have promoted it:
    old_metrics = [c for c in lane.canary if c.metric != "clientErrors"]
    assert all(c.outcome is Outcome.SUCCESSFUL for c in old_metrics)


@pytest.mark.parametrize(
    ("case", "canary_rejected", "stable_rejected", "outcome"),
    [
        ("no 4xx anywhere", 0, 0, Outcome.SUCCESSFUL),
        ("4xx both tracks return alike: the clients' fault", 10, 10, Outcome.INCONCLUSIVE),
        ("a little more than the stable, not clearly", 3, 1, Outcome.INCONCLUSIVE),
        ("clearly more than a stable that rejects some too", 60, 10, Outcome.FAILED),
        ("rejected by the canary only", 12, 0, Outcome.FAILED),
    ],
)
def test_4xx_share_against_the_stable(case: str, canary_rejected: int, stable_rejected: int, outcome: Outcome) -> None:
    table = base() | rejects("canary", "interactive[a]", 900, canary_rejected)
    table |= rejects("stable", "interactive[a]", 900, stable_rejected)
    a = slice_of(lane_of(analyse(table)), "a")
    check = a.check("clientErrors")
    assert check is not None and check.outcome is outcome, (case, check.describe())
    if outcome is Outcome.INCONCLUSIVE and stable_rejected * 2 >= canary_rejected:
        assert check.shared_breach and a.passes_step, "alike on both tracks: the step still passes"


def test_4xx_without_a_stable_to_compare_are_the_clients_own() -> None:
    table = base() | rejects("canary", "interactive[a]", 900, 50)
    table |= {k: (None, None, None) for k in table if k[0] == "stable"}  # no stable traffic
    a = slice_of(lane_of(analyse(table)), "a")
    check = a.check("clientErrors")
    assert check is not None and check.outcome is Outcome.SUCCESSFUL and check.note == NO_STABLE_4XX


def test_a_slice_query_error_holds_the_lane_like_a_total_one() -> None:
    spec = tenant_spec()
    result = run_analysis(
        SliceBackend(base(), error_on='tenant="a"'),
        spec,
        policy="chat",
        namespace="ml",
        canary_revision="c1",
        stable_revision="s0",
        now=NOW,
    )
    lane = lane_of(result)
    assert slice_of(lane, "a").outcome is Outcome.ERROR and lane.outcome is Outcome.ERROR
    assert not lane.passes_step


def test_slices_and_environment_in_the_queries() -> None:
    spec = tenant_spec(["a"])
    lqs = plan_queries(
        spec, policy="chat", namespace="ml", canary_revision="c1", stable_revision="s0", environment="prod"
    )
    # every lane: its total and each value of the tenant label, on both tracks
    assert [(lq.tenant, lq.track) for lq in lqs] == [
        (t, track) for t in (None, "a", "default", "other") for track in ("canary", "stable")
    ]
    p99 = lqs[2].metric("p99Latency").value
    assert 'lane="interactive",environment="prod",tenant="a"' in p99
    assert all('environment="prod"' in q for lq in lqs for q in lq.all())
    # no tenants declared: the lane's total only, as before
    assert [
        lq.tenant
        for lq in plan_queries(make_spec(), policy="chat", namespace="ml", canary_revision="c1", stable_revision=None)
    ] == [None]


def test_status_codes_of_rejected_requests_come_back_grouped() -> None:
    from batchpilot_operator.prom import measurement_from_result

    by_code = [{"metric": {"code": "404"}, "value": [1, "2"]}, {"metric": {"code": "400"}, "value": [1, "30"]}]
    m = measurement_from_result("q", by_code)
    assert m.groups == (("400", 30.0), ("404", 2.0)) and m.value is None and m.buckets is None
    # a plain scalar stays a scalar, buckets stay buckets
    assert measurement_from_result("q", [{"metric": {}, "value": [1, "5"]}]).value == 5.0
    assert measurement_from_result("q", [{"metric": {"le": "+Inf"}, "value": [1, "5"]}]).buckets is not None


# ---- through the real planner: what status, ledger and history say
def rollout(table: Table, until: float = 600.0) -> list[Status]:
    """The initial revision, then a change rolled out with every analysis judged on ``table``."""
    from datetime import timedelta

    from batchpilot_operator.rollout import analysis_due, analysis_target

    sim = Sim(tenant_spec())
    new = make_spec(batch=16, minSamples=50).model_copy(update={"tenants": TenantsSpec(names=["a", "b"])})
    seen: list[Status] = []
    t = 0.0
    while t <= until:
        if t >= 2 and sim.spec is not new:
            sim.set_spec(new)
        now = NOW + timedelta(seconds=t)
        result = None
        status = sim.status
        target = analysis_target(status)
        if target is not None and analysis_due(sim.spec, status, now):
            result = run_analysis(
                SliceBackend(table), sim.spec, policy="chat", namespace="ml", canary_revision=target[0],
                stable_revision=target[1], now=now, history=status.rollout.evidence if status.rollout else None,
            )  # fmt: skip
        status = sim.plan(now, result).status
        seen.append(status.model_copy(deep=True))
        if t >= 2 and status.rollout is None:
            break
        t += 1.0 if t < 2 else 5.0
    return seen


def test_a_slice_failure_rolls_back_and_status_ledger_history_name_the_tenant() -> None:
    final = rollout(base() | b_latency(9.0))[-1]
    assert final.phase is not None and final.phase.value == "RolledBack"
    failed = [e for e in final.ledger if e.kind == "Analysis" and e.outcome == "Failed"]
    assert failed and {(e.tenant, e.metric) for e in failed} == {("b", "p99Latency")}
    assert all(e.evidence and e.evidence.startswith("lane interactive tenant b p99 latency") for e in failed)
    # each failure carries the rollout's sequential evidence, past what a rollback needs
    assert all(e.evidence_value and e.evidence_needed and e.evidence_value >= e.evidence_needed for e in failed)
    (history,) = [h for h in final.history if h.outcome == "RolledBack"]
    assert "tenant b" in history.evidence
    assert final.last_analysis is not None
    (lane,) = final.last_analysis.lanes
    assert lane.outcome == "Failed" and lane.tenants is not None
    rows = {t.tenant: t for t in lane.tenants}
    assert rows["b"].outcome == "Failed" and rows["b"].evidence and "tenant b" in rows["b"].evidence
    assert rows["a"].outcome == "Successful" and rows["default"].thin and rows["other"].thin
    # the total passed every time: the slice alone rolled it back
    totals = [e for e in final.ledger if e.kind == "Analysis" and e.tenant is None]
    assert totals and all(e.outcome == "Successful" for e in totals)


def test_thin_slices_never_hold_a_rollout() -> None:
    # Tenant b breaches, but sends fewer than minSamples a window: thin, counted for nothing.
    seen = rollout(base() | b_latency(3.0, n=30))
    final = seen[-1]
    assert final.history[-1].outcome == "Promoted" and final.history[-1].reason == "AllStepsPassed"
    assert all(s.rollout is None or s.rollout.inconclusive_streak == 0 for s in seen)


def test_a_tenant_slice_with_a_quiet_stable_does_not_hold_the_lane_on_the_relative_objective() -> None:
    # With maxP99Increase, a lane's window whose stable is too quiet for a p99 neither passes nor
    # holds the step (analysis.STABLE_TOO_THIN); a tenant slice so quiet still counts for nothing,
    # or a tenant that sends little would hold every step (docs/tenants.md).
    spec = tenant_spec().model_copy(
        update={"rollout": tenant_spec().rollout.model_copy(update={"max_p99_increase": 0.25})}
    )
    table = base()
    for metric in ("p99Latency", "queueAge", "errorRate"):
        value, _, bad = table[("stable", "interactive[b]", metric)]
        table[("stable", "interactive[b]", metric)] = (value, 30.0, bad)
    lane = lane_of(analyse(table, spec))
    total = lane.check("p99Increase")
    assert total is not None and math.isfinite(total.threshold) and total.unjudged is None
    quiet = slice_of(lane, "b").check("p99Increase")
    assert quiet is not None and quiet.unjudged is None and quiet.outcome is Outcome.SUCCESSFUL, quiet.describe()
    assert lane.passes_step
    # The lane's own stable as quiet: the window waits for one that compares.
    for metric in ("p99Latency", "queueAge", "errorRate"):
        value, _, bad = table[("stable", "interactive", metric)]
        table[("stable", "interactive", metric)] = (value, 30.0, bad)
    lane = lane_of(analyse(table, spec))
    total = lane.check("p99Increase")
    assert total is not None and total.unjudged is not None
    assert not lane.passes_step and not lane.holds_step
