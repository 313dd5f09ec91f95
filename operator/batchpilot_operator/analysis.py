"""Canary analysis: PromQL builders and the verdict logic. Pure (the backend is injected).

Metrics (the runtime contract): histograms ``batchpilot_request_latency_seconds`` and
``batchpilot_queue_age_seconds`` and the counter ``batchpilot_requests_total{outcome}``, with
labels ``lane`` and ``revision``; Prometheus adds the target labels ``namespace``, ``policy``
and ``track`` (the PodMonitor relabels them from pod labels; the test harness sets them as
static target labels).

Per lane, track and revision, over a window W equal to the analysis interval::

    p99:     histogram_quantile(0.99, sum by (le) (rate(<hist>_bucket{sel}[W])))
    samples: sum(increase(<hist>_count{sel}[W]))

    error rate: (sum(rate(batchpilot_requests_total{sel,outcome=~"<errors>"}[W])) or vector(0))
                  / sum(rate(batchpilot_requests_total{sel,outcome!="invalid"}[W]))
    samples:    sum(increase(batchpilot_requests_total{sel,outcome!="invalid"}[W]))

The error outcomes are the server's failures to serve a well-formed request: ``rejected_full``
(429, queue full), ``timed_out`` (504), ``failed`` (500, the model raised) and ``unavailable``
(503). ``invalid`` (4xx, the client's fault) counts neither way. Latency and queue age only
see the requests that were served, so a change that sheds load (a queue bound too small for
the bursts, a model that fails) would look fast; the error rate is what catches it.

Every objective is read as *bad events among requests* over the window: requests slower
than the lane's p99 SLO (p99 <= SLO is exactly "at most 1% of requests over it"; the count
over the SLO comes from the histogram buckets, interpolated inside a bucket as
``histogram_quantile`` does), requests that waited longer than ``maxQueueAge`` (p99 queue
age), and requests answered with an error (budget ``maxErrorRate``). The ``budget`` is the
bad fraction the objective allows: 1% for the two p99s, ``maxErrorRate`` for errors.

Verdict of one objective of one lane, on the canary's *tally*: its bad events and requests
per sub-window (:data:`SLICES` per analysis window) over this analysis and its earlier ones
(its last :data:`TALLY_ANALYSES` analyses, kept in ``status.rollout.evidence``), against the stable
track's over the same sub-windows:

* a query that errored (Prometheus unreachable, bad response) -> ``Error``;
* fewer canary requests than ``minSamples`` in this window (or no data) -> ``Inconclusive``:
  thin traffic never fails a canary by itself;
* the tally's bad share within its budget -> ``Successful``;
* the tally breaches, over its budget with at least ``rollout.confidence``, and the canary is
  worse than the stable with at least that confidence -> ``Failed`` (both halves are tested,
  each at the confidence: an intersection-union test, whose level is that confidence; a point
  estimate just over the budget rolled back 4% of simulated A/A rollouts on on/off traffic,
  ``bench/canary_eval.py``); when the stable's tally breaches too (a burst or an
  overload both tracks see), the canary must also be at least :data:`SHARED_BREACH_RATIO`
  times as bad as the stable (an effect size, like Kayenta's allowed increase). Without a
  usable stable (no stable track, its queries erroring, or fewer than ``minSamples`` stable
  requests in the window that do not show a breach of their own with that confidence), being
  over the budget with that confidence decides instead;
* otherwise (a breach the stable shares, or too thin to tell) -> ``Inconclusive``, with the
  reason in the evidence. A breach the stable shares without the canary being clearly worse
  passes the lane's step like a Successful analysis (a burst, not the canary); any other
  breach extends the step and takes back the lane's earlier pass of it
  (:attr:`LaneVerdict.passes_step` / :attr:`LaneVerdict.holds_step`). After
  ``maxInconclusive`` in a row the rollout holds as Stalled; it never rolls back for this.

Each confidence is the lesser of two tests that must agree: an exact test on the tallied
counts (Fisher's one-sided test against the stable; binomial against the budget) and a
cluster-robust t test across the sub-windows (paired by sub-window against the stable). The
exact test is right for few events but takes every request as independent; bad events come
in runs (a queue that builds on one pod delays every request behind it), and the sub-window
test counts one burst as one piece of evidence however many requests it delayed.

Why this rule (measured in bench/canary_eval.py; README "How the canary verdict decides"):
a p99 from one window of a few hundred requests is the window's 2nd or 3rd slowest request,
and under bursty traffic both tracks swing far over the SLO together. The earlier rule
compared the canary's p99 point with the SLO and excused it only when within 10% of an
equally breaching stable; it failed good canaries whenever a burst happened to land on the
canary's pods a little harder. Counting the bad events uses every request, and asking
whether the canary's share of them is larger than chance puts a stated error rate
(1 - confidence) on the comparison instead of a fixed 10%. Kayenta judges canaries by a
rank test over the distributions; for a p99 objective the tail is what matters (a change
that moves the median and not the tail is not a breach), so the test is on the tail beyond
the SLO itself. The tally lets a steady small breach (a queue that sheds 2% against a 1%
budget) add up over analyses where one window cannot show it.

Precedence, for a lane and for the whole analysis: Failed > Error > Inconclusive >
Successful. A breach measured with enough samples is evidence even if another query failed;
an Error outranks Inconclusive because "we could not look" must follow
``onMetricsUnavailable`` rather than quietly extend the step.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum
from typing import Any, Literal, Protocol

from batchpilot_operator.spec import PolicySpec
from batchpilot_operator.stats import (
    Slices,
    binomial_sf,
    burst_variance,
    clustered_greater,
    clustered_over_budget,
    count_above,
    fisher_greater,
    rate_variance,
)
from batchpilot_operator.tune.calibration import RevisionCheck

LATENCY_METRIC = "batchpilot_request_latency_seconds"
QUEUE_AGE_METRIC = "batchpilot_queue_age_seconds"
REQUESTS_METRIC = "batchpilot_requests_total"
ERROR_OUTCOMES = ("rejected_full", "timed_out", "failed", "unavailable")
"""Outcomes of ``batchpilot_requests_total`` that count as errors (see the module docstring)."""
QUANTILE = 0.99
P99_BUDGET = 1 - QUANTILE
"""The share of requests a p99 objective allows over its threshold."""
SLICES = 5
"""Sub-windows of an analysis window: the clusters of the burst-robust tests (see judge)."""
SHARED_BREACH_RATIO = 2.0
"""When the stable breaches too, the canary is blamed only if at least this many times as bad."""
TALLY_ANALYSES = 4
TALLY_SLICES = TALLY_ANALYSES * SLICES
"""Sub-windows of the canary's tally: the evidence of its last 4 analyses (see judge). Long
enough for a steady small breach to add up, short enough that one burst leaves it soon."""

MetricName = Literal["p99Latency", "queueAge", "errorRate", "clientErrors"]
Track = Literal["stable", "canary"]
METRICS: tuple[MetricName, ...] = ("p99Latency", "queueAge", "errorRate", "clientErrors")
_HISTOGRAM: dict[MetricName, str] = {"p99Latency": LATENCY_METRIC, "queueAge": QUEUE_AGE_METRIC}


def format_value(metric: MetricName, value: float) -> str:
    """A metric's value for people: seconds for latencies, a percentage for the error rate."""
    if math.isinf(value):
        return "+Inf (beyond the largest bucket)"
    if metric in ("errorRate", "clientErrors"):
        return f"{value * 100:.3g}%"
    return f"{value:.4g}s"


def format_share(fraction: float) -> str:
    """A fraction as a percentage for people: 0.0412 -> '4.12%', 0.0 -> '0%'."""
    return f"{fraction * 100:.3g}%"


def format_confidence(confidence: float) -> str:
    """A confidence for people, never rounded up to a certainty: 0.97 -> '97%', 0.99996 -> '>99.99%'."""
    if confidence >= 0.9999:
        return ">99.99%"
    pct = math.floor(confidence * 10000) / 100
    return f"{pct:.2f}".rstrip("0").rstrip(".") + "%"


_LABEL: dict[MetricName, str] = {
    "p99Latency": "p99 latency",
    "queueAge": "p99 queue age",
    "errorRate": "error rate",
    "clientErrors": "rejected (4xx)",
}
_BAD: dict[MetricName, str] = {
    "p99Latency": "slower than the SLO",
    "queueAge": "queued longer than maxQueueAge",
    "errorRate": "errors",
    "clientErrors": "rejected",
}
_COUNTED: frozenset[MetricName] = frozenset({"errorRate", "clientErrors"})
"""Objectives counted from the request counter (the others from a histogram's buckets)."""


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


# --------------------------------------------------------------------------- queries


def promql_window(seconds: float) -> str:
    """A PromQL range for a window in seconds: whole seconds as ``30s``, else milliseconds."""
    if seconds <= 0:
        raise ValueError(f"analysis window must be positive, got {seconds}")
    if float(seconds).is_integer():
        return f"{int(seconds)}s"
    return f"{max(1, round(seconds * 1000))}ms"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"')


def selector(
    *,
    namespace: str,
    policy: str,
    track: str,
    revision: str,
    lane: str,
    extra: str = "",
    tenant: str | None = None,
    environment: str | None = None,
) -> str:
    """The label matchers of one (policy, track, revision, lane), plus ``extra`` matchers verbatim;
    with ``environment`` the target label of that name, with ``tenant`` one tenant slice."""
    labels = {"namespace": namespace, "policy": policy, "track": track, "revision": revision, "lane": lane}
    if environment is not None:
        labels["environment"] = environment
    if tenant is not None:
        labels["tenant"] = tenant
    matchers = [f'{k}="{_escape(v)}"' for k, v in labels.items()]
    if extra:
        matchers.append(extra)
    return "{" + ",".join(matchers) + "}"


@dataclass(frozen=True)
class MetricQueries:
    """The queries of one metric of one (track, revision, lane).

    ``value`` is what people read (the p99, the error rate); ``samples`` counts the requests;
    ``bad`` gives the bad events: the histogram's buckets by ``le`` (the count over the
    threshold is read from them), or the count of error outcomes.
    """

    metric: MetricName
    value: str
    samples: str
    bad: str
    codes: str | None = None
    """clientErrors: the rejected requests by status ``code`` (for the evidence)."""


def lane_key(lane: str, tenant: str | None) -> str:
    """A lane's name, or one tenant slice of it: ``interactive``, ``interactive[b]``."""
    return lane if tenant is None else f"{lane}[{tenant}]"


@dataclass(frozen=True)
class LaneQueries:
    track: Track
    revision: str
    lane: str
    window: str
    metrics: tuple[MetricQueries, ...]
    tenant: str | None = None
    """One tenant slice of the lane (None: the lane's total, every tenant)."""
    environment: str | None = None

    @property
    def key(self) -> str:
        return lane_key(self.lane, self.tenant)

    def all(self) -> list[str]:
        return [q for m in self.metrics for q in (m.value, m.samples, m.bad, m.codes) if q is not None]

    def metric(self, name: MetricName) -> MetricQueries:
        for m in self.metrics:
            if m.metric == name:
                return m
        raise KeyError(name)


def build_queries(
    *,
    policy: str,
    namespace: str,
    track: Track,
    revision: str,
    lane: str,
    window: float,
    tenant: str | None = None,
    environment: str | None = None,
) -> LaneQueries:
    """All queries of one lane (or one tenant slice of it) of one track/revision over ``window`` seconds."""
    labels: dict[str, Any] = {
        "namespace": namespace,
        "policy": policy,
        "track": track,
        "revision": revision,
        "lane": lane,
        "tenant": tenant,
        "environment": environment,
    }
    sel = selector(**labels)
    w = promql_window(window)
    metrics = [
        MetricQueries(
            metric=name,
            value=(f"histogram_quantile({QUANTILE}, sum by (le) (rate({hist}_bucket{sel}[{w}])))"),
            samples=f"sum(increase({hist}_count{sel}[{w}]))",
            bad=f"sum by (le) (increase({hist}_bucket{sel}[{w}]))",
        )
        for name, hist in _HISTOGRAM.items()
    ]
    errors = selector(**labels, extra=f'outcome=~"{"|".join(ERROR_OUTCOMES)}"')
    served = selector(**labels, extra='outcome!="invalid"')
    metrics.append(
        MetricQueries(
            metric="errorRate",
            # `or vector(0)`: no error series at all (an exporter that creates outcome series
            # lazily) is a zero rate, not "no data"; no served series still is no data.
            value=(
                f"(sum(rate({REQUESTS_METRIC}{errors}[{w}])) or vector(0)) / sum(rate({REQUESTS_METRIC}{served}[{w}]))"
            ),
            samples=f"sum(increase({REQUESTS_METRIC}{served}[{w}]))",
            bad=f"sum(increase({REQUESTS_METRIC}{errors}[{w}])) or vector(0)",
        )
    )
    # Client-breaking changes: the share of all requests answered 4xx (``invalid``). Not an
    # SLO of the lane: judged only against the stable track (see judge_client_errors).
    rejected = selector(**labels, extra='outcome="invalid"')
    metrics.append(
        MetricQueries(
            metric="clientErrors",
            value=f"(sum(rate({REQUESTS_METRIC}{rejected}[{w}])) or vector(0)) / sum(rate({REQUESTS_METRIC}{sel}[{w}]))",
            samples=f"sum(increase({REQUESTS_METRIC}{sel}[{w}]))",
            bad=f"sum(increase({REQUESTS_METRIC}{rejected}[{w}])) or vector(0)",
            codes=f"sum by (code) (increase({REQUESTS_METRIC}{rejected}[{w}]))",
        )
    )
    return LaneQueries(
        track=track,
        revision=revision,
        lane=lane,
        window=w,
        metrics=tuple(metrics),
        tenant=tenant,
        environment=environment,
    )


# --------------------------------------------------------------------------- backend


@dataclass(frozen=True)
class Measurement:
    """The result of one instant query: a scalar, or histogram buckets.

    ``value`` is None when the query returned no series or NaN (no traffic): that is no
    data, not an error. ``buckets`` holds ``(le, count)`` pairs when the answer was one
    series per ``le`` (a ``sum by (le)`` query). ``error`` is set when the query failed.
    """

    query: str
    value: float | None = None
    error: str | None = None
    buckets: tuple[tuple[float, float], ...] | None = None
    groups: tuple[tuple[str, float], ...] | None = None
    """One value per value of the one label a ``sum by (label)`` query keeps (e.g. ``code``)."""


class MetricsBackend(Protocol):
    """What the analysis needs from a metrics store: run instant queries at one instant
    (``at``, Unix seconds; None: now), never raise for store faults (unreachable, timeout,
    bad response): those come back as ``error``."""

    def measure(self, queries: Sequence[str], at: float | None = None) -> Mapping[str, Measurement]: ...


# --------------------------------------------------------------------------- verdicts


@dataclass(frozen=True)
class MetricCheck:
    """One metric of one lane of one track: the evidence and its outcome.

    ``bad`` is the number of bad events among ``samples`` requests (over the threshold, or
    errors) and ``budget`` the fraction the objective allows. For a canary check that
    breached, ``confidence_over_budget`` and ``confidence_worse`` are the confidences of the
    two tests of the verdict (``None``: not run, e.g. no usable stable), and ``stable`` the
    stable track's check it was compared with.
    """

    track: Track
    revision: str
    lane: str
    metric: MetricName
    query: str
    samples_query: str
    value: float | None
    samples: float | None
    threshold: float
    outcome: Outcome
    error: str | None = None
    note: str | None = None
    """Why the outcome is not the plain SLO comparison (a breach not attributed to the canary)."""
    bad: float | None = None
    budget: float = P99_BUDGET
    confidence_over_budget: float | None = None
    confidence_worse: float | None = None
    stable: MetricCheck | None = None
    tally: tuple[float, float] | None = None
    """(bad events, requests) the verdict was on: this window's and the earlier analyses'."""
    stable_tally: tuple[float, float] | None = None
    shared_breach: bool = False
    """Inconclusive because the stable's tally breaches too and the canary is not clearly
    worse: a burst or an overload both tracks see, not the canary."""
    tenant: str | None = None
    """The tenant slice this check is of (None: the lane's total)."""
    codes: tuple[tuple[str, float], ...] | None = None
    """clientErrors: the rejected requests by status code over the window."""
    buckets: tuple[tuple[float, float], ...] | None = None
    """p99Latency and queueAge: the window's cumulative histogram ``(le, count)`` (``power``)."""
    burstiness: float | None = None
    """How bursty the stable's bad events of this objective are over the tally's sub-windows,
    at least as bursty as its traffic (:func:`stats.burst_variance`, :func:`stats.rate_variance`;
    None without sub-windows): what the sub-window test discounts a burst by, and so what the
    gate can see (``power``)."""

    @property
    def thin(self) -> bool:
        """Too few requests (or none) to judge: Inconclusive with no breach to report."""
        return self.outcome is Outcome.INCONCLUSIVE and self.note is None

    @property
    def bad_fraction(self) -> float | None:
        if self.bad is None or not self.samples:
            return None
        return min(1.0, self.bad / self.samples)

    def breaches(self) -> bool:
        """More bad events than the budget allows (the point estimate; no test)."""
        frac = self.bad_fraction
        return frac is not None and frac > self.budget

    def describe(self) -> str:
        """The check in words on-call reads (Events, ledger, ``kubectl batchpilot``)."""
        where = f"lane {self.lane}" + (f" tenant {self.tenant}" if self.tenant is not None else "")
        head = f"{where} {_LABEL[self.metric]}"
        if self.outcome is Outcome.ERROR:
            return f"{head}: query error ({self.error})"
        if self.metric == "clientErrors":
            return self._describe_rejected(where)
        threshold = format_value(self.metric, self.threshold)
        value = "no data" if self.value is None else format_value(self.metric, self.value)
        samples = "0" if self.samples is None else f"{self.samples:.0f}"
        if self.samples is None or self.value is None or self.bad_fraction is None:
            return f"{head}: no data from {samples} requests"
        if self.outcome is Outcome.INCONCLUSIVE and self.note is None:
            return f"{head}: {value} from {samples} requests (too few)"
        if self.outcome is Outcome.SUCCESSFUL:
            if self.value > self.threshold and self.tally is not None:
                k, n = self.tally
                return (
                    f"{head}: {value} > {threshold} in this window, but {format_share(k / n if n else 0.0)} of "
                    f"{n:.0f} requests of the tally {_BAD[self.metric]}: within the {format_share(self.budget)} budget"
                )
            return f"{head}: {value} <= {threshold} ({samples} requests)"
        stable = self.stable
        vs = ""
        if stable is not None and stable.value is not None and stable.bad_fraction is not None:
            vs = f" vs stable {format_value(self.metric, stable.value)}"
        k, n = self.tally or (self.bad or 0.0, self.samples or 0.0)
        share = f"{format_share(k / n if n else 0.0)} of {n:.0f} requests {_BAD[self.metric]}"
        if self.stable_tally is not None:
            ks, ns = self.stable_tally
            share += f" vs {format_share(ks / ns if ns else 0.0)} of {ns:.0f} on stable"
        elif stable is not None and stable.bad_fraction is not None:
            share += f" vs {format_share(stable.bad_fraction)} of {stable.samples or 0:.0f} on stable"
        if self.tally is not None and self.tally[1] > (self.samples or 0) + 0.5:
            share += " (this and earlier analyses)"
        text = f"{head}: canary {value} > {threshold}{vs}; {share}"
        tests = []
        if self.confidence_worse is not None:
            tests.append(f"worse than stable with {format_confidence(self.confidence_worse)} confidence")
        if self.confidence_over_budget is not None:
            tests.append(
                f"over its {format_share(self.budget)} budget with {format_confidence(self.confidence_over_budget)}"
                " confidence"
            )
        if tests:
            text += "; " + ", ".join(tests)
        if self.note:
            text += f"; {self.note}"
        return text

    def _describe_rejected(self, where: str) -> str:
        """The 4xx comparison in words: ``lane x tenant b: rejected 100% (400) of 120 requests vs stable 0% of 300``."""
        k, n = self.tally or (self.bad or 0.0, self.samples or 0.0)
        if self.samples is None or self.bad is None or n <= 0:
            return f"{where}: rejected (4xx) no data from {self.samples or 0:.0f} requests"
        codes = ", ".join(code for code, count in sorted(self.codes or ()) if count > 0)
        text = f"{where}: rejected {format_share(k / n)}" + (f" ({codes})" if codes else "") + f" of {n:.0f} requests"
        if self.stable_tally is not None:
            ks, ns = self.stable_tally
            text += f" vs stable {format_share(ks / ns if ns else 0.0)} of {ns:.0f}"
        elif self.stable is not None and self.stable.bad_fraction is not None:
            text += f" vs stable {format_share(self.stable.bad_fraction)} of {self.stable.samples or 0:.0f}"
        if self.tally is not None and self.tally[1] > (self.samples or 0) + 0.5:
            text += " (this and earlier analyses)"
        if self.outcome is Outcome.INCONCLUSIVE and self.note is None:
            return text + " (too few)"
        if self.confidence_worse is not None and self.outcome is not Outcome.SUCCESSFUL:
            text += f"; worse than stable with {format_confidence(self.confidence_worse)} confidence"
        if self.note:
            text += f"; {self.note}"
        return text


@dataclass(frozen=True)
class LaneVerdict:
    """A lane's verdict: its total (every tenant) and, when the policy declares tenants, one
    verdict per tenant slice in ``slices``, each by the same rule on the slice's own requests.

    How slices combine into the lane (README "Tenant slices"): a slice's objective with too few
    requests in the window (``minSamples``, as for the total) is *thin*: Inconclusive for that
    slice, recorded, and left out of the lane's outcome and of its step pass, so a tenant that
    sends little never holds the rollout (its requests still count in the lane's total). Any
    other slice outcome counts as the total's would: a Failed slice fails the lane even when
    the total passes, an Error or a breach not yet pinned on the canary holds the step. The
    judged slices share the lane's error rate: each is held to :func:`slice_confidence`.
    """

    lane: str
    outcome: Outcome
    canary: tuple[MetricCheck, ...]
    stable: tuple[MetricCheck, ...] = ()
    tenant: str | None = None
    slices: tuple[LaneVerdict, ...] = ()

    @property
    def thin(self) -> bool:
        """A tenant slice with too few requests to judge any objective."""
        return bool(self.canary) and all(c.thin for c in self.canary)

    def checks(self) -> tuple[MetricCheck, ...]:
        """The canary's checks of the total and of every slice that was judged (not thin)."""
        return self.canary + tuple(c for s in self.slices for c in s.canary if not c.thin)

    def check(self, metric: MetricName, track: Track = "canary") -> MetricCheck | None:
        for c in self.canary if track == "canary" else self.stable:
            if c.metric == metric:
                return c
        return None

    @property
    def passes_step(self) -> bool:
        """Nothing against the canary: every objective Successful, or breached only as the
        stable breaches too without the canary being clearly worse (a burst both tracks saw);
        and so in every tenant slice, where a thin objective counts for nothing."""
        thin_ok = self.tenant is not None

        def passes(c: MetricCheck) -> bool:
            return (
                c.outcome is Outcome.SUCCESSFUL
                or (c.outcome is Outcome.INCONCLUSIVE and c.shared_breach)
                or (thin_ok and c.thin)
            )

        return bool(self.canary) and all(passes(c) for c in self.canary) and all(s.passes_step for s in self.slices)

    @property
    def holds_step(self) -> bool:
        """Something against the canary: an objective Failed, or breached in a way the data
        cannot yet pin on it (alone, or clearly worse than a breaching stable but not twice
        as bad). Thin traffic (too few requests to judge) holds nothing against it."""
        return any(
            c.outcome is Outcome.FAILED
            or (c.outcome is Outcome.INCONCLUSIVE and c.note is not None and not c.shared_breach)
            for c in self.canary
        ) or any(s.holds_step for s in self.slices)


@dataclass(frozen=True)
class AnalysisResult:
    """One analysis of the canary over the last interval, all lanes."""

    time: datetime
    window: str
    canary_revision: str
    stable_revision: str | None
    lanes: tuple[LaneVerdict, ...] = field(default_factory=tuple)
    tally: dict[str, list[list[float]]] = field(default_factory=dict)
    """The canary's tally after this analysis (``status.rollout.evidence``; see verdicts)."""
    underfed: str | None = None
    """Why this analysis could not pass the step with the canary fed less than the stable per
    pod and no later step feeding it (``fairness.judge_load``), with what to change."""
    model: tuple[RevisionCheck, ...] = ()
    """The latency model against each revision's pods over this window (``modelwatch``; only
    with ``spec.tuning``, which lets the operator read the pods' arrivals): never a verdict."""

    def model_checks(self, lane: str) -> dict[str, RevisionCheck]:
        """Track -> the model's check of that lane (absent: not attempted)."""
        return {m.track: m for m in self.model if m.lane == lane}

    @property
    def outcome(self) -> Outcome:
        return combine([lane.outcome for lane in self.lanes])

    def evidence(self, only: Sequence[Outcome] | None = None) -> str:
        """A short text with the canary's values (optionally only checks with given outcomes)."""
        parts = [c.describe() for lane in self.lanes for c in lane.checks() if only is None or c.outcome in only]
        return "; ".join(parts) if parts else "no measurements"


def _finite(value: float | None) -> float | None:
    if value is None or not math.isfinite(value):
        return None
    return value


def _not_nan(value: float | None) -> float | None:
    """NaN is "no data"; +Inf stays (a quantile in the +Inf bucket is a breach, not a gap)."""
    if value is None or math.isnan(value):
        return None
    return value


def _bad_events(metric: MetricName, m: Measurement, threshold: float, samples: float | None) -> float | None:
    """Bad events from the ``bad`` query: the count over ``threshold`` from buckets, or errors."""
    histogram = metric in _HISTOGRAM
    bad = (count_above(m.buckets, threshold) if m.buckets else None) if histogram else _finite(m.value)
    if bad is None or samples is None:
        return bad
    return min(bad, samples)


def check_metric(
    *,
    queries: LaneQueries,
    metric: MetricName,
    measurements: Mapping[str, Measurement],
    threshold: float,
    min_samples: int,
    budget: float = P99_BUDGET,
) -> MetricCheck:
    """One track's metric from its raw measurements, judged on its own (no comparison yet):
    Error, Inconclusive (too few samples or no data), Failed (over budget) or Successful."""
    mq = queries.metric(metric)
    missing = "not measured"
    value_m = measurements.get(mq.value, Measurement(mq.value, error=missing))
    samples_m = measurements.get(mq.samples, Measurement(mq.samples, error=missing))
    bad_m = measurements.get(mq.bad, Measurement(mq.bad, error=missing))
    value = _not_nan(value_m.value)
    samples = _finite(samples_m.value)
    error = value_m.error or samples_m.error or bad_m.error
    bad = None if error else _bad_events(metric, bad_m, threshold, samples)
    codes = measurements.get(mq.codes) if mq.codes is not None else None
    check = MetricCheck(
        track=queries.track,
        revision=queries.revision,
        lane=queries.lane,
        metric=metric,
        query=mq.value,
        samples_query=mq.samples,
        value=value,
        samples=samples,
        threshold=threshold,
        outcome=Outcome.SUCCESSFUL,
        error=error,
        bad=bad,
        budget=budget,
        tenant=queries.tenant,
        codes=codes.groups if codes is not None and codes.error is None else None,
        buckets=bad_m.buckets if metric in _HISTOGRAM and error is None else None,
    )
    if error is not None:
        outcome = Outcome.ERROR
    elif samples is None or samples < min_samples or value is None or bad is None:
        outcome = Outcome.INCONCLUSIVE
    elif check.breaches():
        outcome = Outcome.FAILED
    else:
        outcome = Outcome.SUCCESSFUL
    return dataclasses.replace(check, outcome=outcome)


def _least(*confidences: float | None) -> float | None:
    known = [c for c in confidences if c is not None]
    return min(known) if known else None


def judge(
    canary: MetricCheck,
    stable: MetricCheck | None,
    confidence: float,
    canary_slices: Slices | None = None,
    stable_slices: Slices | None = None,
) -> MetricCheck:
    """The canary's verdict on one objective: its tally against the stable's and its budget.

    ``canary`` and ``stable`` are this window's checks (:func:`check_metric`); a canary check
    that is Error or Inconclusive (too few requests in this window) stays so. ``*_slices``
    are (bad events, requests) per sub-window of the tally (without them, this window's
    counts). Successful when the tallied bad share is within the budget; Failed when it is
    not and the canary is worse than a usable stable with ``confidence`` (no usable stable:
    over its budget with ``confidence``); otherwise Inconclusive with the reason in ``note``.
    Each confidence is the lesser of the exact test and the sub-window test (module doc).
    """
    if canary.outcome in (Outcome.ERROR, Outcome.INCONCLUSIVE) or canary.bad is None or canary.samples is None:
        return canary
    burstiness = _burstiness(stable_slices) if stable_slices else None
    k_c, n_c = _totals(canary_slices) if canary_slices else (canary.bad, canary.samples)
    if n_c <= 0 or k_c / n_c <= canary.budget:
        return dataclasses.replace(canary, outcome=Outcome.SUCCESSFUL, tally=(k_c, n_c), burstiness=burstiness)
    over = _least(
        1.0 - binomial_sf(k_c, n_c, canary.budget),
        clustered_over_budget(canary_slices, canary.budget) if canary_slices else None,
    )
    assert over is not None
    worse: float | None = None
    stable_tally: tuple[float, float] | None = None
    paired = stable_slices if canary_slices and stable_slices and len(stable_slices) == len(canary_slices) else None
    if _baseline(stable, paired, confidence):
        assert stable is not None and stable.bad is not None and stable.samples is not None
        k_s, n_s = _totals(paired) if paired else (stable.bad, stable.samples)
        k_c_, n_c_ = (k_c, n_c) if paired else (canary.bad, canary.samples)
        stable_tally = (k_s, n_s)
        worse = _least(
            1.0 - fisher_greater(k_c_, n_c_, k_s, n_s),
            clustered_greater(canary_slices, paired) if canary_slices and paired else None,
        )
    note = None
    stable_share = stable_tally[0] / stable_tally[1] if stable_tally is not None and stable_tally[1] > 0 else 0.0
    shared = stable_tally is not None and stable_share > canary.budget
    needs = f"needs {format_confidence(confidence)} confidence"
    if worse is None and over < confidence:
        note = f"a breach this thin is not conclusive ({needs})"
    elif worse is not None and worse < confidence:
        note = (
            "the stable track breaches too: not clearly the canary's doing"
            if shared
            else "not clearly worse than the stable track"
        ) + f" ({needs})"
    elif shared and k_c / n_c < SHARED_BREACH_RATIO * stable_share:
        note = (
            f"the stable track breaches too ({format_share(stable_share)}): the canary is worse, but not "
            f"{SHARED_BREACH_RATIO:g}x as bad, as a bad change would be in a burst or overload both tracks see"
        )
    elif over < confidence:
        # Both halves of the rule are tested (an intersection-union test: each at the
        # confidence, so the pair is too): worse than the stable, and over the budget.
        note = f"worse than the stable track, but not clearly over its {format_share(canary.budget)} budget ({needs})"
    return dataclasses.replace(
        canary,
        outcome=Outcome.FAILED if note is None else Outcome.INCONCLUSIVE,
        note=note,
        confidence_over_budget=over,
        confidence_worse=worse,
        stable=stable,
        tally=(k_c, n_c),
        stable_tally=stable_tally,
        shared_breach=shared and worse is not None and worse < confidence,
        burstiness=burstiness,
    )


def slice_confidence(confidence: float, judged: int) -> float:
    """The confidence each of ``judged`` tenant slices of a lane is held to: the lane's
    ``1 - confidence`` split evenly among them (Bonferroni; for "does any slice fail", which is
    all the lane's outcome asks, Holm's step-down test rejects exactly when this does).

    Each slice is another chance for chance alone to fail a good canary: with 9 slices each
    at the lane's own 0.95, simulated A/A rollouts on on/off traffic rolled back 7 of 400 with
    slices against 2 of 400 without (``bench/canary_eval.py --tenants both``). The lane's total
    keeps ``confidence``: the slices together add at most ``1 - confidence`` to its
    false-failure rate per analysis, whatever their number."""
    if judged <= 1:
        return confidence
    return 1.0 - (1.0 - confidence) / judged


def _burstiness(slices: Slices) -> float | None:
    """The stable's burstiness over the tally (``power``): that of its bad events, floored by
    that of its traffic (:func:`stats.burst_variance`, :func:`stats.rate_variance`)."""
    return max((v for v in (burst_variance(slices), rate_variance(slices)) if v is not None), default=None)


def _baseline(stable: MetricCheck | None, paired: Slices | None, confidence: float) -> bool:
    """Whether the stable's check is a baseline to compare the canary with.

    A stable with enough requests in the window is one. A *thin* stable (measured, but fewer
    than ``minSamples`` requests: a tenant slice the canary's pods happened to get most of) is
    one only when its own tally breaches the budget with ``confidence`` (the exact binomial
    test): the breach is then established on the stable too, and failing the canary on its
    budget alone would pin on it what both tracks show (``make demo``: a slice 16% slow on the
    canary against 42% of 93 requests on the stable was rolled back). A thin stable that does
    not show a breach is no evidence either way: the budget test decides, as with no stable.
    """
    if stable is None or stable.outcome is Outcome.ERROR or stable.bad is None or not stable.samples:
        return False
    if stable.outcome is not Outcome.INCONCLUSIVE:
        return True
    k_s, n_s = _totals(paired) if paired else (stable.bad, stable.samples)
    return n_s > 0 and k_s / n_s > stable.budget and 1.0 - binomial_sf(k_s, n_s, stable.budget) >= confidence


NO_STABLE_4XX = "no stable track with enough requests to compare with: 4xx are taken as the clients' own"


def judge_client_errors(
    canary: MetricCheck,
    stable: MetricCheck | None,
    confidence: float,
    canary_slices: Slices | None = None,
    stable_slices: Slices | None = None,
) -> MetricCheck:
    """The verdict on the canary's 4xx share: :func:`judge` with a zero budget, so any 4xx is a
    "breach" that fails only when the canary rejects more than the stable with ``confidence``
    (Fisher's one-sided test and the sub-window test), and, when the stable rejects some too
    (clients sending bad requests to both), only at :data:`SHARED_BREACH_RATIO` times its
    share: 4xx both tracks return alike stay the clients' fault. Without a usable stable
    (none, too few requests, its queries failing) there is nothing to tell a client's mistake
    from the canary's: Successful, with that said in ``note``."""
    usable = stable is not None and stable.outcome not in (Outcome.ERROR, Outcome.INCONCLUSIVE)
    if usable or canary.outcome in (Outcome.ERROR, Outcome.INCONCLUSIVE) or canary.bad is None:
        return judge(canary, stable, confidence, canary_slices, stable_slices)
    return dataclasses.replace(canary, outcome=Outcome.SUCCESSFUL, note=NO_STABLE_4XX if canary.bad else None)


def _totals(slices: Slices) -> tuple[float, float]:
    return sum(k for k, _ in slices), sum(n for _, n in slices)


def lane_thresholds(spec: PolicySpec, lane: str) -> dict[MetricName, float]:
    slo = spec.lane_slo(lane)
    return {
        "p99Latency": slo.p99_latency,
        "queueAge": slo.max_queue_age,
        "errorRate": slo.max_error_rate,
        "clientErrors": 0.0,
    }


def lane_budgets(spec: PolicySpec, lane: str) -> dict[MetricName, float]:
    """The bad fraction each objective allows: 1% over a p99 threshold, maxErrorRate errors,
    no 4xx beyond the stable's (clientErrors has no budget of its own: judge_client_errors)."""
    return {
        "p99Latency": P99_BUDGET,
        "queueAge": P99_BUDGET,
        "errorRate": spec.lane_slo(lane).max_error_rate,
        "clientErrors": 0.0,
    }


def plan_queries(
    spec: PolicySpec,
    *,
    policy: str,
    namespace: str,
    canary_revision: str,
    stable_revision: str | None,
    environment: str | None = None,
) -> list[LaneQueries]:
    """Every query one analysis runs: each lane of the canary, and of the stable track, in
    total and per tenant slice (:attr:`PolicySpec.tenant_slices`); ``environment``: only the
    targets Prometheus labels with it (the policy's ``batchpilot.dev/environment``)."""
    tracks: list[tuple[Track, str]] = [("canary", canary_revision)]
    if stable_revision is not None:
        tracks.append(("stable", stable_revision))
    tenants: list[str | None] = [None, *spec.tenant_slices]
    return [
        build_queries(
            policy=policy,
            namespace=namespace,
            track=track,
            revision=revision,
            lane=lane.name,
            window=spec.rollout.analysis_interval,
            tenant=tenant,
            environment=environment,
        )
        for lane in spec.lanes
        for tenant in tenants
        for track, revision in tracks
    ]


SliceKey = tuple[str, str, MetricName]
"""(track, lane key, metric): the lane key is the lane, or ``lane[tenant]`` (:func:`lane_key`)."""


def tally_key(key: SliceKey) -> str:
    track, lane, metric = key
    return f"{lane}/{metric}/{track}"


def pooled(
    slices: Mapping[SliceKey, Slices], history: Mapping[str, Sequence[Sequence[float]]]
) -> dict[SliceKey, Slices]:
    """Each key's earlier sub-windows followed by this window's, the last TALLY_SLICES of them.
    A key without slices this time (its queries failed) has no tally: the window decides."""
    out: dict[SliceKey, Slices] = {}
    for key, current in slices.items():
        earlier = [(float(k), float(n)) for k, n in history.get(tally_key(key), [])]
        out[key] = tuple([*earlier, *current][-TALLY_SLICES:])
    return out


def next_tally(
    slices: Mapping[SliceKey, Slices], history: Mapping[str, Sequence[Sequence[float]]]
) -> dict[str, list[list[float]]]:
    """The tally to keep after this analysis: each key's pooled sub-windows; a key without
    slices this time (its queries failed) keeps its earlier sub-windows, so a window of missing
    data loses no evidence."""
    kept = {key: [[float(k), float(n)] for k, n in v] for key, v in history.items()}
    kept.update({tally_key(key): [[b, n] for b, n in v] for key, v in pooled(slices, history).items()})
    return kept


def verdicts(
    spec: PolicySpec,
    lane_queries: Sequence[LaneQueries],
    measurements: Mapping[str, Measurement],
    slices: Mapping[SliceKey, Slices] | None = None,
    history: Mapping[str, Sequence[Sequence[float]]] | None = None,
) -> tuple[LaneVerdict, ...]:
    """Turn raw measurements into per-lane verdicts (the canary is judged against the stable).

    ``slices``: bad events and requests per sub-window of this window by (track, lane,
    metric) (:func:`slice_counts`); ``history``: the canary's tally so far
    (``status.rollout.evidence``, keyed by :func:`tally_key`), which this window's slices
    extend. The verdict is on the tally (:func:`judge`)."""
    sl = pooled(slices or {}, history or {})
    min_samples = spec.rollout.min_samples
    by_lane: dict[str, dict[str, list[MetricCheck]]] = {}
    for lq in lane_queries:
        thresholds = lane_thresholds(spec, lq.lane)
        budgets = lane_budgets(spec, lq.lane)
        checks = by_lane.setdefault(lq.key, {"canary": [], "stable": []})
        for metric in METRICS:
            checks[lq.track].append(
                check_metric(
                    queries=lq,
                    metric=metric,
                    measurements=measurements,
                    threshold=thresholds[metric],
                    min_samples=min_samples,
                    budget=budgets[metric],
                )
            )

    def lane_verdict(lane: str, tenant: str | None, confidence: float) -> LaneVerdict | None:
        key = lane_key(lane, tenant)
        lane_checks = by_lane.get(key)
        if lane_checks is None:
            return None
        stable = tuple(lane_checks["stable"])
        canary = tuple(
            (judge_client_errors if c.metric == "clientErrors" else judge)(
                c,
                next((s for s in stable if s.metric == c.metric), None),
                confidence,
                sl.get(("canary", key, c.metric)),
                sl.get(("stable", key, c.metric)),
            )
            for c in lane_checks["canary"]
        )
        if tenant is None:
            outcome = combine([c.outcome for c in canary])
        else:  # a thin objective of a slice counts for nothing (LaneVerdict)
            counted = [c.outcome for c in canary if not c.thin]
            outcome = combine(counted) if counted else Outcome.INCONCLUSIVE
        return LaneVerdict(lane=lane, outcome=outcome, canary=canary, stable=stable, tenant=tenant)

    def judged_slices(lane: str) -> list[str]:
        """The lane's tenant slices with enough canary requests to judge some objective."""
        return [
            t
            for t in spec.tenant_slices
            if (checks := by_lane.get(lane_key(lane, t))) is not None and not all(c.thin for c in checks["canary"])
        ]

    result = []
    for lane in spec.lanes:
        total = lane_verdict(lane.name, None, spec.rollout.confidence)
        if total is None:
            continue
        per_slice = slice_confidence(spec.rollout.confidence, len(judged_slices(lane.name)))
        parts = tuple(v for t in spec.tenant_slices if (v := lane_verdict(lane.name, t, per_slice)) is not None)
        judged = [v.outcome for v in parts if not v.thin]
        result.append(
            dataclasses.replace(
                total, slices=parts, outcome=combine([total.outcome, *judged]) if judged else total.outcome
            )
        )
    return tuple(result)


@dataclass(frozen=True)
class CounterQueries:
    """The raw cumulative counters of one metric of one (track, lane): the requests and the
    bad events (buckets by ``le``, or the error count). Read at the boundaries of the
    sub-windows, their differences are each sub-window's counts."""

    track: Track
    lane: str
    metric: MetricName
    requests: str
    bad: str
    tenant: str | None = None

    @property
    def key(self) -> SliceKey:
        return (self.track, lane_key(self.lane, self.tenant), self.metric)


def counter_queries(lane_queries: Sequence[LaneQueries], *, policy: str, namespace: str) -> list[CounterQueries]:
    out = []
    for lq in lane_queries:
        labels: dict[str, Any] = {
            "namespace": namespace,
            "policy": policy,
            "track": lq.track,
            "revision": lq.revision,
            "lane": lq.lane,
            "tenant": lq.tenant,
            "environment": lq.environment,
        }
        sel = selector(**labels)
        for metric, hist in _HISTOGRAM.items():
            out.append(
                CounterQueries(
                    lq.track,
                    lq.lane,
                    metric,
                    f"sum({hist}_count{sel})",
                    f"sum by (le) ({hist}_bucket{sel})",
                    lq.tenant,
                )
            )
        errors = selector(**labels, extra=f'outcome=~"{"|".join(ERROR_OUTCOMES)}"')
        served = selector(**labels, extra='outcome!="invalid"')
        out.append(
            CounterQueries(
                lq.track,
                lq.lane,
                "errorRate",
                f"sum({REQUESTS_METRIC}{served})",
                f"sum({REQUESTS_METRIC}{errors}) or vector(0)",
                lq.tenant,
            )
        )
        rejected = selector(**labels, extra='outcome="invalid"')
        out.append(
            CounterQueries(
                lq.track,
                lq.lane,
                "clientErrors",
                f"sum({REQUESTS_METRIC}{sel})",
                f"sum({REQUESTS_METRIC}{rejected}) or vector(0)",
                lq.tenant,
            )
        )
    return out


SLICE_COVERAGE = 0.8
"""Sub-windows whose requests add up to less than this share of the window's are not used."""


def _counter_bad(cq: CounterQueries, m: Measurement) -> float | dict[float, float] | None:
    if cq.metric in _COUNTED:
        return _finite(m.value) if m.value is not None else 0.0
    if not m.buckets:
        return None
    return dict(m.buckets)


def slice_counts(
    spec: PolicySpec,
    counters: Sequence[CounterQueries],
    at_boundaries: Sequence[Mapping[str, Measurement]],
    totals: Mapping[SliceKey, float] | None = None,
) -> dict[SliceKey, Slices]:
    """(bad events, requests) per sub-window by (track, lane, metric): the differences of the
    raw counters read at the ``len(at_boundaries)`` sub-window boundaries, oldest first.

    Left out (the tests fall back to the window's counts, and the tally is not extended): a
    key with a query error or no series at a boundary (no traffic yet), one whose counters
    went down (a pod restarted or went away inside the window), one with fewer than 3
    sub-windows holding requests (a window of few scrapes has no spread to measure), and,
    given the window's request ``totals``, one whose sub-windows hold less than
    :data:`SLICE_COVERAGE` of them."""
    out: dict[SliceKey, Slices] = {}
    for cq in counters:
        key: SliceKey = cq.key
        threshold = lane_thresholds(spec, cq.lane)[cq.metric]
        reads: list[tuple[float, float | dict[float, float]] | None] = []
        for ms in at_boundaries:
            req, bad = ms.get(cq.requests), ms.get(cq.bad)
            if req is None or bad is None or req.error or bad.error:
                break
            b = _counter_bad(cq, bad)
            # No series yet: the track's pods had not been scraped (a canary that just
            # started); its counters start at zero.
            reads.append(None if _finite(req.value) is None or b is None else (req.value or 0.0, b))
        if len(reads) == len(at_boundaries) and reads and reads[-1] is not None:
            last = reads[-1][1]
            zero: float | dict[float, float] = dict.fromkeys(last, 0.0) if isinstance(last, dict) else 0.0
            first = next(i for i, r in enumerate(reads) if r is not None)
            if all(r is not None for r in reads[first:]):
                start: list[tuple[float, float | dict[float, float]] | None] = [(0.0, zero)]
                reads = start * first + reads[first:]
        if len(reads) != len(at_boundaries) or len(reads) < 2:
            continue
        counts: list[tuple[float, float]] = []
        for r0, r1 in itertools.pairwise(reads):
            if r0 is None or r1 is None:
                break
            (n0, b0), (n1, b1) = r0, r1
            n = n1 - n0
            if isinstance(b0, dict) and isinstance(b1, dict):
                if b0.keys() != b1.keys():
                    break
                diff = tuple((le, b1[le] - b0[le]) for le in sorted(b1))
                if any(c < 0 for _, c in diff):
                    break
                k = count_above(diff, threshold) if diff and n > 0 else 0.0
            elif not isinstance(b0, dict) and not isinstance(b1, dict):
                k = b1 - b0
            else:
                break
            if n < 0 or k < 0:
                break
            counts.append((min(k, n), n))
        else:
            busy = sum(1 for _, n in counts if n > 0)
            total = (totals or {}).get(key, 0.0)
            if busy >= 3 and sum(n for _, n in counts) >= SLICE_COVERAGE * total:
                out[key] = tuple(counts)
    return out


def run_analysis(
    backend: MetricsBackend,
    spec: PolicySpec,
    *,
    policy: str,
    namespace: str,
    canary_revision: str,
    stable_revision: str | None,
    now: datetime,
    history: Mapping[str, Sequence[Sequence[float]]] | None = None,
    environment: str | None = None,
) -> AnalysisResult:
    """Query the backend for every lane of both tracks, over the window and each of its
    sub-windows, and judge the canary on its tally (``history`` extended by this window)."""
    lane_queries = plan_queries(
        spec,
        policy=policy,
        namespace=namespace,
        canary_revision=canary_revision,
        stable_revision=stable_revision,
        environment=environment,
    )
    at = now.timestamp()
    measurements = backend.measure([q for lq in lane_queries for q in lq.all()], at=at)
    counters = counter_queries(lane_queries, policy=policy, namespace=namespace)
    raw = [q for cq in counters for q in (cq.requests, cq.bad)]
    step = spec.rollout.analysis_interval / SLICES
    boundaries = [backend.measure(raw, at=at - j * step) for j in reversed(range(SLICES + 1))]
    totals: dict[SliceKey, float] = {
        (lq.track, lq.key, mq.metric): measurements[mq.samples].value or 0.0
        for lq in lane_queries
        for mq in lq.metrics
        if mq.samples in measurements and measurements[mq.samples].error is None
    }
    counts = slice_counts(spec, counters, boundaries, totals)
    return AnalysisResult(
        time=now,
        window=promql_window(spec.rollout.analysis_interval),
        canary_revision=canary_revision,
        stable_revision=stable_revision,
        lanes=verdicts(spec, lane_queries, measurements, counts, history),
        tally=next_tally(counts, history or {}),
    )
