"""Search max batch size and window for the highest sustainable rate within SLO.

For every candidate lane setting (max batch size B from powers of two and the profile's
measured sizes; window W from a log-spaced grid between 0 and the SLO), find its
*capacity*: the highest mean arrival rate, replaying the trace time-scaled to that rate,
at which the simulated p99 latency and p99 queue age stay within the SLO less the safety
margin. Recommend the setting with the highest capacity; among settings within
``tie_tolerance`` of the best, the one with the lowest p99 at the target rate.

Why the search is sound
-----------------------
*Upper bound (rigorous).* One replica completes at most ``u1 = max_b b / exec(b)`` rows
per second (b <= B). A request on time completes within ``T`` (the latency target) of its
arrival, and all ``n`` arrivals happen within the trace's span ``D = (n - 1) / r``; so at
least ``ceil(0.99 n)`` completions must fit in ``D + T`` seconds:
``0.99 n <= R u1 (D + T)``. Solving for r gives :func:`rate_upper_bound`, a rate above
which no run can pass. The binary search starts there, and a candidate whose bound is
below the incumbent's capacity is skipped without simulating (it cannot win).

*Bisection (monotone where it matters).* A request's latency is its window wait
(<= W while the executor is idle), plus its wait for a busy executor, plus exec(size).
The grid keeps ``W + exec(1) + overhead`` within the target and ``exec(B) + overhead``
under it, so at light load every request meets the SLO, and misses come from executor
contention. Compressing all gaps by a common factor never shortens the wait for a busy
executor when service times are fixed (Lindley's recursion is monotone in the gaps):
exactly so for B = 1, and for B > 1 the service times change only because batches grow,
which lowers the work per row (exec(b)/b falls with b in every measured profile), so the
feasible set is an interval [0, capacity] up to the bisection's tolerance. It is an
approximation for B > 1 (window waits shrink as load grows, so a run can pass at a rate
above one where it failed), so the recommendation is *verified*: the chosen setting is
simulated at a ladder of lower rates (see ``verified_rates``). A setting that fails one has its
capacity lowered below the highest rate it failed (bisected again, then verified again, up to
``MAX_LOWERINGS`` times) and is ranked again at that capacity; one still failing is discarded
in favour of the next best. On a short trace the p99 is a few requests and its edge is ragged:
on 600 requests of the conversation trace one setting met a 40 ms SLO at every rate of a
5-250 req/s sweep but failed at 0.9x the capacity the bisection found, and was discarded.

Measured on the hour-long Azure trace (8,819 requests) with a CPU profile of builtin:mlp
(``bench/tune_validation.py --search-only``): of 88 candidates x 40 rates from 1% to 99% of
each one's capacity, 9 verdicts failed, all at 99% of the capacity and none below: the
feasible set is an interval with an edge ragged by about 2%, well inside the safety margin.

*Pruning (sound under the same assumption).* A candidate is first tested at the current
threshold (best capacity so far, less the tie tolerance); if it fails there, its capacity
is below the threshold and it cannot win, so it costs one (usually early-exiting) run.

*Fast.* One run over the hour-long trace walks batch by batch with binary searches
(O(batches log B)) and stops at the first request beyond the p99's miss budget; with
pruning, most candidates cost one run. ``TuneResult.elapsed_s`` reports the time.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from batchpilot_operator.tune.profile import LatencyProfile, Quantile
from batchpilot_operator.tune.simulator import (
    LaneSettings,
    SimResult,
    Split,
    Targets,
    simulate,
    split_arrivals,
)
from batchpilot_operator.tune.slo_check import meets_slo
from batchpilot_operator.tune.trace import Trace


@dataclass(frozen=True)
class SLOTargets:
    """The lane's SLOs (seconds) and the safety margin (a fraction)."""

    p99_latency: float
    queue_age: float
    margin: float = 0.2

    def targets(self) -> Targets:
        keep = 1.0 - self.margin
        return Targets(latency=self.p99_latency * keep, queue_age=self.queue_age * keep)


@dataclass
class CandidateResult:
    settings: LaneSettings
    capacity: float | None  # None: pruned (below the threshold it was tested at)
    threshold: float | None = None
    runs: int = 0


@dataclass
class TuneResult:
    recommended: LaneSettings
    capacity: float  # requests/s, all replicas, at the margin
    target_rate: float
    at_target: SimResult
    replicas: int
    targets: Targets
    candidates: list[CandidateResult]
    runs: int
    elapsed_s: float
    verified_rates: list[float] = field(default_factory=list)
    replicas_needed: int | None = None  # when the target rate exceeds the capacity
    notes: list[str] = field(default_factory=list)

    @property
    def meets_target(self) -> bool:
        return self.capacity >= self.target_rate


def round_window(seconds: float) -> float:
    """Round a window to 2 significant digits at microsecond resolution (readable in YAML)."""
    if seconds <= 0:
        return 0.0
    digits = 1 - math.floor(math.log10(seconds))
    return max(1e-6, round(round(seconds, digits), 6))


def default_batch_sizes(profile: LatencyProfile, cap: int | None, exec_limit: float) -> list[int]:
    """Powers of two up to ``cap`` plus the profile's measured sizes, whose exec fits the target."""
    top = cap if cap is not None else profile.max_batch_size
    sizes = {1 << k for k in range(0, 13) if (1 << k) <= top}
    sizes |= {b for b in profile.batch_sizes if b <= top}
    return sorted(b for b in sizes if profile.exec_time(b) < exec_limit)


def default_windows(max_window: float, count: int = 10, min_window: float = 100e-6) -> list[float]:
    """0 plus ``count`` log-spaced windows from ``min_window`` up to ``max_window``."""
    if max_window <= 0:
        return [0.0]
    lo = min(min_window, max_window / 100)
    ratio = (max_window / lo) ** (1 / max(1, count - 1))
    grid = {0.0} | {round_window(lo * ratio**k) for k in range(count)}
    return sorted(w for w in grid if w <= max_window)


def rate_upper_bound(
    exec_table: Sequence[float], batch: int, replicas: int, n: int, targets: Targets, front_end_cost: float = 0.0
) -> float:
    """No rate above this can pass (see the module docstring's upper-bound argument)."""
    u = replicas * max(b / exec_table[b] for b in range(1, batch + 1))
    if front_end_cost > 0:  # nor can the pods' HTTP loops answer more than 1/cost each
        u = min(u, replicas / front_end_cost)
    need = math.ceil(targets.quantile * n - 1e-9)
    # need <= u (D + T) with D = (n - 1) / r  ->  r <= u (n - 1) / (need - u T)
    denom = need - u * targets.latency
    if denom <= 0:
        return math.inf
    return u * (n - 1) / denom


class _Evaluator:
    """Feasibility at a rate, for one trace split; counts runs."""

    def __init__(
        self,
        trace: Trace,
        profile: LatencyProfile,
        replicas: int,
        split: Split,
        seed: int,
        quantile: Quantile | None,
        max_batch: int,
    ) -> None:
        self.unit = trace.scaled_arrivals(1.0)  # mean rate 1 request/s
        self.parts_unit = split_arrivals(self.unit, replicas, split, seed)
        self.replicas = replicas
        self.split: Split = split
        self.seed = seed
        self.table = profile.exec_table(max_batch, quantile)
        self.overhead = profile.request_overhead
        self.delay = profile.dispatch_delay
        self.front_end = profile.front_end_cost
        self.runs = 0

    def parts(self, rate: float) -> list[list[float]]:
        k = 1.0 / rate
        return [[t * k for t in p] for p in self.parts_unit]

    def ok(self, settings: LaneSettings, rate: float, targets: Targets) -> bool:
        self.runs += 1
        return meets_slo(self.parts(rate), settings, self.table, targets, self.overhead, self.delay, self.front_end)

    def run(self, settings: LaneSettings, rate: float) -> SimResult:
        self.runs += 1
        arrivals = [t / rate for t in self.unit]
        return simulate(
            arrivals,
            settings,
            self.table,
            self.replicas,
            self.split,
            self.seed,
            self.overhead,
            dispatch_delay=self.delay,
            front_end_cost=self.front_end,
        )


def _capacity(
    ev: _Evaluator,
    settings: LaneSettings,
    targets: Targets,
    upper: float,
    threshold: float | None,
    rel_tol: float,
) -> tuple[float | None, int]:
    """Highest feasible rate (to ``rel_tol``), or None if infeasible at ``threshold``."""
    start = ev.runs
    if threshold is not None:
        if threshold > upper or not ev.ok(settings, threshold, targets):
            return None, ev.runs - start
        lo = threshold
    else:
        lo = upper / 2 if math.isfinite(upper) else 1.0
        floor = lo * 1e-6
        while not ev.ok(settings, lo, targets):
            lo /= 4
            if lo < floor:
                return 0.0, ev.runs - start
    hi = upper
    if not math.isfinite(hi):
        hi = lo * 2
        for _ in range(40):
            if not ev.ok(settings, hi, targets):
                break
            lo, hi = hi, hi * 2
    elif ev.ok(settings, hi, targets):
        return hi, ev.runs - start
    while hi / lo > 1 + rel_tol:
        mid = math.sqrt(lo * hi)
        if ev.ok(settings, mid, targets):
            lo = mid
        else:
            hi = mid
    return lo, ev.runs - start


def search(
    trace: Trace,
    profile: LatencyProfile,
    slo: SLOTargets,
    *,
    replicas: int = 1,
    target_rate: float | None = None,
    max_queue_length: int = 1_000_000,
    request_timeout: float = math.inf,
    batch_sizes: Sequence[int] | None = None,
    windows: Sequence[float] | None = None,
    max_batch: int | None = None,
    split: Split = "random",
    seed: int = 0,
    quantile: Quantile | None = None,
    rel_tol: float = 0.01,
    tie_tolerance: float = 0.03,
    verify: Sequence[float] = (0.9, 0.75, 0.5, 0.25, 0.1, 0.01),
    prune: bool = True,
) -> TuneResult:
    """Find the lane setting with the highest sustainable rate (see the module docstring).

    ``prune=False`` measures every candidate's capacity (slower; for checking the pruning).
    """
    started = time.perf_counter()
    targets = slo.targets()
    notes: list[str] = []
    sizes, grid = _grid(profile, slo, targets, batch_sizes, windows, max_batch, request_timeout, notes)
    ev = _Evaluator(trace, profile, replicas, split, seed, quantile, max(sizes))
    rate = target_rate if target_rate is not None else trace.mean_rate
    settings_list = [
        LaneSettings(b, w, max_queue_length=max_queue_length, request_timeout=request_timeout)
        for b in sizes
        for w in grid
    ]
    results = _capacities(ev, settings_list, targets, trace.count, rel_tol, tie_tolerance, prune)
    chosen, at_target, verified = _choose(ev, results, rate, targets, tie_tolerance, verify, notes, rel_tol)
    capacity = chosen.capacity or 0.0
    replicas_needed: int | None = None
    if rate > capacity:
        # Report the prediction at the requested rate itself, and how many replicas it needs.
        at_target = ev.run(chosen.settings, rate)
        notes.append(
            f"target rate {rate:.4g} req/s exceeds the predicted capacity {capacity:.4g} req/s "
            f"with {replicas} replica(s)"
        )
        replicas_needed = _replicas_needed(
            trace, profile, chosen.settings, targets, rate, replicas, split, seed, quantile
        )
    return TuneResult(
        recommended=chosen.settings,
        capacity=capacity,
        target_rate=rate,
        at_target=at_target,
        replicas=replicas,
        targets=targets,
        candidates=results,
        runs=ev.runs,
        elapsed_s=time.perf_counter() - started,
        verified_rates=verified,
        replicas_needed=replicas_needed,
        notes=notes,
    )


def _grid(
    profile: LatencyProfile,
    slo: SLOTargets,
    targets: Targets,
    batch_sizes: Sequence[int] | None,
    windows: Sequence[float] | None,
    max_batch: int | None,
    request_timeout: float,
    notes: list[str],
) -> tuple[list[int], list[float]]:
    """The batch sizes and windows to try (the given ones, or the defaults the SLO leaves room
    for); a note when a size is beyond the profile; ValueError when nothing fits."""
    overhead = profile.request_overhead
    exec_limit = targets.latency - overhead
    sizes = list(batch_sizes) if batch_sizes is not None else default_batch_sizes(profile, max_batch, exec_limit)
    if not sizes:
        raise ValueError(
            f"no batch size fits: even one row takes {profile.exec_time(1) * 1e3:.3g}ms "
            f"(+{overhead * 1e3:.3g}ms overhead), over the p99 target {targets.latency * 1e3:.3g}ms "
            f"(SLO less {slo.margin:.0%} margin)"
        )
    if max(sizes) > profile.max_batch_size:
        notes.append(
            f"batch sizes above {profile.max_batch_size} are extrapolated from the profile; "
            "profile larger batches before trusting them"
        )
    max_window = min(targets.latency - profile.exec_time(1) - overhead, targets.queue_age)
    grid = list(windows) if windows is not None else default_windows(max_window)
    grid = [w for w in grid if w < request_timeout]
    if not grid:
        raise ValueError("no window fits under the SLO and the request timeout")
    return sizes, grid


def _capacities(
    ev: _Evaluator,
    settings_list: list[LaneSettings],
    targets: Targets,
    n: int,
    rel_tol: float,
    tie_tolerance: float,
    prune: bool,
) -> list[CandidateResult]:
    """Every candidate's capacity, most promising first, so that the best so far rises early and
    prunes (with ``prune``) each candidate whose upper bound cannot come within the tie tolerance."""
    uppers = {
        s: rate_upper_bound(ev.table, s.max_batch_size, ev.replicas, n, targets, ev.front_end) for s in settings_list
    }
    ordered = sorted(settings_list, key=lambda s: (-uppers[s], -s.max_queue_delay))
    results: list[CandidateResult] = []
    best = 0.0
    for s in ordered:
        threshold = best * (1 - tie_tolerance) if best > 0 and prune else None
        if threshold is not None and uppers[s] < threshold:
            results.append(CandidateResult(s, None, threshold, 0))
            continue
        cap, used = _capacity(ev, s, targets, uppers[s], threshold, rel_tol)
        results.append(CandidateResult(s, cap, threshold, used))
        if cap is not None and cap > best:
            best = cap
    return results


MAX_LOWERINGS = 3
"""How many times a setting that fails a rate below its capacity has that capacity lowered
(below the highest rate it failed) before it is discarded."""


def _verify(
    ev: _Evaluator, r: CandidateResult, targets: Targets, verify: Sequence[float], rel_tol: float
) -> tuple[float, list[float], list[float]] | None:
    """The highest capacity, at most ``r``'s, whose ``verify`` ladder all meets the SLO: the
    capacity, its ladder and the rates that failed on the way down; None when none was found
    within ``MAX_LOWERINGS`` lowerings."""
    capacity = r.capacity or 0.0
    failed: list[float] = []
    for lowering in range(MAX_LOWERINGS + 1):
        ladder = [capacity * f for f in verify]
        missed = [x for x in ladder if not ev.ok(r.settings, x, targets)]
        if not missed:
            return capacity, ladder, failed
        failed.append(max(missed))
        if lowering == MAX_LOWERINGS:
            break
        below, _ = _capacity(ev, r.settings, targets, max(missed), None, rel_tol)
        if not below:
            break
        capacity = below
    return None


def _choose(
    ev: _Evaluator,
    results: list[CandidateResult],
    rate: float,
    targets: Targets,
    tie_tolerance: float,
    verify: Sequence[float],
    notes: list[str],
    rel_tol: float = 0.01,
) -> tuple[CandidateResult, SimResult, list[float]]:
    """The recommendation among the contenders (within the tie tolerance of the best capacity):
    the lowest p99 at the target rate whose SLO holds at every rate of the ``verify`` ladder
    below its capacity (lowered where it does not: ``_verify``); with its run at
    min(target, capacity) and the verified rates. A lowered candidate of ``results`` carries
    its lowered capacity, a discarded one 0."""
    ranked = sorted(
        (r for r in results if r.capacity is not None and r.capacity > 0),
        key=lambda r: -(r.capacity or 0.0),
    )
    if not ranked:
        raise ValueError("no setting meets the SLO even at a near-zero rate: relax the SLO or the margin")
    verified: dict[LaneSettings, list[float]] = {}  # the ladder of each setting checked at its capacity
    discarded: list[LaneSettings] = []  # failed lower rates however far their capacity was lowered
    runs: dict[tuple[LaneSettings, float], SimResult] = {}  # a contender ranked again keeps its run
    while ranked:
        top_cap = ranked[0].capacity or 0.0
        contenders = [r for r in ranked if (r.capacity or 0.0) >= top_cap * (1 - tie_tolerance)]
        scored: list[tuple[float, float, CandidateResult, SimResult]] = []
        for r in contenders:
            key = (r.settings, min(rate, r.capacity or rate))
            if key not in runs:
                runs[key] = ev.run(*key)
            sim = runs[key]
            scored.append((sim.latency_quantile(targets.quantile), -(r.capacity or 0.0), r, sim))
        scored.sort(key=lambda x: (x[0], x[1]))
        for _, _, r, sim in scored:
            if r.settings in verified:
                return r, sim, verified[r.settings]
            name = f"maxBatchSize={r.settings.max_batch_size} window={r.settings.max_queue_delay:g}s"
            checked = _verify(ev, r, targets, verify, rel_tol)
            ranked.remove(r)
            if checked is None:
                notes.append(
                    f"{name} passed at {r.capacity:.4g} req/s but failed lower rates however far its capacity "
                    "was lowered: not monotone there, skipped"
                )
                discarded.append(r.settings)
                r.capacity = 0.0  # the candidates list says what was verified, not what was bisected
                continue
            capacity, ladder, failed = checked
            verified[r.settings] = ladder
            if not failed:
                return r, sim, ladder
            notes.append(
                f"{name} passed at {r.capacity:.4g} req/s but failed at {', '.join(f'{x:.4g}' for x in failed)} "
                f"req/s below it: its capacity lowered to {capacity:.4g} req/s, where every lower rate checked passes"
            )
            r.capacity = capacity
            ranked.append(r)
            ranked.sort(key=lambda c: -(c.capacity or 0.0))
            break  # rank again: the lowered setting may no longer be a contender
    raise ValueError(
        "no setting meets the SLO at every rate up to its capacity: each one that met it at some rate "
        "missed it at a lower one ("
        + ", ".join(f"maxBatchSize {s.max_batch_size} window {s.max_queue_delay:g}s" for s in discarded)
        + "): relax the SLO or the margin"
    )


def _replicas_needed(
    trace: Trace,
    profile: LatencyProfile,
    settings: LaneSettings,
    targets: Targets,
    rate: float,
    replicas: int,
    split: Split,
    seed: int,
    quantile: Quantile | None,
    limit: int = 256,
) -> int | None:
    """The fewest replicas (above ``replicas``) that keep the target rate within SLO."""
    lo = replicas
    hi = replicas * 2

    def ok(r: int) -> bool:
        ev = _Evaluator(trace, profile, r, split, seed, quantile, settings.max_batch_size)
        return ev.ok(settings, rate, targets)

    while not ok(hi):
        lo = hi
        hi *= 2
        if hi > limit:
            return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid
    return hi


def result_dict(result: TuneResult) -> dict[str, Any]:
    """The machine-readable summary (``-o json``)."""
    s = result.recommended
    sim = result.at_target
    tested = [c for c in result.candidates if c.capacity is not None]
    return {
        "recommended": {
            "maxBatchSize": s.max_batch_size,
            "maxQueueDelay": s.max_queue_delay,
        },
        "capacity_rps": result.capacity,
        "target_rate_rps": result.target_rate,
        "meets_target": result.meets_target,
        "replicas": result.replicas,
        "replicas_needed": result.replicas_needed,
        "targets_s": {"p99_latency": result.targets.latency, "queue_age": result.targets.queue_age},
        "predicted_at_target": sim.summary(result.targets.quantile),
        "verified_rates_rps": result.verified_rates,
        "search": {
            "candidates": len(result.candidates),
            "simulated": len(tested),
            "pruned": len(result.candidates) - len(tested),
            "runs": result.runs,
            "elapsed_s": result.elapsed_s,
        },
        "candidates": [
            {
                "maxBatchSize": c.settings.max_batch_size,
                "maxQueueDelay": c.settings.max_queue_delay,
                "capacity_rps": c.capacity,
                "pruned_below_rps": c.threshold if c.capacity is None else None,
                "runs": c.runs,
            }
            for c in result.candidates
        ],
        "notes": result.notes,
    }
