"""Recommendations from the pods' own traffic: merge what the runtimes captured, run the tuner.

Pure (no Kubernetes client, no HTTP, no torch): the callers (``kubectl batchpilot recommend``
and the operator's recommender) fetch the runtime documents through the apiserver's pod proxy
and hand them here.

The pods' captures are parsed and merged in :mod:`batchpilot_operator.tune.captures`.

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

Beside every p99 stands the same prediction with every pass :data:`PASS_DRIFT` slower
(``p99AtSlowerPasses``): the calibration says how far the model was off; this says how far the
p99 moves when the passes do, which they do from one minute to the next on a shared host. A
setting that meets the p99 target at the planned rate only at the passes' measured level gets a
note saying so.
"""

from __future__ import annotations

import math
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
from batchpilot_operator.tune.captures import (
    CaptureError,
    MergedTraffic,
    PodCapture,
    merge_profiles,
    merge_traffic,
    parse_capture,
    round4,
)
from batchpilot_operator.tune.profile import LatencyProfile
from batchpilot_operator.tune.search import SLOTargets, search
from batchpilot_operator.tune.simulator import LaneSettings, SimResult, simulate
from batchpilot_operator.tune.trace import Trace
from batchpilot_runtime.config import format_duration, parse_duration

KEEP_TOLERANCE = 0.03
"""A recommendation within this fraction of the current setting's capacity keeps the current setting."""
MORE_CAPACITY_FACTOR = 1.25
"""The recommended setting is 'clearly better' when its capacity is at least this times the current one."""
PASS_DRIFT = 0.10
"""How much slower every pass runs in the what-if beside each p99. Measured on the 2-core bench
host (docs/tuning.md, "How far a pass moves"): the pods' pass p50s of two runs a minute apart
differed by a median 7% per batch size, and one run's batch-1 median from one second to the next
ranged 4.3-5.4 ms. Where bursts come near the model's capacity, the p99 moves several times as
far as the passes."""

# Reasons a setting is stale (the condition's reason is the first that applies).
BREACH_NOW = "BreachAtCurrentTraffic"
BREACH_GROWTH = "BreachAtPlannedGrowth"
MORE_CAPACITY = "MoreCapacityAvailable"


# --------------------------------------------------------------------------- recommending


@dataclass
class Prediction:
    rate: float
    p99_latency: float
    p99_latency_slower: float  # with every pass PASS_DRIFT slower
    p99_queue_age: float
    mean_batch: float
    utilization: float
    dropped: int
    timeouts: int
    meets_targets: bool

    def to_dict(self) -> dict[str, Any]:
        return {
            "rate": round4(self.rate),
            "p99Latency": _dur(self.p99_latency),
            "p99AtSlowerPasses": _dur(self.p99_latency_slower),
            "p99QueueAge": _dur(self.p99_queue_age),
            "meanBatch": round4(self.mean_batch),
            "utilization": round4(self.utilization),
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
            "capacity": round4(self.capacity),
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
            "observedRowRate": round4(self.observed_rate),
            "plannedRowRate": round4(self.planned_rate),
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
    """The simulator's p99 at ``rate``, times the lane's ``correction`` (the calibration), and the
    same with every pass :data:`PASS_DRIFT` slower."""
    table = profile.exec_table(max(settings.max_batch_size, 1))
    arrivals = trace.scaled_arrivals(rate)
    t = slo.targets()

    def run(exec_scale: Sequence[float] | None) -> SimResult:
        return simulate(
            arrivals,
            settings,
            table,
            replicas,
            "random",
            0,
            profile.request_overhead,
            exec_scale=exec_scale,
            dispatch_delay=profile.dispatch_delay,
            front_end_cost=profile.front_end_cost,
        )

    sim = run(None)
    p99 = sim.latency_quantile(t.quantile) * correction
    age = sim.queue_age_quantile(t.quantile)
    return Prediction(
        rate=rate,
        p99_latency=p99,
        p99_latency_slower=run((1 + PASS_DRIFT,)).latency_quantile(t.quantile) * correction,
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
    rec = (
        cur
        if rec_settings == current
        else SettingReport(
            rec_settings,
            result.capacity,
            _predict(trace, profile, rec_settings, observed, replicas, slo, correction),
            _predict(trace, profile, rec_settings, planned, replicas, slo, correction),
        )
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
    for report in (cur,) if rec is cur else (cur, rec):
        if (edge := _knife_edge(report, slo)) is not None:
            notes.append(edge)
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


def _knife_edge(report: SettingReport, slo: SLOTargets) -> str | None:
    """A note when the setting meets the p99 target at the planned rate with the passes as the
    pods measured them but not with every pass :data:`PASS_DRIFT` slower."""
    p = report.at_planned
    target = slo.targets().latency
    if not p.meets_targets or p.p99_latency_slower <= target:
        return None
    s = report.settings
    return (
        f"maxBatchSize {s.max_batch_size} / maxQueueDelay {format_duration(s.max_queue_delay)} meets the p99 "
        f"target ({_dur(target)}) at the planned rate only with the passes as measured: p99 {_dur(p.p99_latency)}, "
        f"{_dur(p.p99_latency_slower)} with every pass {PASS_DRIFT:.0%} slower (passes move that much from one "
        "minute to the next on a shared host)"
    )


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
