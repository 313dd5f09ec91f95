"""Canary analysis: PromQL builders and the verdict logic. Pure (the backend is injected).

The package's rooms, bottom up: :mod:`.objectives` (one record per objective: what it counts,
its threshold and budget, how it is judged and read; a new gate is one new record),
:mod:`.backend` (what a metrics store answers), :mod:`.queries` (the PromQL), :mod:`.tally`
(sub-window counts and the canary's tally), :mod:`.checks` (one objective's check and the
canary's verdict on it) and :mod:`.verdicts` (lanes, tenant slices, one whole analysis).

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
  reason in the evidence. A breach the stable shares, or one beside a stable at its budget
  (not clearly under it), without the canary being clearly worse passes the lane's step like
  a Successful analysis (a burst or a system at its SLO, not the canary); any other
  breach extends the step and takes back the lane's earlier pass of it
  (:attr:`LaneVerdict.passes_step` / :attr:`LaneVerdict.holds_step`). After
  ``maxInconclusive`` in a row the rollout holds as Stalled; it never rolls back for this.

Each confidence is the lesser of two tests that must agree: an exact test on the tallied
counts (Fisher's one-sided test against the stable; binomial against the budget) and a
cluster-robust t test across the sub-windows (paired by sub-window against the stable). The
exact test is right for few events but takes every request as independent; bad events come
in runs (a queue that builds on one pod delays every request behind it), and the sub-window
test counts one burst as one piece of evidence however many requests it delayed.

Why this rule (measured in bench/canary_eval.py; docs/canary-analysis.md "How the canary verdict decides"):
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

from batchpilot_operator.analysis.backend import (
    Measurement,
    MetricsBackend,
)
from batchpilot_operator.analysis.checks import (
    NO_STABLE_4XX,
    SHARED_BREACH_RATIO,
    MetricCheck,
    check_metric,
    judge,
    judge_client_errors,
    sequential_needed,
    slice_confidence,
)
from batchpilot_operator.analysis.objectives import (
    ERROR_OUTCOMES,
    METRICS,
    OBJECTIVES,
    P99_BUDGET,
    QUANTILE,
    REQUESTS_METRIC,
    MetricName,
    Objective,
    Outcome,
    Track,
    combine,
    format_confidence,
    format_share,
    format_value,
    judged_metrics,
    lane_budgets,
    lane_thresholds,
    objective,
)
from batchpilot_operator.analysis.queries import (
    CounterQueries,
    LaneQueries,
    MetricQueries,
    SliceKey,
    build_queries,
    counter_queries,
    lane_key,
    plan_queries,
    promql_window,
    selector,
)
from batchpilot_operator.analysis.tally import (
    SLICES,
    TALLY_ANALYSES,
    TALLY_SLICES,
    next_tally,
    pooled,
    sequential_key,
    slice_counts,
    step_evidence,
)
from batchpilot_operator.analysis.verdicts import (
    NO_STABLE_P99,
    STABLE_TOO_THIN,
    AnalysisResult,
    LaneVerdict,
    relative_thresholds,
    run_analysis,
    verdicts,
)

__all__ = [
    "ERROR_OUTCOMES",
    "METRICS",
    "NO_STABLE_4XX",
    "NO_STABLE_P99",
    "OBJECTIVES",
    "P99_BUDGET",
    "QUANTILE",
    "REQUESTS_METRIC",
    "SHARED_BREACH_RATIO",
    "SLICES",
    "STABLE_TOO_THIN",
    "TALLY_ANALYSES",
    "TALLY_SLICES",
    "AnalysisResult",
    "CounterQueries",
    "LaneQueries",
    "LaneVerdict",
    "Measurement",
    "MetricCheck",
    "MetricName",
    "MetricQueries",
    "MetricsBackend",
    "Objective",
    "Outcome",
    "SliceKey",
    "Track",
    "build_queries",
    "check_metric",
    "combine",
    "counter_queries",
    "format_confidence",
    "format_share",
    "format_value",
    "judge",
    "judge_client_errors",
    "judged_metrics",
    "lane_budgets",
    "lane_key",
    "lane_thresholds",
    "next_tally",
    "objective",
    "plan_queries",
    "pooled",
    "promql_window",
    "relative_thresholds",
    "run_analysis",
    "selector",
    "sequential_key",
    "sequential_needed",
    "slice_confidence",
    "slice_counts",
    "step_evidence",
    "verdicts",
]
