"""The pods' own traffic and timings, parsed and merged: the input of a recommendation
(:mod:`batchpilot_operator.tune.live`) and of the latency model's checks (``modelwatch``).

Pure (no Kubernetes client, no HTTP, no torch).

Inputs, one pair per ready pod:

* ``GET /admin/arrivals`` (``kind: ArrivalCapture``): per lane, the recent arrivals (Unix time,
  rows) of admitted requests, the ring's coverage, the lane's settings, the revision;
* ``GET /admin/profile`` (``kind: LatencyProfile``): forward time per batch size measured
  in the pod (warm-up and live batches).

Merging:

* arrivals of one lane from every pod are concatenated on wall time (pods' clocks are as good
  as their NTP, a few ms at worst: well under a batching window's effect on a p99 over an hour)
  and cut to the window every pod covers at the end: from the earliest window start (a ring
  that lost arrivals to its count bound moves the start to its oldest held arrival) to the
  earliest snapshot. A request of ``r`` rows counts as ``r`` one-row arrivals at the same instant
  (the simulator batches rows; a multi-row request is never split in the runtime, so this is
  slightly optimistic for lanes with large requests; the report says the mean rows/request);
* profiles: per batch size, the pods' statistics pooled (weighted by their samples) over the
  pods that timed that size on live batches; warm-up passes (timed with idle gaps while the
  pod started, often beside other starting pods: slower than a busy pod's back-to-back passes)
  count only where no pod has live ones. The median ``dispatchDelay`` (each pod's median batch
  cut delay, which the simulator adds to every dispatch) and the median ``requestOverhead``
  (each pod's mean time of a served request outside the queue and the model). The runtime's
  profiles read the ``mean`` column: a busy period lasts the sum of its passes, so the queue
  grows with their mean.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from batchpilot_operator.tune.profile import LatencyProfile, ProfilePoint
from batchpilot_operator.tune.trace import Trace

ARRIVALS_KIND = "ArrivalCapture"


class CaptureError(ValueError):
    """A runtime document is malformed or does not fit the policy (the message names the pod)."""


# --------------------------------------------------------------------------- parsing


@dataclass(frozen=True)
class LaneCapture:
    name: str
    settings: dict[str, Any]
    times: tuple[float, ...]  # Unix seconds, sorted
    rows: tuple[int, ...]
    covered_from: float
    cut_delay: dict[str, Any]
    # (arrival Unix seconds, latency s, queue wait s) of answered requests; latency inf: not
    # served. None: the runtime sent no outcomes (older than the calibration).
    outcomes: tuple[tuple[float, float, float], ...] | None = None


@dataclass(frozen=True)
class PodCapture:
    pod: str
    revision: str
    track: str
    captured_at: float
    window_start: float
    lanes: dict[str, LaneCapture]


def parse_capture(doc: Mapping[str, Any], pod: str | None = None) -> PodCapture:
    """Validate and parse one ``/admin/arrivals`` document."""
    who = pod or str(doc.get("pod") or "?")
    if doc.get("kind") != ARRIVALS_KIND:
        raise CaptureError(f"pod {who}: expected kind {ARRIVALS_KIND}, got {doc.get('kind')!r}")
    if not doc.get("enabled", True):
        raise CaptureError(f"pod {who}: arrival capture is off (BATCHPILOT_ARRIVAL_CAPACITY=0)")
    try:
        lanes: dict[str, LaneCapture] = {}
        for entry in doc["lanes"]:
            base = float(entry["base"])
            offsets = [float(x) for x in entry["times"]]
            rows = [int(x) for x in entry["rows"]]
            if len(offsets) != len(rows):
                raise CaptureError(f"pod {who}: lane {entry['name']}: {len(offsets)} times but {len(rows)} rows")
            if any(r < 1 for r in rows):
                raise CaptureError(f"pod {who}: lane {entry['name']}: row counts must be at least 1")
            lanes[str(entry["name"])] = LaneCapture(
                name=str(entry["name"]),
                settings=dict(entry.get("settings") or {}),
                times=tuple(base + x for x in offsets),
                rows=tuple(rows),
                covered_from=float(entry.get("coveredFrom", doc["windowStart"])),
                cut_delay=dict(entry.get("batchCutDelay") or {}),
                outcomes=_parse_outcomes(entry.get("outcomes"), base, who, str(entry["name"])),
            )
        return PodCapture(
            pod=who,
            revision=str(doc["revision"]),
            track=str(doc.get("track", "")),
            captured_at=float(doc["capturedAt"]),
            window_start=float(doc["windowStart"]),
            lanes=lanes,
        )
    except (KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, CaptureError):
            raise
        raise CaptureError(f"pod {who}: malformed arrival capture: {type(exc).__name__}: {exc}") from exc


def _parse_outcomes(raw: Any, base: float, pod: str, lane: str) -> tuple[tuple[float, float, float], ...] | None:
    if raw is None:
        return None
    times, lats, waits = raw["times"], raw["latency"], raw["queueWait"]
    if not len(times) == len(lats) == len(waits):
        raise CaptureError(f"pod {pod}: lane {lane}: outcomes of unequal lengths")
    return tuple(
        (base + float(t), math.inf if float(lat) < 0 else float(lat), float(w))
        for t, lat, w in zip(times, lats, waits, strict=True)
    )


# --------------------------------------------------------------------------- merging


@dataclass
class MergedTraffic:
    """One lane's arrivals over every pod, cut to the window all of them cover."""

    lane: str
    pods: list[str]
    revisions: list[str]
    start: float
    end: float
    times: list[float]  # Unix seconds, sorted (one per request)
    rows: list[int]
    cut_delay_p50: float | None = None
    # The answered requests' outcomes in the window, in arrival order (None: a pod sent none).
    outcomes: list[tuple[float, float, float]] | None = None
    settings_ran: list[dict[str, Any]] = field(default_factory=list)  # distinct, as the pods reported

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def requests(self) -> int:
        return len(self.times)

    @property
    def total_rows(self) -> int:
        return sum(self.rows)

    @property
    def rate(self) -> float:
        """Requests per second over the window."""
        return self.requests / self.duration if self.duration > 0 else 0.0

    @property
    def row_rate(self) -> float:
        return self.total_rows / self.duration if self.duration > 0 else 0.0

    @property
    def mean_rows(self) -> float:
        return self.total_rows / self.requests if self.requests else 0.0

    def trace(self) -> Trace:
        """One arrival per row (a request of r rows is r arrivals at its instant)."""
        expanded = [t for t, r in zip(self.times, self.rows, strict=True) for _ in range(r)]
        return Trace.from_times(expanded, source=f"live:{self.lane}:{','.join(self.pods)}")

    def gap_cv(self) -> float:
        if self.requests < 3:
            return math.nan
        gaps = [b - a for a, b in zip(self.times, self.times[1:], strict=False)]
        mean = sum(gaps) / len(gaps)
        if mean <= 0:
            return math.inf
        var = sum((g - mean) ** 2 for g in gaps) / len(gaps)
        return math.sqrt(var) / mean

    def peak_row_rate(self, bin_s: float = 1.0) -> float:
        """The busiest ``bin_s`` window's row rate (rows per second; 0 with no arrivals): the
        burst the mean rate averages away."""
        bins: dict[int, int] = {}
        for t, r in zip(self.times, self.rows, strict=True):
            k = int((t - self.start) // bin_s)
            bins[k] = bins.get(k, 0) + r
        return max(bins.values(), default=0) / bin_s

    def peak_to_mean(self, bin_s: float = 1.0) -> float:
        """The busiest ``bin_s`` window's row rate over the mean row rate (1 for perfectly even)."""
        if self.duration <= 0 or not self.times:
            return math.nan
        return self.peak_row_rate(bin_s) / self.row_rate

    def summary(self) -> dict[str, Any]:
        return {
            "pods": self.pods,
            "revisions": self.revisions,
            "windowSeconds": round(self.duration, 3),
            "requests": self.requests,
            "rows": self.total_rows,
            "rate": round4(self.rate),
            "rowRate": round4(self.row_rate),
            "meanRowsPerRequest": round4(self.mean_rows),
            "gapCV": round4(self.gap_cv()),
            "peakToMean1s": round4(self.peak_to_mean()),
            "batchCutDelayP50": self.cut_delay_p50,
        }


def merge_traffic(captures: Sequence[PodCapture], lane: str) -> MergedTraffic:
    """Merge one lane's arrivals over pods (see the module docstring for the window)."""
    if not captures:
        raise CaptureError("no pod captures to merge")
    missing = [c.pod for c in captures if lane not in c.lanes]
    if missing:
        raise CaptureError(f"lane {lane!r} is not served by pod(s) {missing}")
    start = min(c.window_start for c in captures)
    # A pod that started late lost nothing (the others served that traffic); a ring that wrapped did.
    lost = [c.lanes[lane].covered_from for c in captures if c.lanes[lane].covered_from > c.window_start]
    start = max([start, *lost])
    end = min(c.captured_at for c in captures)
    pairs: list[tuple[float, int]] = []
    for c in captures:
        lc = c.lanes[lane]
        pairs += [(t, r) for t, r in zip(lc.times, lc.rows, strict=True) if start <= t <= end]
    pairs.sort()
    outcomes: list[tuple[float, float, float]] | None = []
    for c in captures:
        got = c.lanes[lane].outcomes
        if got is None or outcomes is None:
            outcomes = None
            continue
        outcomes += [o for o in got if start <= o[0] <= end]
    if outcomes is not None:
        outcomes.sort()
    ran: list[dict[str, Any]] = []
    for c in captures:
        if c.lanes[lane].settings and c.lanes[lane].settings not in ran:
            ran.append(c.lanes[lane].settings)
    delays = sorted(float(c.lanes[lane].cut_delay["p50"]) for c in captures if c.lanes[lane].cut_delay.get("samples"))
    return MergedTraffic(
        lane=lane,
        pods=sorted(c.pod for c in captures),
        revisions=sorted({c.revision for c in captures}),
        start=start,
        end=end,
        times=[t for t, _ in pairs],
        rows=[r for _, r in pairs],
        cut_delay_p50=delays[len(delays) // 2] if delays else None,
        outcomes=outcomes,
        settings_ran=ran,
    )


def merge_profiles(docs: Sequence[Mapping[str, Any]]) -> LatencyProfile:
    """The pods' profiles pooled per batch size (see the module docstring); the first pod's model."""
    if not docs:
        raise CaptureError("no profiles to merge")
    profiles = [LatencyProfile.model_validate(dict(d)) for d in docs]
    by_size: dict[int, list[ProfilePoint]] = {}
    for prof in profiles:
        for point in prof.points:
            by_size.setdefault(point.batch_size, []).append(point)
    points = [_pooled_point(size, by_size[size]) for size in sorted(by_size)]
    first = profiles[0]
    return first.model_copy(
        update={
            "points": points,
            "dispatch_delay": statistics.median(p.dispatch_delay for p in profiles),
            "request_overhead": statistics.median(p.request_overhead for p in profiles),
            "front_end_cost": statistics.median(p.front_end_cost for p in profiles),
            "warmup_scale": statistics.median(scales)
            if (scales := [p.warmup_scale for p in profiles if p.warmup_scale])
            else None,
            "note": f"merged from {len(profiles)} pod(s): per batch size the live samples of every pod, "
            "pooled (warm-up passes only where no pod has live ones)",
        }
    )


def _pooled_point(size: int, pts: Sequence[ProfilePoint]) -> ProfilePoint:
    """One batch size over pods: the sample-weighted average of each statistic over the pods' live
    points (a pod that just started has only warm-up passes, timed while its neighbours started
    too: they stand in only where no pod has served that size live)."""
    live = [p for p in pts if p.source == "live"]
    chosen = live or list(pts)
    weights = [float(p.samples or 1) for p in chosen]

    def pooled(values: Sequence[float]) -> float:
        return sum(w * v for w, v in zip(weights, values, strict=True)) / sum(weights)

    p50 = pooled([p.p50 for p in chosen])
    p99 = max(pooled([p.p99 for p in chosen]), p50)
    p90 = min(max(pooled([p.value("p90") for p in chosen]), p50), p99)
    samples = [p.samples for p in chosen if p.samples is not None]
    return ProfilePoint(
        batch_size=size,
        p50=p50,
        p90=p90,
        p99=p99,
        mean=pooled([p.value("mean") for p in chosen]),
        samples=sum(samples) if samples else None,
        source="live" if live else None,
    )


def round4(x: float) -> float | None:
    """Four significant digits for a report (JSON has no Inf/NaN: those are absent)."""
    if not math.isfinite(x):
        return None
    return float(f"{x:.4g}")
