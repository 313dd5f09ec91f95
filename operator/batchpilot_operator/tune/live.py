"""Recommendations from the pods' own traffic: merge what the runtimes captured, run the tuner.

Pure (no Kubernetes client, no HTTP, no torch): the callers (``kubectl batchpilot recommend``
and the operator's recommender) fetch the runtime documents through the apiserver's pod proxy
and hand them here.

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

The recommendation runs :func:`batchpilot_operator.tune.search.search` for the lane's SLO with
the observed trace (time-scaled to the planned rate: observed x growth, or a given rate), and
the same simulator for the current setting: its capacity (the search over exactly that one
setting) and its predictions at the observed rate and at the planned one.

Calibration (:mod:`batchpilot_operator.tune.calibration`): when the pods also sent the outcomes
of the window's requests, the window's arrivals are replayed through the model with the setting
the pods ran, and its p99 compared with theirs. The lane's correction (observed / model, the
median of its recent checks) then scales every p99 this recommendation states, and the search
looks for settings under the SLO divided by it. Each lane reports the model's last measured
error next to its predictions.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from batchpilot_operator.spec import PolicySpec
from batchpilot_operator.tune.calibration import (
    MIN_REQUESTS,
    LaneCalibration,
    Observed,
    RevisionCheck,
    Window,
    check_lane,
)
from batchpilot_operator.tune.profile import LatencyProfile, ProfilePoint
from batchpilot_operator.tune.search import SLOTargets, search
from batchpilot_operator.tune.simulator import LaneSettings, simulate
from batchpilot_operator.tune.trace import Trace
from batchpilot_runtime.config import format_duration, parse_duration

ARRIVALS_KIND = "ArrivalCapture"
KEEP_TOLERANCE = 0.03
"""A recommendation within this fraction of the current setting's capacity keeps the current setting."""
MORE_CAPACITY_FACTOR = 1.25
"""The recommended setting is 'clearly better' when its capacity is at least this times the current one."""

# Reasons a setting is stale (the condition's reason is the first that applies).
BREACH_NOW = "BreachAtCurrentTraffic"
BREACH_GROWTH = "BreachAtPlannedGrowth"
MORE_CAPACITY = "MoreCapacityAvailable"


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

    def peak_to_mean(self, bin_s: float = 1.0) -> float:
        """The busiest ``bin_s`` window's row rate over the mean row rate (1 for perfectly even)."""
        if self.duration <= 0 or not self.times:
            return math.nan
        bins: dict[int, int] = {}
        for t, r in zip(self.times, self.rows, strict=True):
            k = int((t - self.start) // bin_s)
            bins[k] = bins.get(k, 0) + r
        return (max(bins.values()) / bin_s) / self.row_rate

    def summary(self) -> dict[str, Any]:
        return {
            "pods": self.pods,
            "revisions": self.revisions,
            "windowSeconds": round(self.duration, 3),
            "requests": self.requests,
            "rows": self.total_rows,
            "rate": _round(self.rate),
            "rowRate": _round(self.row_rate),
            "meanRowsPerRequest": _round(self.mean_rows),
            "gapCV": _round(self.gap_cv()),
            "peakToMean1s": _round(self.peak_to_mean()),
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


# --------------------------------------------------------------------------- recommending


@dataclass
class Prediction:
    rate: float
    p99_latency: float
    p99_queue_age: float
    mean_batch: float
    utilization: float
    dropped: int
    timeouts: int
    meets_targets: bool

    def to_dict(self) -> dict[str, Any]:
        return {
            "rate": _round(self.rate),
            "p99Latency": _dur(self.p99_latency),
            "p99QueueAge": _dur(self.p99_queue_age),
            "meanBatch": _round(self.mean_batch),
            "utilization": _round(self.utilization),
            "dropped": self.dropped,
            "timeouts": self.timeouts,
            "meetsTargets": self.meets_targets,
        }


@dataclass
class SettingReport:
    settings: LaneSettings
    capacity: float  # requests (rows)/s, all replicas, at the SLO less margin
    at_observed: Prediction
    at_planned: Prediction

    def to_dict(self) -> dict[str, Any]:
        return {
            "maxBatchSize": self.settings.max_batch_size,
            "maxQueueDelay": format_duration(self.settings.max_queue_delay),
            "capacity": _round(self.capacity),
            "atObserved": self.at_observed.to_dict(),
            "atPlanned": self.at_planned.to_dict(),
        }


@dataclass
class LaneRecommendation:
    lane: str
    traffic: dict[str, Any]
    slo: SLOTargets
    growth: float
    replicas: int
    observed_rate: float  # rows/s (the simulator's unit)
    planned_rate: float
    current: SettingReport
    recommended: SettingReport
    reasons: list[str]
    notes: list[str] = field(default_factory=list)
    model: LaneCalibration = field(default_factory=LaneCalibration)

    @property
    def stale(self) -> bool:
        return bool(self.reasons)

    @property
    def changed(self) -> bool:
        return self.current.settings != self.recommended.settings

    def to_dict(self) -> dict[str, Any]:
        return {
            "lane": self.lane,
            "stale": self.stale,
            "reasons": self.reasons,
            "traffic": self.traffic,
            "slo": {
                "p99Latency": _dur(self.slo.p99_latency),
                "maxQueueAge": _dur(self.slo.queue_age),
                "margin": self.slo.margin,
            },
            "growth": self.growth,
            "replicas": self.replicas,
            "observedRowRate": _round(self.observed_rate),
            "plannedRowRate": _round(self.planned_rate),
            "current": self.current.to_dict(),
            "recommended": self.recommended.to_dict(),
            "notes": self.notes,
            "model": self.model.to_dict(),
        }


def _predict(
    trace: Trace,
    profile: LatencyProfile,
    settings: LaneSettings,
    rate: float,
    replicas: int,
    slo: SLOTargets,
    correction: float = 1.0,
) -> Prediction:
    """The simulator's p99 at ``rate``, times the lane's ``correction`` (the calibration)."""
    table = profile.exec_table(max(settings.max_batch_size, 1))
    sim = simulate(
        trace.scaled_arrivals(rate),
        settings,
        table,
        replicas,
        "random",
        0,
        profile.request_overhead,
        dispatch_delay=profile.dispatch_delay,
        front_end_cost=profile.front_end_cost,
    )
    t = slo.targets()
    p99 = sim.latency_quantile(t.quantile) * correction
    age = sim.queue_age_quantile(t.quantile)
    return Prediction(
        rate=rate,
        p99_latency=p99,
        p99_queue_age=age,
        mean_batch=sim.mean_batch_size,
        utilization=sim.utilization,
        dropped=sim.dropped,
        timeouts=sim.timeouts,
        meets_targets=p99 <= t.latency and age <= t.queue_age,
    )


def _capacity(trace: Trace, profile: LatencyProfile, settings: LaneSettings, slo: SLOTargets, replicas: int) -> float:
    """The highest rate the setting sustains within the SLO less margin (0: not even near zero)."""
    try:
        result = search(
            trace,
            profile,
            slo,
            replicas=replicas,
            batch_sizes=[settings.max_batch_size],
            windows=[settings.max_queue_delay],
            max_queue_length=settings.max_queue_length,
            request_timeout=settings.request_timeout,
            verify=(),
        )
    except ValueError:
        return 0.0
    return result.capacity


def recommend_lane(
    traffic: MergedTraffic,
    profile: LatencyProfile,
    current: LaneSettings,
    slo: SLOTargets,
    *,
    replicas: int,
    growth: float = 2.0,
    rate: float | None = None,
    max_batch: int | None = None,
    model: LaneCalibration | None = None,
) -> LaneRecommendation:
    """Predictions for the current setting and the tuner's recommendation (see the module docstring).

    ``rate`` (requests/s, all replicas) replaces the observed rate as the traffic to plan for
    (growth is then not applied on top of it). ``model``: the lane's calibration, whose
    correction scales every p99 stated (the search runs under the SLO divided by it).
    """
    model = model or LaneCalibration()
    correction = model.correction
    # The model's p99 times the correction must meet the SLO: search under the SLO / correction.
    search_slo = SLOTargets(slo.p99_latency / correction, slo.queue_age, slo.margin)
    if growth < 1:
        raise ValueError(f"growth must be at least 1 (planning for less traffic than now is not a plan), got {growth}")
    if replicas < 1:
        raise ValueError("replicas must be at least 1")
    if traffic.requests < 2 or traffic.duration <= 0:
        raise CaptureError(
            f"lane {traffic.lane}: {traffic.requests} arrival(s) captured over {traffic.duration:.0f}s; "
            "not enough traffic to recommend from"
        )
    trace = traffic.trace()
    observed = traffic.row_rate
    planned = rate * traffic.mean_rows if rate is not None else observed * growth
    notes: list[str] = []
    if traffic.mean_rows > 1.05:
        notes.append(
            f"requests carry {traffic.mean_rows:.2g} rows on average; the simulation batches rows "
            "(a request is never split in the runtime, so predictions are slightly optimistic)"
        )
    if len(traffic.revisions) > 1:
        notes.append(f"traffic spans revisions {traffic.revisions} (a rollout in the window)")
    if correction != 1.0:
        notes.append(
            f"p99 predictions carry the lane's correction x{correction:.3g} (observed / model over its recent "
            "windows); capacities are under the SLO divided by it"
        )
    if model.within_tolerance is False:
        notes.append(model.summary())
    result = search(
        trace,
        profile,
        search_slo,
        replicas=replicas,
        target_rate=planned,
        max_queue_length=current.max_queue_length,
        request_timeout=current.request_timeout,
        max_batch=max_batch,
    )
    notes += result.notes
    rec_settings = LaneSettings(
        result.recommended.max_batch_size,
        result.recommended.max_queue_delay,
        current.max_queue_length,
        current.request_timeout,
    )
    cur_capacity = _capacity(trace, profile, current, search_slo, replicas)
    if result.capacity <= cur_capacity * (1 + KEEP_TOLERANCE):
        # No setting serves clearly more: keep the current one (no churn, no patch). With
        # maxBatchSize 1, say, every window is the same setting in effect.
        rec_settings = current
    cur = SettingReport(
        current,
        cur_capacity,
        _predict(trace, profile, current, observed, replicas, slo, correction),
        _predict(trace, profile, current, planned, replicas, slo, correction),
    )
    rec = SettingReport(
        rec_settings,
        cur_capacity if rec_settings == current else result.capacity,
        _predict(trace, profile, rec_settings, observed, replicas, slo, correction),
        _predict(trace, profile, rec_settings, planned, replicas, slo, correction),
    )
    if rec_settings != current and result.capacity < planned and _p99_key(rec) >= _p99_key(cur):
        # No setting serves the planned traffic: the highest capacity says nothing about that
        # traffic, and this one would serve it no better than the current one. Keep it (scale out).
        notes.append(
            f"maxBatchSize {rec_settings.max_batch_size} / maxQueueDelay {format_duration(rec_settings.max_queue_delay)} "
            f"has the highest capacity ({result.capacity:.4g} rows/s) but would serve the planned traffic no better "
            "than the current setting: kept the current one"
        )
        rec = cur
        rec_settings = current
    reasons: list[str] = []
    if not cur.at_observed.meets_targets or cur.capacity < observed:
        reasons.append(BREACH_NOW)
    elif not cur.at_planned.meets_targets or cur.capacity < planned:
        reasons.append(BREACH_GROWTH)
    if rec.capacity >= MORE_CAPACITY_FACTOR * cur.capacity and rec_settings != current:
        reasons.append(MORE_CAPACITY)
    if result.replicas_needed:
        notes.append(f"{result.replicas_needed} replicas would serve the planned rate within the SLO")
    return LaneRecommendation(
        lane=traffic.lane,
        traffic=traffic.summary(),
        slo=slo,
        growth=growth if rate is None else planned / observed if observed > 0 else math.inf,
        replicas=replicas,
        observed_rate=observed,
        planned_rate=planned,
        current=cur,
        recommended=rec,
        reasons=reasons,
        notes=notes,
        model=model,
    )


def calibrate(traffic: MergedTraffic, profile: LatencyProfile, prior: LaneCalibration) -> LaneCalibration:
    """``prior`` with this window's check added (or the reason there is none)."""
    return _calibrate(traffic, profile, prior, prior.correction)


def _calibrate(
    traffic: MergedTraffic,
    profile: LatencyProfile,
    prior: LaneCalibration,
    correction: float,
    min_requests: int = MIN_REQUESTS,
) -> LaneCalibration:
    if traffic.outcomes is None:
        return prior.skip("a pod sent no request outcomes (a runtime older than the calibration)")
    if len(traffic.settings_ran) != 1:
        return prior.skip(f"the pods ran {len(traffic.settings_ran)} settings in the window (a rollout in flight)")
    if traffic.requests < 2:
        return prior.skip(f"{traffic.requests} arrival(s) in the window")
    settings = lane_settings_from_spec(traffic.settings_ran[0])
    arrivals = traffic.trace().arrivals  # one per row, as every prediction here simulates them
    observed = Observed(tuple(o[1] for o in traffic.outcomes), tuple(o[2] for o in traffic.outcomes))
    window = Window(traffic.end, arrivals, observed, settings, replicas=len(traffic.pods))
    got = check_lane(window, profile, correction, min_requests)
    return prior.skip(got) if isinstance(got, str) else prior.add(got)


def check_revisions(
    arrival_docs: Sequence[Mapping[str, Any]],
    profile_docs: Sequence[Mapping[str, Any]],
    lanes: Sequence[str],
    revisions: Mapping[str, str],
    corrections: Mapping[str, float] | None = None,
    min_requests: int = MIN_REQUESTS,
) -> list[RevisionCheck]:
    """Per revision (``revision -> track``) and lane: the model's p99 at the arrivals that
    revision's pods got in the window, with the profile they measured and the lane's correction,
    against the p99 they recorded (windows with at least ``min_requests`` answered requests).
    ``arrival_docs[i]`` and ``profile_docs[i]`` are one pod's."""
    captures: list[tuple[PodCapture, Mapping[str, Any]]] = []
    unreadable: list[str] = []
    for doc, prof in zip(arrival_docs, profile_docs, strict=True):
        try:
            captures.append((parse_capture(doc), prof))
        except CaptureError as exc:
            unreadable.append(str(exc))
    out: list[RevisionCheck] = []
    for revision, track in revisions.items():
        mine = [(c, p) for c, p in captures if c.revision == revision]
        if not mine:
            why = f"no ready pod of revision {revision} answered" + (
                f" ({'; '.join(unreadable)})" if unreadable else ""
            )
            out += [RevisionCheck(revision, track, lane, skipped=why) for lane in lanes]
            continue
        try:
            profile = merge_profiles([p for _, p in mine])
        except (CaptureError, ValueError) as exc:
            out += [RevisionCheck(revision, track, lane, skipped=f"profile: {exc}") for lane in lanes]
            continue
        for lane in lanes:
            prior = LaneCalibration()
            correction = (corrections or {}).get(lane, 1.0)
            try:
                traffic = merge_traffic([c for c, _ in mine], lane)
            except CaptureError as exc:
                out.append(RevisionCheck(revision, track, lane, skipped=str(exc)))
                continue
            got = _calibrate(traffic, profile, prior, correction, min_requests)
            last = got.last
            out.append(RevisionCheck(revision, track, lane, check=last, skipped=got.skipped if last is None else ""))
    return out


def _p99_key(report: SettingReport) -> tuple[float, float]:
    """Order settings by how they serve the planned traffic: p99 latency, then p99 queue age."""
    return (report.at_planned.p99_latency, report.at_planned.p99_queue_age)


def lane_settings_from_spec(lane: Mapping[str, Any]) -> LaneSettings:
    """The simulator's settings of a lane as the policy (or the runtime) spells it."""
    return LaneSettings(
        max_batch_size=int(lane["maxBatchSize"]),
        max_queue_delay=parse_duration(lane["maxQueueDelay"]),
        max_queue_length=int(lane.get("maxQueueLength", 1_000_000)),
        request_timeout=parse_duration(lane["requestTimeout"]) if "requestTimeout" in lane else math.inf,
    )


def json_patch(lanes: Sequence[Mapping[str, Any]], recs: Sequence[LaneRecommendation]) -> list[dict[str, Any]]:
    """RFC 6902 ops setting each changed lane's maxBatchSize and maxQueueDelay (guarded by a test
    of the lane's name), for ``kubectl patch --type json`` or a kustomize ``patches:`` entry."""
    ops: list[dict[str, Any]] = []
    for rec in recs:
        if not rec.changed:
            continue
        index = next((i for i, ln in enumerate(lanes) if ln.get("name") == rec.lane), None)
        if index is None:
            raise ValueError(f"lane {rec.lane!r} is not in the policy")
        s = rec.recommended.settings
        ops.append({"op": "test", "path": f"/spec/lanes/{index}/name", "value": rec.lane})
        ops.append({"op": "replace", "path": f"/spec/lanes/{index}/maxBatchSize", "value": s.max_batch_size})
        ops.append(
            {"op": "replace", "path": f"/spec/lanes/{index}/maxQueueDelay", "value": format_duration(s.max_queue_delay)}
        )
    return ops


def _round(x: float) -> float | None:
    if not math.isfinite(x):
        return None
    return float(f"{x:.4g}")


def _dur(x: float) -> str | None:
    return None if not math.isfinite(x) else format_duration(x)


# --------------------------------------------------------------------------- a whole policy


@dataclass
class PolicyRecommendation:
    lanes: list[LaneRecommendation]
    failed: dict[str, str]  # lane -> why no recommendation
    pods: list[str]
    pod_errors: list[str]
    patch: list[dict[str, Any]]
    profile: LatencyProfile | None

    @property
    def stale_lanes(self) -> list[LaneRecommendation]:
        return [rec for rec in self.lanes if rec.stale]

    def calibration(self) -> dict[str, dict[str, Any]]:
        """Per lane, the calibration to keep for the next window."""
        return {rec.lane: rec.model.to_dict() for rec in self.lanes}

    def to_dict(self) -> dict[str, Any]:
        return {
            "pods": self.pods,
            "podErrors": self.pod_errors,
            "profile": None
            if self.profile is None
            else {
                "model": self.profile.model.source,
                "device": self.profile.model.device,
                "batchSizes": self.profile.batch_sizes,
            },
            "lanes": [rec.to_dict() for rec in self.lanes],
            "failed": self.failed,
            "patch": self.patch,
        }


def recommend_policy(
    spec: PolicySpec,
    arrivals: Sequence[Mapping[str, Any]],
    profiles: Sequence[Mapping[str, Any]],
    *,
    growth: float = 2.0,
    margin: float = 0.2,
    rate: float | None = None,
    lanes: Sequence[str] | None = None,
    pod_errors: Sequence[str] = (),
    calibration: Mapping[str, LaneCalibration] | None = None,
) -> PolicyRecommendation:
    """Recommend for each lane of ``spec`` (or ``lanes``) from the pods' documents.

    ``rate`` (requests/s) is for a single lane only. A lane that cannot be recommended (no
    traffic, an SLO no setting meets) is listed in ``failed`` with the reason. ``calibration``:
    each lane's checks so far (``status.recommendation.calibration``); this window's check is
    added and the result's lanes carry the updated calibration.
    """
    calibration = calibration or {}
    if not 0 <= margin < 1:
        raise ValueError(f"margin must be in [0, 1), got {margin}")
    names = list(lanes) if lanes else [lane.name for lane in spec.lanes]
    unknown = [n for n in names if n not in {lane.name for lane in spec.lanes}]
    if unknown:
        raise ValueError(f"lane(s) {unknown} not in the policy (lanes: {[lane.name for lane in spec.lanes]})")
    if rate is not None and len(names) != 1:
        raise ValueError("a planned rate applies to one lane: name it")
    pods = [str(doc.get("pod") or "?") for doc in arrivals]
    if not arrivals:
        why = "no ready pod answered" + (f" ({'; '.join(pod_errors)})" if pod_errors else "")
        return PolicyRecommendation([], {n: why for n in names}, pods, list(pod_errors), [], None)
    captures = [parse_capture(doc) for doc in arrivals]
    profile = merge_profiles(profiles)
    recs: list[LaneRecommendation] = []
    failed: dict[str, str] = {}
    for name in names:
        lane = next(ln for ln in spec.lanes if ln.name == name)
        slo = spec.lane_slo(name)
        current = LaneSettings(lane.max_batch_size, lane.max_queue_delay, lane.max_queue_length, lane.request_timeout)
        try:
            traffic = merge_traffic(captures, name)
            model = calibrate(traffic, profile, calibration.get(name, LaneCalibration()))
            rec = recommend_lane(
                traffic,
                profile,
                current,
                SLOTargets(slo.p99_latency, slo.max_queue_age, margin),
                replicas=spec.replicas,
                growth=growth,
                rate=rate,
                model=model,
            )
        except ValueError as exc:
            failed[name] = str(exc)
            continue
        if len(traffic.settings_ran) > 1:
            rec.notes.append("pods run different settings for this lane (a rollout in flight)")
        spec_fields = {"maxBatchSize": lane.max_batch_size, "maxQueueDelay": lane.max_queue_delay}
        for c in captures:
            ran = c.lanes[name].settings
            if not ran:
                continue
            ran_fields = {"maxBatchSize": ran.get("maxBatchSize"), "maxQueueDelay": _seconds(ran.get("maxQueueDelay"))}
            if ran_fields != spec_fields:
                rec.notes.append(
                    f"pod {c.pod} (revision {c.revision}) runs maxBatchSize {ran.get('maxBatchSize')} / maxQueueDelay "
                    f"{ran.get('maxQueueDelay')}, not the spec's {lane.max_batch_size} / "
                    f"{format_duration(lane.max_queue_delay)} (a rollout in flight, or a rolled-back spec): "
                    "the traffic was observed under the pods' setting, the predictions are for the spec's"
                )
                break
        recs.append(rec)
    patch = json_patch([{"name": ln.name} for ln in spec.lanes], recs)
    return PolicyRecommendation(recs, failed, pods, list(pod_errors), patch, profile)


def _seconds(value: Any) -> float | None:
    try:
        return parse_duration(value)
    except ValueError:
        return None
