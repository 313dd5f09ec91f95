"""Operating characteristics of the canary verdict: whole rollouts per cell, offline.

Per-request latencies, queue ages and outcomes come from the tuner's batcher simulator
(``tune.simulator.simulate_requests``: the runtime's batching rule) fed with an arrival trace,
each request routed to one pod as the policy routes it at each step (the planner's own
``split_for``: with the replica ratio every pod gets an equal share; with exact gateway
weights the canary's pods share the step's weight), with lognormal noise on every forward
time. A simulated Prometheus (:class:`SimPrometheus`) answers the analysis' own queries from
those requests at any instant (the runtime's histogram buckets, ``histogram_quantile``,
request counts by outcome, raw counters at sub-window boundaries, per-tenant slices, the
per-pod rates of the load check), the real ``analysis.run_analysis`` judges (and, under a
route, ``fairness.judge_load`` as the controller does), and whole rollouts run the real
planner (``rollout.plan``) from a random start into the trace.

Cells (:class:`Cell`): traces ``code`` (the shipped production trace of code completions,
../shared/traces, CC-BY 4.0: Patel et al., Splitwise, ISCA 2024; rotated at a random offset),
``conversation`` (the long-prompt chat trace, its 3 s buckets spread uniformly, seed 0, as its
README asks), ``poisson`` and ``onoff`` (ON periods of mean 2 s at 8x the rate of OFF periods of
mean 8 s), all time-scaled to a rate; replicas 2 or 4; routing ``ratio`` (the demo's rollout
block: steps 25%/20s and 50%/20s, analysis every 15s, failureLimit 2, minSamples 100,
maxInconclusive 10) or ``gateway`` (the same clocks, steps 10/25/50 and
``minCanaryLoadRatio`` 0.5, as the shipped example); optionally 8 declared tenants plus
``other`` (Zipf shares), each slice judged too.

Scenarios (stable: 8-row batches, 2 ms window, queue bound 512, SLO p99 120 ms, queue age 60 ms,
errors 1%): ``aa`` the canary is the stable under a new tag; ``faster`` a model 1.5x faster;
``good`` the demo's good change until 2026-12-06 (16 rows, 5 ms: a p99 regression inside the
SLO at the demo's traffic); ``batch16`` (not run by default) its good change since (16 rows, the
2 ms window kept: room for the bursts' batches at no longer a wait); ``bad`` the demo's bad change (64 rows, 110 ms
window); ``slower20`` a model 20% slower (every forward time x1.2) at the load where the
stable's p99 over the whole run is 85% of the SLO; ``shed2`` a queue bound that sheds about 2%
of requests (error budget 1%); ``slower50`` (not run by default) a model 1.5x slower at the load
where *its* p99 over the run is 85% of the SLO: a p99 at least 1.5x the stable's that the SLO
cannot see, caught only with ``--max-p99-increase`` (the policy's ``rollout.maxP99Increase``,
which the good changes are then judged under too); ``p99x1.5`` (not run by default) a model
slowed until its p99 over the run is 1.5x the stable's at the cell's own rate (the trace's
calibrated one, or ``--rate``): the regression ``kubectl batchpilot status`` states a reach for.

Load: per trace, calibrated at 4 replicas (the rate at which 10% of the stable's 15 s windows
breach the p99 latency or queue-age SLO by the point estimate: bursts that both tracks see,
where false rollbacks happen); a cell with 2 replicas runs the same load per pod.

Reported per (cell, scenario): the share of rollouts rolled back / promoted / held (Stalled) /
unfinished within :data:`ROLLOUT_SECONDS`, for bad changes the analyses until rollback, and what
the first analysis said the gate can see (``detectableP99Regression``, ``detectableErrorRate``;
the share of rollouts that said up front a 20% regression, or a 2% error rate, is out of reach),
what the last step's last analysis said of the p99 (the step that promotes), and the objectives
that failed the rolled-back rollouts (``rolled_back_on``).

Usage: .venv/bin/python bench/canary_eval.py [--rollouts 100] [--out F]; --table F for docs/canary-analysis.md
"""

from __future__ import annotations

import argparse
import bisect
import dataclasses
import functools
import json
import math
import os
import random
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np

from batchpilot_operator.analysis import (
    AnalysisResult,
    LaneQueries,
    LaneVerdict,
    Measurement,
    Outcome,
    combine,
    counter_queries,
    lane_thresholds,
    plan_queries,
    promql_window,
    run_analysis,
    verdicts,
)
from batchpilot_operator.fairness import judge_load, per_pod_rate_query, unlike_load
from batchpilot_operator.rollout import (
    Commands,
    Observed,
    PlanInputs,
    TrackObserved,
    analysis_due,
    analysis_target,
    plan,
    split_for,
)
from batchpilot_operator.spec import PolicySpec
from batchpilot_operator.status import Status
from batchpilot_operator.traffic import RouteObserved
from batchpilot_operator.tune.profile import load_profile
from batchpilot_operator.tune.simulator import LaneSettings, RequestRecord, simulate_requests
from batchpilot_operator.tune.trace import Trace, load_trace
from batchpilot_runtime.metrics import LATENCY_BUCKETS
from benchlib import onoff_arrivals

ROOT = Path(__file__).resolve().parent.parent
TRACES = ROOT.parent / "shared" / "traces"
TRACE = TRACES / "azure-llm-2023-code.csv"
CONVERSATION = TRACES / "mooncake-2025-conversation.csv"
CONVERSATION_BUCKET_S = 3.0
PROFILE = ROOT / "manifests" / "profiles" / "mlp-cpu.yaml"
REPLICAS = 4
"""The replicas the per-trace load is calibrated at; a cell with other replicas runs the same
per-pod load (the rate scaled by its replicas over these)."""
TENANTS = tuple(f"t{k}" for k in range(1, 9))
"""With ``--tenants``: 8 declared tenants plus ``other``, Zipf shares (1/k over the 9)."""
TENANT_LABELS = (*TENANTS, "other")
TENANT_WEIGHTS = tuple(1.0 / k for k in range(1, len(TENANT_LABELS) + 1))
EXEC_SIGMA = 0.3
"""Lognormal sigma of forward-time noise around the profile's median (p90/p50 ~ 1.5)."""
TIMEOUT = 1.0
EPOCH = datetime(2026, 1, 1, tzinfo=UTC)
BOUNDS = np.array([*LATENCY_BUCKETS, math.inf])

STABLE = LaneSettings(max_batch_size=8, max_queue_delay=0.002, max_queue_length=512, request_timeout=TIMEOUT)
SCENARIOS = ("aa", "faster", "good", "bad", "slower20", "shed2", "slower50", "p99x1.5", "batch16")
DEFAULT_SCENARIOS = SCENARIOS[:-3]
"""slower50, p99x1.5 and batch16 only where asked for: the first two without --max-p99-increase
show only what the SLO cannot see."""
GOOD = ("aa", "faster", "good", "batch16")
OUT_OF_REACH = {"slower20": ("detectable", 0.2), "shed2": ("detectable_errors", 0.02)}
"""Per fault scenario, the rollout's field that says up front what it can see (the first
analysis's ``detectableP99Regression`` / ``detectableErrorRate``) and the scenario's effect: a
value above the effect said the fault is out of reach."""
ROUTINGS = ("ratio", "gateway")
"""``ratio``: the default, each step's weight as a share of the pods (every pod an equal share of
the requests); ``gateway``: weights set exactly on a Gateway API route, steps 10/25/50 and
minCanaryLoadRatio 0.5 as the shipped example (manifests/examples/gateway-canary.yaml)."""
ROUTING_CHOICES = (*ROUTINGS, "gateway-dss")
"""``gateway-dss`` (only where ``--routings`` names it): ``gateway`` with
``trafficRouting.dynamicStableScale``, the stable scaled to its share of the route."""


@dataclass(frozen=True)
class Cell:
    """Where rollouts run: the arrivals, the policy's replicas, how traffic reaches the canary,
    and whether the lane is judged per tenant slice too."""

    trace: str
    replicas: int = REPLICAS
    routing: str = "ratio"
    tenants: bool = False

    @property
    def name(self) -> str:
        return f"{self.trace}/{self.replicas}r/{self.routing}" + ("/tenants" if self.tenants else "")


def policy(
    batch: int,
    window_ms: float,
    queue: int,
    image: str = "img:1",
    confidence: float | None = None,
    cell: Cell = Cell("code"),
) -> PolicySpec:
    rollout: dict[str, Any] = {
        "steps": [{"weight": 25, "pause": "20s"}, {"weight": 50, "pause": "20s"}],
        "analysisInterval": "15s",
        "failureLimit": 2,
        "minSamples": 100,
        "maxInconclusive": 10,
    }
    if cell.routing in ("gateway", "gateway-dss"):
        rollout["steps"] = [{"weight": w, "pause": "20s"} for w in (10, 25, 50)]
        rollout["trafficRouting"] = {"gatewayAPI": {"httpRoute": "r", "rule": "infer"}, "minCanaryLoadRatio": 0.5}
        if cell.routing == "gateway-dss":
            rollout["trafficRouting"]["dynamicStableScale"] = True
    if last_pause := os.environ.get("CANARY_EVAL_LAST_PAUSE"):
        rollout["steps"][-1]["pause"] = f"{float(last_pause):g}s"
    if interval := os.environ.get("CANARY_EVAL_INTERVAL"):
        rollout["analysisInterval"] = f"{float(interval):g}s"
    confidence = confidence or float(os.environ.get("CANARY_EVAL_CONFIDENCE", "0")) or None
    if confidence is not None:
        rollout["confidence"] = confidence
    if increase := float(os.environ.get("CANARY_EVAL_MAX_P99_INCREASE", "0")):
        rollout["maxP99Increase"] = increase
    return PolicySpec.model_validate(
        {
            "model": {"name": "mlp", "image": image, "source": "builtin:mlp", "device": "cpu"},
            "replicas": cell.replicas,
            **({"tenants": {"names": list(TENANTS)}} if cell.tenants else {}),
            "lanes": [
                {
                    "name": "interactive",
                    "maxBatchSize": batch,
                    "maxQueueDelay": f"{window_ms}ms",
                    "maxQueueLength": queue,
                    "requestTimeout": "1s",
                }
            ],
            "slo": {"p99Latency": "120ms", "maxQueueAge": "60ms", "maxErrorRate": 0.01},
            "rollout": rollout,
        }
    )


# --------------------------------------------------------------------------- traces


def make_trace(kind: str, rate: float, duration: float, rng: random.Random) -> list[float]:
    """Arrival times over ``duration`` seconds at mean ``rate`` req/s."""
    if kind in ("code", "azure", "conversation"):
        base = _base_trace(kind).scaled_arrivals(rate)
        period = base[-1] + 1.0 / rate
        offset = rng.uniform(0, period)
        out: list[float] = []
        cycle = 0
        while True:
            for t in base:
                x = cycle * period + t - offset
                if x < 0:
                    continue
                if x >= duration:
                    return out
                out.append(x)
            cycle += 1
    times: list[float] = []
    t = 0.0
    if kind == "poisson":
        while True:
            t += rng.expovariate(rate)
            if t >= duration:
                return times
            times.append(t)
    if kind == "onoff":
        return onoff_arrivals(rate, duration, rng, on_mean=2.0, off_mean=8.0, on_over_off=8.0)
    raise ValueError(f"unknown trace {kind}")


@functools.cache
def _base_trace(kind: str) -> Trace:
    """The code trace, or the conversation trace with its 3 s buckets spread uniformly (fixed
    seed), as its README asks."""
    if kind == "conversation":
        return load_trace(CONVERSATION).spread(CONVERSATION_BUCKET_S, seed=0)
    return load_trace(TRACE)


# --------------------------------------------------------------------------- one simulated run


class Histogram:
    """Observations (time seen, value) kept as, per bucket bound, the sorted times of the
    observations at or under it: a window's cumulative bucket counts are two binary searches
    per bucket, whatever the window's length."""

    def __init__(self, times: Sequence[float], values: Sequence[float]) -> None:
        t, v = np.asarray(times, dtype=float), np.asarray(values, dtype=float)
        self.per_bound = [np.sort(t[v <= bound]) for bound in BOUNDS]

    def window(self, a: float, b: float) -> tuple[tuple[float, float], ...]:
        return tuple(
            (float(bound), float(np.searchsorted(ts, b) - np.searchsorted(ts, a)))
            for bound, ts in zip(BOUNDS, self.per_bound, strict=True)
        )


@dataclass
class TrackData:
    """A track's observations, by the time Prometheus would see them."""

    lat: Histogram
    age: Histogram
    served_t: np.ndarray  # well-formed requests (every outcome we simulate), at answer time
    err_t: np.ndarray
    lat_v: np.ndarray  # every latency, for whole-run quantiles

    @classmethod
    def of(cls, records: Sequence[RequestRecord]) -> TrackData:
        lat = [(r.done, r.latency) for r in records if r.latency is not None]
        # queue age is observed at dispatch (or at the timeout)
        age = [(r.arrival + r.queue_age, r.queue_age) for r in records if r.queue_age is not None]
        return cls(
            Histogram([t for t, _ in lat], [v for _, v in lat]),
            Histogram([t for t, _ in age], [v for _, v in age]),
            np.sort(np.array([r.done for r in records])),
            np.sort(np.array([r.done for r in records if r.outcome != "ok"])),
            np.array([v for _, v in lat]),
        )

    def window(self, a: float, b: float) -> dict[str, Any]:
        def count(ts: np.ndarray) -> float:
            return float(np.searchsorted(ts, b) - np.searchsorted(ts, a))

        return {
            "lat": self.lat.window(a, b),
            "age": self.age.window(a, b),
            "served": count(self.served_t),
            "errors": count(self.err_t),
        }


def histogram_quantile(q: float, buckets: Sequence[tuple[float, float]]) -> float | None:
    """Prometheus' histogram_quantile over cumulative buckets (linear inside a bucket)."""
    total = buckets[-1][1]
    if total == 0:
        return None
    rank = q * total
    lower, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower  # Prometheus returns the largest finite bound
            if count == lower_count:
                return bound
            return lower + (bound - lower) * (rank - lower_count) / (count - lower_count)
        lower, lower_count = bound, count
    return lower


@dataclass
@dataclass
class Layout:
    """The pods of one step and what each track's pods saw, by (track, tenant label or None for
    every request)."""

    stable_pods: int
    canary_pods: int
    canary_share: float
    tracks: dict[tuple[str, str | None], TrackData]


class Run:
    """One simulated run: per step weight, its layout. Simulated lazily: up to ``horizon``
    seconds of arrivals first, and again over twice as many whenever a rollout reads past it
    (every random draw is per request or per pod, so the longer run repeats the shorter one
    and only adds to it); most rollouts end long before the run's traffic does."""

    MARGIN = 2 * TIMEOUT
    """Requests are answered within their timeout and a forward pass: data is complete up to
    the horizon less this."""

    def __init__(self, build: Callable[[float], dict[int, Layout]], duration: float, horizon: float | None) -> None:
        self._build = build
        self.duration = duration
        self.horizon = duration if horizon is None else min(horizon, duration)
        self.layouts = build(self.horizon)

    def ensure(self, t: float) -> None:
        """Make the data complete up to ``t``."""
        while t > self.horizon - self.MARGIN and self.horizon < self.duration:
            self.horizon = min(self.duration, 2 * self.horizon)
            self.layouts = self._build(self.horizon)


def step_layouts(spec: PolicySpec) -> dict[int, tuple[int, int, float]]:
    """Per step weight of ``spec``: (stable pods, canary pods, the canary's share of the requests),
    from the planner's own split (``rollout.split_for``): with a route the share is the weight;
    without one, every pod takes an equal share."""
    out: dict[int, tuple[int, int, float]] = {}
    for step in spec.rollout.steps:
        split = split_for(spec, step.weight)
        routed = spec.rollout.traffic_routing is not None
        share = step.weight / 100 if routed else split.canary / (split.stable + split.canary)
        out[step.weight] = (split.stable, split.canary, share)
    return out


def simulate_run(
    arrivals: list[float],
    canary: LaneSettings,
    table: list[float],
    canary_scale: float,
    seed: int,
    spec: PolicySpec,
    tenants: bool = False,
    weights: Sequence[int] | None = None,
    horizon: float | None = None,
) -> Run:
    """Every request routed to one pod as ``spec`` routes it at each step (only the steps of
    ``weights`` when given), each pod simulated with its own forward-time noise; lazily from
    ``horizon`` seconds when given (:class:`Run`)."""
    labels = (
        random.Random(seed).choices(range(len(TENANT_LABELS)), weights=TENANT_WEIGHTS, k=len(arrivals))
        if tenants
        else None
    )
    routed = spec.rollout.traffic_routing is not None
    splits = {weight: split for weight, split in step_layouts(spec).items() if weights is None or weight in weights}

    def build(horizon: float) -> dict[int, Layout]:
        n = bisect.bisect_left(arrivals, horizon)
        layouts: dict[int, Layout] = {}
        done: dict[tuple[int, int, float], Layout] = {}  # steps that split alike share one simulation
        for weight, (stable_pods, canary_pods, share) in splits.items():
            if (stable_pods, canary_pods, share) in done:
                layouts[weight] = done[(stable_pods, canary_pods, share)]
                continue
            rng = random.Random(seed * 1000 + weight)
            # per pod first, then per request: a longer horizon repeats these draws and adds to them
            noises = [
                [math.exp(rng.gauss(0, EXEC_SIGMA)) for _ in range(4096)] for _ in range(stable_pods + canary_pods)
            ]
            pods: list[list[int]] = [[] for _ in noises]  # canary pods first
            for i in range(n):
                if routed:
                    pod = (
                        rng.randrange(canary_pods) if rng.random() < share else canary_pods + rng.randrange(stable_pods)
                    )
                else:
                    pod = rng.randrange(len(pods))
                pods[pod].append(i)
            recs: dict[tuple[str, str | None], list[RequestRecord]] = {}
            for k, part in enumerate(pods):
                track = "canary" if k < canary_pods else "stable"
                settings = canary if track == "canary" else STABLE
                tab = [x * (canary_scale if track == "canary" else 1.0) for x in table]
                got = simulate_requests([arrivals[i] for i in part], settings, tab, exec_scale=noises[k])
                recs.setdefault((track, None), []).extend(got)
                if labels is not None:
                    # Records come back in answer order; the requests' tenants in arrival order.
                    ordered = sorted(got, key=lambda r: r.arrival)
                    for i, r in zip(part, ordered, strict=True):
                        recs.setdefault((track, TENANT_LABELS[labels[i]]), []).append(r)
            layout = Layout(stable_pods, canary_pods, share, {k: TrackData.of(v) for k, v in recs.items()})
            layouts[weight] = done[(stable_pods, canary_pods, share)] = layout
        return layouts

    return Run(build, arrivals[-1] if arrivals else 0.0, horizon)


# --------------------------------------------------------------------------- verdicts


class SimPrometheus:
    """A MetricsBackend over one simulated run: answers the analysis' own queries (the window
    queries with ``increase``/``rate`` over the analysis interval, and the raw counters read at
    sub-window boundaries) at the instant ``at``, as Prometheus would from the runtime's
    histograms and counters. Queries are recognised by the strings the analysis builds."""

    def __init__(self, spec: PolicySpec, layout: Layout, revisions: tuple[str, str]) -> None:
        self.layout = layout
        self.window = spec.rollout.analysis_interval
        canary, stable = revisions
        self.lqs = plan_queries(spec, policy="p", namespace="n", canary_revision=canary, stable_revision=stable)
        Key = tuple[str, str | None, str, str]
        self.kind: dict[str, Key] = {}
        for lq in self.lqs:
            for m in lq.metrics:
                self.kind[m.value] = (lq.track, lq.tenant, m.metric, "value")
                self.kind[m.samples] = (lq.track, lq.tenant, m.metric, "samples")
                self.kind[m.bad] = (lq.track, lq.tenant, m.metric, "bad")
                if m.codes is not None:
                    self.kind[m.codes] = (lq.track, lq.tenant, m.metric, "codes")
        for cq in counter_queries(self.lqs, policy="p", namespace="n"):
            self.kind[cq.requests] = (cq.track, cq.tenant, cq.metric, "counter_requests")
            self.kind[cq.bad] = (cq.track, cq.tenant, cq.metric, "counter_bad")
        for track, rev in (("canary", canary), ("stable", stable)):  # fairness.judge_load's per-pod rates
            q = per_pod_rate_query(namespace="n", policy="p", track=track, revision=rev, window=self.window)
            self.kind[q] = (track, None, "perPodRate", "value")

    def measure(self, queries: Sequence[str], at: float | None = None) -> dict[str, Measurement]:
        assert at is not None
        t = at - EPOCH.timestamp()
        out: dict[str, Measurement] = {}
        cache: dict[tuple[str, str | None, bool], dict[str, Any]] = {}
        empty = TrackData.of([])
        for q in queries:
            track, tenant, metric, kind = self.kind[q]
            cumulative_read = kind.startswith("counter")
            key = (track, tenant, cumulative_read)
            if key not in cache:
                start = -math.inf if cumulative_read else t - self.window
                cache[key] = self.layout.tracks.get((track, tenant), empty).window(start, t)
            w = cache[key]
            if metric == "perPodRate":
                pods = self.layout.canary_pods if track == "canary" else self.layout.stable_pods
                out[q] = Measurement(q, value=w["served"] / self.window / pods if w["served"] else None)
                continue
            out[q] = answer(w, metric, kind, q)
        return out


def answer(w: dict[str, Any], metric: str, kind: str, q: str) -> Measurement:
    if metric == "clientErrors":  # the simulated clients send only well-formed requests: no 4xx
        n = w["served"]  # every request (served counts the errors too)
        if kind == "codes":
            return Measurement(q)
        if kind == "value":
            return Measurement(q, value=0.0 if n else None)
        if kind in ("samples", "counter_requests"):
            return Measurement(q, value=n if n or kind == "samples" else None)
        return Measurement(q, value=0.0)
    if metric == "errorRate":
        n, k = w["served"], w["errors"]
        if kind == "value":
            return Measurement(q, value=k / n if n else None)
        if kind in ("samples", "counter_requests"):
            return Measurement(q, value=n if n or kind == "samples" else None)
        return Measurement(q, value=k)
    b = w["lat" if metric in ("p99Latency", "p99Increase") else "age"]  # p99Increase: the same series
    n = b[-1][1]
    if kind == "value":
        return Measurement(q, value=histogram_quantile(0.99, b))
    if kind in ("samples", "counter_requests"):
        return Measurement(q, value=n if n or kind == "samples" else None)
    return Measurement(q, buckets=b if n else ())


STABLE_TOLERANCE = 0.10


def old_verdicts(spec: PolicySpec, lqs: Sequence[LaneQueries], ms: dict[str, Measurement]) -> tuple[LaneVerdict, ...]:
    """The rule before this change: the canary's p99 point against the SLO, a breach excused
    only when the stable breaches too and the canary is within 10% of it."""
    new = verdicts(spec, lqs, ms)  # for the checks' values and samples
    out = []
    for lane in new:
        thresholds = lane_thresholds(spec, lane.lane)
        checks = []
        for c in lane.canary:
            s = lane.check(c.metric, "stable")
            if c.outcome is Outcome.ERROR:
                checks.append(c)
                continue
            if c.samples is None or c.samples < spec.rollout.min_samples or c.value is None:
                outcome = Outcome.INCONCLUSIVE
            elif c.value > thresholds[c.metric]:
                outcome = Outcome.FAILED
                if (
                    s is not None
                    and s.value is not None
                    and s.samples is not None
                    and s.samples >= spec.rollout.min_samples
                    and s.value > thresholds[c.metric]
                    and c.value <= s.value * (1 + STABLE_TOLERANCE)
                ):
                    outcome = Outcome.INCONCLUSIVE
            else:
                outcome = Outcome.SUCCESSFUL
            checks.append(dataclasses.replace(c, outcome=outcome, note=None))
        out.append(dataclasses.replace(lane, canary=tuple(checks), outcome=combine([c.outcome for c in checks])))
    return tuple(out)


RULES = ("old", "new")


def analyse(
    rule: str,
    spec: PolicySpec,
    run: Run,
    weight: int,
    end: float,
    revisions: tuple[str, str] = ("c", "s"),
    history: dict[str, list[list[float]]] | None = None,
    step_index: int = 0,
) -> AnalysisResult:
    """One analysis at ``end`` (trace seconds) of the step at ``weight``: the real run_analysis
    against the simulated Prometheus for the new rule, then the load check the controller adds
    under a route (``fairness.judge_load``); the old rule over the same window's measurements."""
    prom = SimPrometheus(spec, run.layouts[weight], revisions)
    now = EPOCH + timedelta(seconds=end)
    if rule == "new":
        result = run_analysis(
            prom,
            spec,
            policy="p",
            namespace="n",
            canary_revision=revisions[0],
            stable_revision=revisions[1],
            now=now,
            history=history,
            unlike_load=unlike_load(spec, step_index),
        )
        routing = spec.rollout.traffic_routing
        if routing is not None:
            result = judge_load(
                prom,
                result,
                routing,
                policy="p",
                namespace="n",
                spec=spec,
                step_index=step_index,
                now=now,
                emit=lambda *_: None,
            )
        return result
    ms = prom.measure([q for lq in prom.lqs for q in lq.all()], at=now.timestamp())
    return AnalysisResult(
        time=now,
        window=promql_window(spec.rollout.analysis_interval),
        canary_revision=revisions[0],
        stable_revision=revisions[1],
        lanes=old_verdicts(spec, prom.lqs, ms),
    )


# --------------------------------------------------------------------------- whole rollouts


def rollout(rule: str, old: PolicySpec, new: PolicySpec, run: Run, start: float) -> dict[str, Any]:
    """One rollout of ``new`` over ``old`` through the real planner, every pod ready at once;
    its ``trail`` holds each analysis (:func:`trail_entry`)."""
    status = Status()
    observed = Observed()
    spec, generation = old, 1

    def step(now: float, analysis: AnalysisResult | None) -> Any:
        nonlocal status, observed
        d = plan(
            PlanInputs(
                spec=spec,
                generation=generation,
                status=status,
                observed=observed,
                now=EPOCH + timedelta(seconds=now),
                analysis=analysis,
                commands=Commands(),
            )
        )
        status = d.status
        observed = Observed(
            stable=TrackObserved(d.stable_revision, d.stable_replicas, d.stable_replicas),
            canary=TrackObserved(d.canary_revision, d.canary_replicas, d.canary_replicas)
            if d.canary_revision
            else None,
            # the route takes the weights at once
            route=RouteObserved(d.route.stable_weight, d.route.canary_weight, d.route.header)
            if d.route is not None
            else None,
        )
        return d

    step(start - 2, None)
    step(start - 1, None)
    spec, generation = new, 2
    step(start, None)
    d = step(start, None)
    now, analyses, first_failed, seen = start, 0, None, 0.0
    detectable: float | None = None  # what the first analysis said the rollout can see
    detectable_errors: float | None = None
    detectable_last: float | None = None  # ... and the last analysis of the last step (the gating one)
    failed_by: set[str] = set()  # the objectives of every Failed check the rollout met
    trail: list[dict[str, Any]] = []
    outcome = "running"
    while now < run.duration:
        now += d.requeue_after if d.requeue_after else 1.0
        if now >= run.duration:
            break
        analysis = None
        if status.rollout is not None and analysis_due(spec, status, EPOCH + timedelta(seconds=now)):
            target = analysis_target(status)
            assert target is not None and target[1] is not None
            run.ensure(now)
            analysis = analyse(
                rule,
                spec,
                run,
                status.rollout.step_weight,
                now,
                (target[0], target[1]),
                status.rollout.evidence,
                status.rollout.step_index,
            )
        # The step this analysis judges (read before the planner acts on it: the analysis that
        # promotes the canary leaves no rollout behind).
        at_last_step = status.rollout is not None and status.rollout.step_index == len(spec.rollout.steps) - 1
        d = step(now, analysis)
        if analysis is not None and d.analysis_outcomes:
            analyses += 1
            trail.append(trail_entry(now - start, status, analysis, d.analysis_outcomes[0]))
            if analyses == 1 and status.last_analysis is not None and status.last_analysis.lanes:
                found = status.last_analysis.lanes[0].detectable_p99_regression
                detectable = math.inf if found is None else found
                rate = status.last_analysis.lanes[0].detectable_error_rate
                detectable_errors = math.inf if rate is None else rate
            if at_last_step and status.last_analysis is not None and status.last_analysis.lanes:
                found = status.last_analysis.lanes[0].detectable_p99_regression
                detectable_last = math.inf if found is None else found
            seen = max(seen, *(tally_share(v) for k, v in analysis.tally.items() if k.endswith("/canary")), 0.0)
            if d.analysis_outcomes[0] == "Failed" and first_failed is None:
                first_failed = analyses
            failed_by |= {c.metric for lane in analysis.lanes for c in lane.checks() if c.outcome is Outcome.FAILED}
        if d.rollout_outcomes:
            outcome = d.rollout_outcomes[0]
            break
        stalled = status.condition("Stalled")
        if stalled is not None and stalled.status == "True" and stalled.reason == "InconclusiveLimit":
            outcome = "Held"
            break
    return {
        "outcome": outcome,
        "analyses": analyses,
        "seconds": now - start,
        "worst_share_seen": seen,
        "detectable": detectable,
        "detectable_errors": detectable_errors,
        "detectable_last_step": detectable_last,
        "failed_by": sorted(failed_by),
        "trail": trail,
    }


def trail_entry(t: float, status: Status, analysis: AnalysisResult, outcome: str) -> dict[str, Any]:
    """One analysis of a rollout, compact (``--explain``): when, the step, the outcome, and per
    objective of the first lane's total its outcome, the canary's and the stable's
    (bad, requests) over the window and over the tally, and the note."""

    def pair(x: tuple[float, float] | None) -> list[float] | None:
        return None if x is None else [round(x[0], 1), round(x[1], 1)]

    lane = analysis.lanes[0]
    checks = {}
    for c in lane.canary:
        s = c.stable
        checks[c.metric] = {
            "outcome": c.outcome.value,
            "canary": [round(c.bad or 0.0, 1), round(c.samples or 0.0, 1)],
            "stable": None if s is None else [round(s.bad or 0.0, 1), round(s.samples or 0.0, 1)],
            "tally": pair(c.tally),
            "stable_tally": pair(c.stable_tally),
            "shared_breach": c.shared_breach,
            "note": (c.note or "")[:160] or None,
        }
    return {
        "t": round(t, 1),
        "step": status.rollout.step_index if status.rollout is not None else None,
        "outcome": outcome,
        "checks": checks,
    }


def tally_share(slices: list[list[float]]) -> float:
    """The canary's bad share over its tally, relative to the objective's budget is not known
    here: returned raw (fraction of requests over the objective, or errors)."""
    n = sum(x[1] for x in slices)
    return sum(x[0] for x in slices) / n if n else 0.0


# --------------------------------------------------------------------------- the study


def canary_settings(
    scenario: str, shed_queue: int, cell: Cell, p99x15_scale: float = 1.5
) -> tuple[LaneSettings, float, PolicySpec]:
    if scenario == "aa":
        # The same model and settings under a new image tag: a new revision that is the stable.
        return STABLE, 1.0, policy(8, 2, 512, image="img:aa", cell=cell)
    if scenario == "faster":
        # A model 1.5x faster (every forward time / 1.5), the settings unchanged.
        return STABLE, 1 / 1.5, policy(8, 2, 512, image="img:faster", cell=cell)
    if scenario == "good":
        return LaneSettings(16, 0.005, 512, TIMEOUT), 1.0, policy(16, 5, 512, cell=cell)
    if scenario == "batch16":
        return LaneSettings(16, 0.002, 512, TIMEOUT), 1.0, policy(16, 2, 512, cell=cell)
    if scenario == "bad":
        return LaneSettings(64, 0.110, 512, TIMEOUT), 1.0, policy(64, 110, 512, cell=cell)
    if scenario == "slower20":
        # A different model image (a new revision); the lane settings stay.
        return STABLE, 1.2, policy(8, 2, 512, image="img:slower", cell=cell)
    if scenario == "shed2":
        return LaneSettings(8, 0.002, shed_queue, TIMEOUT), 1.0, policy(8, 2, shed_queue, cell=cell)
    if scenario == "slower50":
        return STABLE, 1.5, policy(8, 2, 512, image="img:slower50", cell=cell)
    if scenario == "p99x1.5":
        return STABLE, p99x15_scale, policy(8, 2, 512, image="img:p99x1.5", cell=cell)
    raise ValueError(scenario)


ROLLOUT_SECONDS = 180.0
"""Traffic per rollout (from 10 s in) with the 20 s pauses: every step and a failureLimit of
Failed analyses fit several times over (a clean rollout is promoted in 45-90 s); a rollout
still running at the end (Inconclusive analyses that neither pass nor fail it) is counted as
``unfinished``. A longer last pause (``--last-pause``) adds its extra seconds."""


def rollout_seconds(spec: PolicySpec) -> float:
    """:data:`ROLLOUT_SECONDS` scaled by how much longer ``spec``'s steps and analyses are
    than the 20 s pauses and 15 s interval it was sized for (``--last-pause``, ``--interval``)."""
    r = spec.rollout
    clean = sum(st.pause + r.analysis_interval for st in r.steps)
    return ROLLOUT_SECONDS * max(1.0, clean / (35.0 * len(r.steps)))


def cell(args: tuple[Cell, str, float, int, int, int, list[float], bool, float, int]) -> dict[str, Any]:
    """``rollouts`` whole rollouts of one scenario in one cell, each over its own simulated run
    (a random start into the trace); with ``windows``, every analysis window of every step's
    layout is judged too (the share of Failed analyses). The trail of every analysis is kept
    for up to ``explain`` rollouts that missed (a good change not promoted, a bad one not
    rolled back), with their seeds."""
    where, scenario, rate, rollouts, seed0, shed_queue, table, windows, p99x15_scale, explain = args
    canary, scale, new_spec = canary_settings(scenario, shed_queue, where, p99x15_scale)
    old_spec = policy(8, 2, 512, cell=where)
    counts: dict[str, Any] = {
        r: {"analyses": 0, "failed": 0, "inconclusive": 0, "rollouts": []}
        for r in os.environ.get("CANARY_EVAL_RULES", "new").split(",")
    }
    w = old_spec.rollout.analysis_interval
    for i in range(rollouts):
        seed = seed0 + i
        rng = random.Random(seed)
        arrivals = make_trace(where.trace, rate, rollout_seconds(new_spec) + 10.0, rng)
        run = simulate_run(
            arrivals,
            canary,
            table,
            scale,
            seed,
            new_spec,
            where.tenants,
            # a clean rollout's time: each step's pause and an interval
            horizon=None
            if windows
            else 20.0 + sum(st.pause + new_spec.rollout.analysis_interval for st in new_spec.rollout.steps),
        )
        for rule in counts:
            c = counts[rule]
            if windows:
                for weight in run.layouts:
                    end = 10.0 + w
                    while end < run.duration:
                        a = analyse(rule, new_spec, run, weight, end)
                        c["analyses"] += 1
                        c["failed"] += a.outcome is Outcome.FAILED
                        c["inconclusive"] += a.outcome is Outcome.INCONCLUSIVE
                        end += w
            r = rollout(rule, old_spec, new_spec, run, 10.0)
            trail = r.pop("trail")
            if (r["outcome"] != "Promoted" if scenario in GOOD else r["outcome"] != "RolledBack") and (
                len(c.setdefault("explained", [])) < explain
            ):
                c["explained"].append({"seed": seed, "outcome": r["outcome"], "trail": trail})
            c["rollouts"].append(r)
    return {"cell": dataclasses.asdict(where), "scenario": scenario, "rate": rate, "counts": counts}


CALIBRATION = Cell("code")
"""The layout the load is calibrated on: 4 replicas, the ratio split, its 50% step (2 pods each)."""


def calibration_run(
    trace: str, rate: float, d: float, seed: int, settings: LaneSettings, scale: float, table: list[float]
) -> Layout:
    spec = policy(8, 2, 512, cell=dataclasses.replace(CALIBRATION, trace=trace))
    run = simulate_run(
        make_trace(trace, rate, d, random.Random(seed)), settings, table, scale, seed, spec, weights=[50]
    )
    return run.layouts[50]


def stable_breach_share(trace: str, rate: float, table: list[float], duration: float, runs: int = 6) -> float:
    """The share of 15 s windows in which the stable track (2 of 4 pods) breaches its p99 latency
    or p99 queue-age objective (the point estimates)."""
    spec = policy(8, 2, 512, cell=dataclasses.replace(CALIBRATION, trace=trace))
    hits = total = 0
    for seed in range(runs):
        rng = random.Random(10_000 + seed)
        run = simulate_run(make_trace(trace, rate, duration, rng), STABLE, table, 1.0, seed, spec, weights=[50])
        end = 25.0
        while end < run.duration:
            a = analyse("new", spec, run, 50, end)
            checks = [a.lanes[0].check(m, "stable") for m in ("p99Latency", "queueAge")]
            if all(c is not None and c.value is not None and (c.samples or 0) >= 100 for c in checks):
                total += 1
                hits += any(c is not None and c.value is not None and c.value > c.threshold for c in checks)
            end += 15.0
    return hits / total if total else 0.0


def calibrate(trace: str, table: list[float], target: float = 0.10) -> float:
    lo, hi = 10.0, 2500.0
    for _ in range(9):
        mid = math.sqrt(lo * hi)
        if stable_breach_share(trace, mid, table, 120.0, runs=3) < target:
            lo = mid
        else:
            hi = mid
    return round(math.sqrt(lo * hi), 1)


def whole_p99(trace: str, rate: float, settings: LaneSettings, scale: float, table: list[float], d: float) -> float:
    layout = calibration_run(trace, rate, d, 99, settings, scale, table)
    lat = np.concatenate([layout.tracks[(t, None)].lat_v for t in ("canary", "stable")])
    canary = layout.tracks[("canary", None)].lat_v
    return float(np.quantile(canary if scale != 1.0 else lat, 0.99))


def shed_share(trace: str, rate: float, queue: int, table: list[float], d: float) -> float:
    layout = calibration_run(trace, rate, d, 98, LaneSettings(8, 0.002, queue, TIMEOUT), 1.0, table)
    c = layout.tracks[("canary", None)]
    return len(c.err_t) / max(1, len(c.served_t))


def summarize(c: dict[str, Any], scenario: str, failure_limit: int) -> dict[str, Any]:
    ro = c["rollouts"]
    n = len(ro)
    share = lambda k: round(sum(r["outcome"] == k for r in ro) / n, 4) if n else None  # noqa: E731
    out: dict[str, Any] = {
        "analyses": c["analyses"],
        "failed_analysis_rate": round(c["failed"] / c["analyses"], 4) if c["analyses"] else None,
        "inconclusive_analysis_rate": round(c["inconclusive"] / c["analyses"], 4) if c["analyses"] else None,
        "rollouts": n,
        "rolled_back": share("RolledBack"),
        "promoted": share("Promoted"),
        "held": share("Held"),
        "unfinished": share("running"),
    }
    rb = [r for r in ro if r["outcome"] == "RolledBack"]
    promoted = [r for r in ro if r["outcome"] == "Promoted"]
    if promoted:
        out["mean_seconds_to_promotion"] = round(sum(r["seconds"] for r in promoted) / len(promoted), 1)
        out["mean_analyses_to_promotion"] = round(sum(r["analyses"] for r in promoted) / len(promoted), 2)
    if scenario not in GOOD and promoted:
        # Did the canary show its fault at all while it ran? (a fault that only bursts bring out
        # cannot be seen by a rollout that met no burst)
        out["promoted_worst_tally_share_mean"] = round(sum(r["worst_share_seen"] for r in promoted) / len(promoted), 4)
    said = [r["detectable"] for r in ro if r.get("detectable") is not None]
    if said:
        out["detectable_p99_regression_median"] = sorted(said)[len(said) // 2]
        # a 20% slower model: did the rollout say up front that 20% is below what it can see?
        _, slower = OUT_OF_REACH["slower20"]
        out["said_20pct_not_detectable"] = round(sum(x > slower for x in said) / len(said), 4)
        # the bar: a 1.5x worse p99 always within reach
        out["said_50pct_not_detectable"] = round(sum(x > 0.5 for x in said) / len(said), 4)
    said_last = [r["detectable_last_step"] for r in ro if r.get("detectable_last_step") is not None]
    if said_last:  # what the last step (the one that promotes) said, where the rollout reached it
        out["detectable_p99_regression_last_step_median"] = sorted(said_last)[len(said_last) // 2]
        out["said_50pct_not_detectable_last_step"] = round(sum(x > 0.5 for x in said_last) / len(said_last), 4)
    said_errors = [r["detectable_errors"] for r in ro if r.get("detectable_errors") is not None]
    if said_errors:
        out["detectable_error_rate_median"] = sorted(said_errors)[len(said_errors) // 2]
        # a queue shedding 2%: did the rollout say up front that 2% is below what it can see?
        _, shed = OUT_OF_REACH["shed2"]
        out["said_2pct_errors_not_detectable"] = round(sum(x > shed for x in said_errors) / len(said_errors), 4)
    warned = OUT_OF_REACH.get(scenario)
    if warned and n:
        # the bar per rollout: caught, or said up front that the effect is out of reach
        key, effect = warned
        unwarned = [r for r in ro if r["outcome"] != "RolledBack" and not (r.get(key) is not None and r[key] > effect)]
        out["missed_unwarned"] = round(len(unwarned) / n, 4)
    by: dict[str, int] = {}
    for r in rb:
        for metric in r.get("failed_by", ()):
            by[metric] = by.get(metric, 0) + 1
    if by:
        out["rolled_back_on"] = dict(sorted(by.items()))  # rollbacks with a Failed check of each objective
    if scenario not in GOOD and n:
        out["rolled_back_within_limit_plus_1"] = round(sum(r["analyses"] <= failure_limit + 1 for r in rb) / n, 4)
        out["mean_analyses_to_rollback"] = round(sum(r["analyses"] for r in rb) / len(rb), 2) if rb else None
        out["max_analyses_to_rollback"] = max((r["analyses"] for r in rb), default=None)
    return out


def markdown_table(result: dict[str, Any]) -> str:
    """The table of docs/canary-analysis.md: per cell, each good change's rolled-back share and each bad change's
    caught share (rolled back), with the rollouts behind each and the bad change's mean analyses to its rollback."""

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.0f}%"

    by_cell: dict[str, dict[str, dict[str, Any]]] = {}
    for row in result["rows"]:
        by_cell.setdefault(row["cell"], {})[row["scenario"]] = row
    scenarios = [s for s in SCENARIOS if any(s in v for v in by_cell.values())]
    head = ["cell (trace/replicas/routing)", "req/s"] + [
        f"{s} {'rolled back' if s in GOOD else 'caught'}" for s in scenarios
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, rows in by_cell.items():
        first = next(iter(rows.values()))
        cells = [name, f"{first['rate']:g}"]
        for s in scenarios:
            r = rows.get(s)
            if r is None:
                cells.append("")
                continue
            extra = f" ({pct(r['held'])} held)" if r.get("held") else ""
            if s == "slower20" and r.get("said_20pct_not_detectable") is not None:
                extra += f"; {pct(r['said_20pct_not_detectable'])} said 20% is out of reach"
            if s == "slower50" and r.get("said_50pct_not_detectable") is not None:
                extra += f"; {pct(r['said_50pct_not_detectable'])} said 50% is out of reach"
            if s == "bad" and r.get("mean_analyses_to_rollback") is not None:
                extra += f", after {r['mean_analyses_to_rollback']:g} analyses"
            if s == "shed2" and r.get("said_2pct_errors_not_detectable") is not None:
                extra += f"; {pct(r['said_2pct_errors_not_detectable'])} said 2% errors are out of reach"
            if r.get("missed_unwarned"):
                extra += f"; {pct(r['missed_unwarned'])} neither caught nor said so"
            cells.append(f"{pct(r['rolled_back'])} of {r['rollouts']}{extra}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rollouts", type=int, default=100, help="whole rollouts per (cell, scenario)")
    p.add_argument("--traces", default="code,conversation,poisson,onoff")
    p.add_argument("--replicas", default="2,4")
    p.add_argument("--routings", default=",".join(ROUTINGS), help=f"of {','.join(ROUTING_CHOICES)}")
    p.add_argument("--tenants", choices=["off", "on", "both"], default="off", help="judge 8 tenant slices too")
    p.add_argument("--scenarios", default=",".join(DEFAULT_SCENARIOS), help=f"of {','.join(SCENARIOS)}")
    p.add_argument("--duration", type=float, default=300.0, help="seconds of traffic per calibration run")
    p.add_argument("--rate", type=float, default=None, help="mean req/s at 4 replicas (default: calibrated per trace)")
    p.add_argument("--windows", action="store_true", help="also judge every window (the Failed-analysis share)")
    p.add_argument(
        "--explain", type=int, default=0, help="keep every analysis of up to N missed rollouts per cell (explained)"
    )
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--confidence", type=float, default=None, help="rollout.confidence (default: the spec's)")
    p.add_argument(
        "--max-p99-increase", type=float, default=None, help="rollout.maxP99Increase (default: absent, SLOs only)"
    )
    p.add_argument(
        "--last-pause", type=float, default=None, help="seconds of the last step's pause (default: 20, as the others)"
    )
    p.add_argument("--interval", type=float, default=None, help="seconds of rollout.analysisInterval (default: 15)")
    p.add_argument("--rules", default="new", help="old,new (old: the rule before the sub-window tests)")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--table", type=Path, default=None, help="print the markdown table of a results file (no runs)")
    args = p.parse_args()
    if args.table:
        print(markdown_table(json.loads(args.table.read_text())))
        return 0
    t0 = time.time()
    if args.confidence:
        os.environ["CANARY_EVAL_CONFIDENCE"] = str(args.confidence)
    if args.max_p99_increase:
        os.environ["CANARY_EVAL_MAX_P99_INCREASE"] = str(args.max_p99_increase)
    if args.last_pause:
        os.environ["CANARY_EVAL_LAST_PAUSE"] = str(args.last_pause)
    if args.interval:
        os.environ["CANARY_EVAL_INTERVAL"] = str(args.interval)
    os.environ["CANARY_EVAL_RULES"] = args.rules
    table = load_profile(PROFILE).exec_table(64, "p50")
    traces = args.traces.split(",")
    scenarios = args.scenarios.split(",")
    tenant_modes = {"off": [False], "on": [True], "both": [False, True]}[args.tenants]
    cells = [
        Cell(trace, int(replicas), routing, tenants)
        for trace in traces
        for tenants in tenant_modes
        for replicas in args.replicas.split(",")
        for routing in args.routings.split(",")
    ]
    setup: dict[str, Any] = {}
    for trace in traces:
        rate = args.rate or calibrate(trace, table)
        # slower20: the load at which the stable's p99 over the run is 85% of the SLO;
        # shed2: the queue bound that sheds closest to 2%.
        lo, hi = rate / 2, rate * 3
        for _ in range(7):  # the p99 grows with the load: bisect for the stable's p99 at 85% of the SLO
            mid = math.sqrt(lo * hi)
            lo, hi = (mid, hi) if whole_p99(trace, mid, STABLE, 1.0, table, args.duration) <= 0.85 * 0.12 else (lo, mid)
        slow_rate = round(lo, 1)
        lo, hi = rate / 8, rate * 2
        for _ in range(7 if "slower50" in scenarios else 0):  # the 1.5x slower model's p99 at 85% of the SLO
            mid = math.sqrt(lo * hi)
            lo, hi = (mid, hi) if whole_p99(trace, mid, STABLE, 1.5, table, args.duration) <= 0.85 * 0.12 else (lo, mid)
        slower50_rate = round(lo, 1)
        lo_s, hi_s = 1.0, 3.0
        base_p99 = whole_p99(trace, rate, STABLE, 1.0, table, args.duration)
        for _ in range(8 if "p99x1.5" in scenarios else 0):  # the model scale whose p99 is 1.5x the stable's
            mid = (lo_s + hi_s) / 2
            lo_s, hi_s = (
                (mid, hi_s)
                if whole_p99(trace, rate, STABLE, mid, table, args.duration) < 1.5 * base_p99
                else (lo_s, mid)
            )
        p99x15_scale = round(hi_s, 3)
        lo_q, hi_q = 1, 64  # shedding falls as the bound grows: the smallest bound shedding <= 2%
        while lo_q < hi_q:
            mid_q = (lo_q + hi_q) // 2
            lo_q, hi_q = (
                (lo_q, mid_q) if shed_share(trace, rate, mid_q, table, args.duration) <= 0.02 else (mid_q + 1, hi_q)
            )
        shed_queue = max(1, lo_q - 1)  # one below: the bound that sheds just over 2%
        setup[trace] = {
            "rate": rate,
            "stable_breach_share_at_rate": round(stable_breach_share(trace, rate, table, args.duration), 3),
            "slower20_rate": slow_rate,
            "slower20_p99_stable": round(whole_p99(trace, slow_rate, STABLE, 1.0, table, args.duration), 4),
            "slower20_p99_canary": round(whole_p99(trace, slow_rate, STABLE, 1.2, table, args.duration), 4),
            **(
                {
                    "slower50_rate": slower50_rate,
                    "slower50_p99_stable": round(whole_p99(trace, slower50_rate, STABLE, 1.0, table, args.duration), 4),
                    "slower50_p99_canary": round(whole_p99(trace, slower50_rate, STABLE, 1.5, table, args.duration), 4),
                }
                if "slower50" in scenarios
                else {}
            ),
            **(
                {
                    "p99x1.5_model_scale": p99x15_scale,
                    "p99x1.5_p99_stable": round(base_p99, 4),
                    "p99x1.5_p99_canary": round(whole_p99(trace, rate, STABLE, p99x15_scale, table, args.duration), 4),
                }
                if "p99x1.5" in scenarios
                else {}
            ),
            "shed2_queue_bound": shed_queue,
            "shed2_share": round(shed_share(trace, rate, shed_queue, table, args.duration), 4),
        }
        print(f"[{time.time() - t0:.0f}s] {trace}: {setup[trace]}", file=sys.stderr)
    jobs = []
    for where in cells:
        per_pod = where.replicas / REPLICAS  # the same load per pod in every cell
        for k, scenario in enumerate(scenarios):
            base = setup[where.trace][f"{scenario}_rate" if scenario in ("slower20", "slower50") else "rate"]
            jobs.append(
                (
                    where,
                    scenario,
                    round(base * per_pod, 1),
                    args.rollouts,
                    1000 * k,
                    setup[where.trace]["shed2_queue_bound"],
                    table,
                    args.windows,
                    setup[where.trace].get("p99x1.5_model_scale", 1.5),
                    args.explain,
                )
            )
    rows = []
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        for res in pool.map(cell, jobs):
            for rule in res["counts"]:
                row = {
                    "cell": Cell(**res["cell"]).name,
                    **res["cell"],
                    "scenario": res["scenario"],
                    "rate": res["rate"],
                    "rule": rule,
                    **summarize(res["counts"][rule], res["scenario"], 2),
                }
                if res["counts"][rule].get("explained"):
                    row["explained"] = res["counts"][rule]["explained"]
                rows.append(row)
                shown = {k: v for k, v in row.items() if k != "explained"}
                print(f"[{time.time() - t0:.0f}s] {json.dumps(shown)}", file=sys.stderr)
    result = {
        "benchmark": "canary_eval",
        "when": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "command": " ".join(["bench/canary_eval.py", *sys.argv[1:]]),
        "loadavg": os.getloadavg(),
        "seconds": round(time.time() - t0, 1),
        "config": {
            "calibrated_at_replicas": REPLICAS,
            "exec_profile": str(PROFILE.relative_to(ROOT)),
            "exec_noise_sigma": EXEC_SIGMA,
            "rollouts_per_cell": args.rollouts,
            "rollout_seconds": rollout_seconds(policy(8, 2, 512)),
            "rollout": {
                routing: policy(8, 2, 512, cell=Cell("code", routing=routing)).rollout.model_dump(
                    mode="json", by_alias=True, exclude_none=True
                )
                for routing in ROUTING_CHOICES
            },
            "tenants": list(TENANT_LABELS) if args.tenants != "off" else None,
            "max_p99_increase": args.max_p99_increase,
            "last_pause": args.last_pause,
            "analysis_interval": args.interval,
        },
        "setup": setup,
        "rows": rows,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
