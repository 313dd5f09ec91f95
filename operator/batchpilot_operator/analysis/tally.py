"""The canary's tally: bad events and requests per sub-window of each analysis window
(:data:`SLICES` of them, from the raw counters read at their boundaries: :func:`slice_counts`),
pooled with the sub-windows of its last :data:`TALLY_ANALYSES` analyses (kept in
``status.rollout.evidence``). The tests of :mod:`.checks` run on it."""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from batchpilot_operator.analysis.backend import Measurement, finite
from batchpilot_operator.analysis.objectives import lane_thresholds, objective
from batchpilot_operator.analysis.queries import CounterQueries, SliceKey
from batchpilot_operator.spec import PolicySpec
from batchpilot_operator.stats import Slices, count_above

SLICES = 5
"""Sub-windows of an analysis window: the clusters of the burst-robust tests (see judge)."""
TALLY_ANALYSES = 4
TALLY_SLICES = TALLY_ANALYSES * SLICES
"""Sub-windows of the canary's tally: the evidence of its last 4 analyses (see judge). Long
enough for a steady small breach to add up, short enough that one burst leaves it soon."""


def tally_key(key: SliceKey) -> str:
    track, lane, metric = key
    return f"{lane}/{metric}/{track}"


SEQUENTIAL = "sequential"


def sequential_key(lane: str, metric: str) -> str:
    """Where the rollout's sequential evidence of one objective of a lane (or tenant slice: a
    :func:`queries.lane_key`) is kept beside the tally: ``[[over budget...], [worse...]]``, the
    log likelihood ratios per alternative (``checks.MetricCheck.sequential``)."""
    return f"{lane}/{metric}/{SEQUENTIAL}"


def step_evidence(evidence: Mapping[str, list[list[float]]], *, keep_tally: bool) -> dict[str, list[list[float]]]:
    """What a new step starts from: no sequential evidence (it starts afresh at each step,
    ``checks.sequential_needed``), and the tally only when the new step feeds the canary alike."""
    if not keep_tally:
        return {}
    return {key: v for key, v in evidence.items() if not key.endswith(f"/{SEQUENTIAL}")}


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
    kept = {key: [[float(x) for x in part] for part in v] for key, v in history.items()}
    kept.update({tally_key(key): [[b, n] for b, n in v] for key, v in pooled(slices, history).items()})
    return kept


COMPARED = "compared"


def compared_key(lane: str) -> str:
    """Where a lane's windows that compared the canary's p99 with the stable's
    (``maxP99Increase``) are kept beside the tally (:func:`compared_evidence`)."""
    return f"{lane}/p99Increase/{COMPARED}"


@dataclass(frozen=True)
class ComparedWindow:
    """One analysis window in which the relative objective compared the canary with the stable:
    when, its threshold (``1 + maxP99Increase`` times the stable's p99 of that window), the
    canary's requests, and the stable's cumulative latency histogram (what ``power`` states the
    gate can see from)."""

    at: float
    threshold: float
    canary_requests: float
    buckets: tuple[tuple[float, float], ...]

    @property
    def stable_requests(self) -> float:
        return max((b[1] for b in self.buckets), default=0.0)


def compared_evidence(
    windows: Mapping[str, ComparedWindow], history: Mapping[str, Sequence[Sequence[float]]]
) -> dict[str, list[list[float]]]:
    """The compared windows to keep after this analysis, by :func:`compared_key`: each lane's
    earlier ones and this window's (``windows``, by lane key), the last :data:`TALLY_ANALYSES`
    (the tally's span). Stored as rows (JSON has no infinity): the finite bucket bounds first,
    then per window ``[at, threshold, canary requests, stable total, counts...]``; a window of
    other bounds starts the list afresh."""
    out: dict[str, list[list[float]]] = {}
    for lane, w in windows.items():
        les = [le for le, _ in sorted(w.buckets) if math.isfinite(le)]
        counts = [c for le, c in sorted(w.buckets) if math.isfinite(le)]
        rows = [list(r) for r in history.get(compared_key(lane), [])]
        kept = rows[1:] if rows and rows[0] == les else []
        kept.append([w.at, w.threshold, w.canary_requests, w.stable_requests, *counts])
        out[compared_key(lane)] = [les, *kept[-TALLY_ANALYSES:]]
    return out


def compared_windows(evidence: Mapping[str, Sequence[Sequence[float]]], lane: str) -> list[ComparedWindow]:
    """A lane's compared windows kept in the evidence (:func:`compared_evidence`), oldest first."""
    rows = evidence.get(compared_key(lane), [])
    if not rows:
        return []
    les = list(rows[0])
    out = []
    for row in rows[1:]:
        at, threshold, canary, total, *counts = row
        if len(counts) != len(les):
            continue
        buckets = (*zip(les, counts, strict=True), (math.inf, total))
        out.append(ComparedWindow(at, threshold, canary, tuple((float(a), float(b)) for a, b in buckets)))
    return out


SLICE_COVERAGE = 0.8
"""Sub-windows whose requests add up to less than this share of the window's are not used."""


def _counter_bad(cq: CounterQueries, m: Measurement) -> float | dict[float, float] | None:
    if objective(cq.metric).counted:
        return finite(m.value) if m.value is not None else 0.0
    if not m.buckets:
        return None
    return dict(m.buckets)


def slice_counts(
    spec: PolicySpec,
    counters: Sequence[CounterQueries],
    at_boundaries: Sequence[Mapping[str, Measurement]],
    totals: Mapping[SliceKey, float] | None = None,
    relative: Mapping[str, float] | None = None,
) -> dict[SliceKey, Slices]:
    """(bad events, requests) per sub-window by (track, lane, metric): the differences of the
    raw counters read at the ``len(at_boundaries)`` sub-window boundaries, oldest first.

    Left out (the tests fall back to the window's counts, and the tally is not extended): a
    key with a query error or no series at a boundary (no traffic yet), one whose counters
    went down (a pod restarted or went away inside the window), one with fewer than 3
    sub-windows holding requests (a window of few scrapes has no spread to measure), and,
    given the window's request ``totals``, one whose sub-windows hold less than
    :data:`SLICE_COVERAGE` of them. A relative objective's threshold is the window's, by lane
    key, in ``relative`` (:func:`.verdicts.relative_thresholds`); a key without one is left out."""
    out: dict[SliceKey, Slices] = {}
    for cq in counters:
        key: SliceKey = cq.key
        if objective(cq.metric).relative:
            if (window_threshold := (relative or {}).get(key[1])) is None:
                continue
            threshold = window_threshold
        else:
            threshold = lane_thresholds(spec, cq.lane)[cq.metric]
        reads: list[tuple[float, float | dict[float, float]] | None] = []
        for ms in at_boundaries:
            req, bad = ms.get(cq.requests), ms.get(cq.bad)
            if req is None or bad is None or req.error or bad.error:
                break
            b = _counter_bad(cq, bad)
            # No series yet: the track's pods had not been scraped (a canary that just
            # started); its counters start at zero.
            reads.append(None if finite(req.value) is None or b is None else (req.value or 0.0, b))
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
