"""The objectives a canary is judged on: one record each.

A record says what counts as a bad event and where it is read (a histogram's buckets over the
threshold, or requests counted by outcome), the threshold and the budget it takes from the
lane's SLO, how it is judged (on its budget and against the stable track, or against the
stable track alone) and how people read it. The queries (:mod:`.queries`), the checks and
their status text (:mod:`.checks`) and the verdicts (:mod:`.verdicts`) follow
:data:`OBJECTIVES`: a new gate is one new record here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

from batchpilot_operator.spec import SLO, PolicySpec

LATENCY_METRIC = "batchpilot_request_latency_seconds"
QUEUE_AGE_METRIC = "batchpilot_queue_age_seconds"
REQUESTS_METRIC = "batchpilot_requests_total"
ERROR_OUTCOMES = ("rejected_full", "timed_out", "failed", "unavailable")
"""Outcomes of ``batchpilot_requests_total`` that count as errors (see the package docstring)."""
QUANTILE = 0.99
P99_BUDGET = 1 - QUANTILE
"""The share of requests a p99 objective allows over its threshold."""

MetricName = Literal["p99Latency", "p99Increase", "queueAge", "errorRate", "clientErrors"]
Track = Literal["stable", "canary"]


class Outcome(StrEnum):
    SUCCESSFUL = "Successful"
    FAILED = "Failed"
    INCONCLUSIVE = "Inconclusive"
    ERROR = "Error"


_PRECEDENCE = {Outcome.FAILED: 3, Outcome.ERROR: 2, Outcome.INCONCLUSIVE: 1, Outcome.SUCCESSFUL: 0}


def combine(outcomes: Sequence[Outcome]) -> Outcome:
    """The outcome of several checks: Failed > Error > Inconclusive > Successful."""
    if not outcomes:
        return Outcome.INCONCLUSIVE
    return max(outcomes, key=lambda o: _PRECEDENCE[o])


@dataclass(frozen=True)
class Histogram:
    """Bad events are the requests over the threshold, read from ``<metric>_bucket``; the
    value people read is the histogram's p99."""

    metric: str


@dataclass(frozen=True)
class Counted:
    """Bad events are the requests of ``batchpilot_requests_total`` whose label matchers are
    ``bad``, among those matching ``of`` ("": every request); the value people read is that
    share. ``by_code``: the evidence also names the bad requests' status codes."""

    bad: str
    of: str = ""
    by_code: bool = False


@dataclass(frozen=True)
class Objective:
    name: MetricName
    label: str
    """What people call it in the status text: ``p99 latency``."""
    bad: str
    """What a bad event is, in the status text: ``slower than the SLO``."""
    source: Histogram | Counted
    threshold: Callable[[SLO], float]
    """The value a request is judged against (a histogram objective) from the lane's SLO."""
    budget: Callable[[SLO], float]
    """The share of bad events the objective allows, from the lane's SLO."""
    stable_only: bool = False
    """Judged only against the stable track, with no budget of its own (clientErrors: 4xx the
    stable returns alike are the clients' own; :func:`.checks.judge_client_errors`)."""
    relative: bool = False
    """The threshold is not the SLO's but the stable's own p99 of the same window times
    ``1 + rollout.maxP99Increase``, for both tracks (:func:`relative_threshold`), and the
    objective is judged only when the policy sets that field (:func:`judged_metrics`)."""

    @property
    def counted(self) -> bool:
        """Counted from the request counter (else read from a histogram's buckets)."""
        return isinstance(self.source, Counted)

    def format(self, value: float) -> str:
        """A value for people: seconds for a histogram's p99, a percentage for a counted share."""
        if math.isinf(value):
            return "+Inf (beyond the largest bucket)"
        if self.counted:
            return f"{value * 100:.3g}%"
        return f"{value:.4g}s"


_ERRORS = 'outcome=~"' + "|".join(ERROR_OUTCOMES) + '"'

OBJECTIVES: tuple[Objective, ...] = (
    Objective(
        name="p99Latency",
        label="p99 latency",
        bad="slower than the SLO",
        source=Histogram(LATENCY_METRIC),
        threshold=lambda slo: slo.p99_latency,
        budget=lambda slo: P99_BUDGET,
    ),
    Objective(
        # Opt-in (rollout.maxP99Increase): a regression against the stable that stays inside
        # the SLO. Bad events are the requests slower than (1 + maxP99Increase) times the
        # stable's p99 of the window, on both tracks: at most 1% of the canary's may be (its
        # p99 within that factor of the stable's), and the canary is compared with the stable's
        # share over the same threshold (under 1%, the threshold being above the stable's p99).
        name="p99Increase",
        label="p99 against the stable",
        bad="slower than the stable's p99 times 1 + maxP99Increase",
        source=Histogram(LATENCY_METRIC),
        threshold=lambda slo: math.inf,  # per window: relative_threshold
        budget=lambda slo: P99_BUDGET,
        relative=True,
    ),
    Objective(
        name="queueAge",
        label="p99 queue age",
        bad="queued longer than maxQueueAge",
        source=Histogram(QUEUE_AGE_METRIC),
        threshold=lambda slo: slo.max_queue_age,
        budget=lambda slo: P99_BUDGET,
    ),
    Objective(
        name="errorRate",
        label="error rate",
        bad="errors",
        # Errors among the requests served or refused; ``invalid`` (4xx) counts neither way.
        source=Counted(bad=_ERRORS, of='outcome!="invalid"'),
        threshold=lambda slo: slo.max_error_rate,
        budget=lambda slo: slo.max_error_rate,
    ),
    Objective(
        # Client-breaking changes: the share of all requests answered 4xx (``invalid``). Not an
        # SLO of the lane: judged only against the stable track.
        name="clientErrors",
        label="rejected (4xx)",
        bad="rejected",
        source=Counted(bad='outcome="invalid"', by_code=True),
        threshold=lambda slo: 0.0,
        budget=lambda slo: 0.0,
        stable_only=True,
    ),
)
METRICS: tuple[MetricName, ...] = tuple(o.name for o in OBJECTIVES)
_BY_NAME = {o.name: o for o in OBJECTIVES}


def objective(name: MetricName) -> Objective:
    return _BY_NAME[name]


def format_value(metric: MetricName, value: float) -> str:
    """A metric's value for people: seconds for latencies, a percentage for the error rate."""
    return objective(metric).format(value)


def format_share(fraction: float) -> str:
    """A fraction as a percentage for people: 0.0412 -> '4.12%', 0.0 -> '0%'."""
    return f"{fraction * 100:.3g}%"


def format_confidence(confidence: float) -> str:
    """A confidence for people, never rounded up to a certainty: 0.97 -> '97%', 0.99996 -> '>99.99%'."""
    if confidence >= 0.9999:
        return ">99.99%"
    pct = math.floor(confidence * 10000) / 100
    return f"{pct:.2f}".rstrip("0").rstrip(".") + "%"


def judged_metrics(spec: PolicySpec) -> tuple[MetricName, ...]:
    """The objectives the policy's canaries are judged on: every one, but a relative objective
    only when the policy sets ``rollout.maxP99Increase``."""
    relative = spec.rollout.max_p99_increase is not None
    return tuple(o.name for o in OBJECTIVES if relative or not o.relative)


def relative_threshold(spec: PolicySpec, stable_p99: float | None) -> float | None:
    """A relative objective's threshold for both tracks, from the stable's p99 of the window:
    ``(1 + rollout.maxP99Increase)`` times it; None without a stable p99 to compare with."""
    increase = spec.rollout.max_p99_increase
    if increase is None or stable_p99 is None or not math.isfinite(stable_p99) or stable_p99 <= 0:
        return None
    return (1.0 + increase) * stable_p99


def lane_thresholds(spec: PolicySpec, lane: str) -> dict[MetricName, float]:
    """The value a request of the lane is judged against, per objective (a relative one's is
    the window's, :func:`relative_threshold`: here ``inf``, no request over it)."""
    slo = spec.lane_slo(lane)
    return {o.name: o.threshold(slo) for o in OBJECTIVES}


def lane_budgets(spec: PolicySpec, lane: str) -> dict[MetricName, float]:
    """The bad fraction each objective allows: 1% over a p99 threshold, maxErrorRate errors,
    no 4xx beyond the stable's (clientErrors has no budget of its own: judge_client_errors)."""
    slo = spec.lane_slo(lane)
    return {o.name: o.budget(slo) for o in OBJECTIVES}
