"""Discrete-event simulation of the runtime's dynamic batcher for one lane.

The model of one replica (one runtime pod, one model executor), mirroring the runtime:

* requests join the lane's FIFO queue on arrival; a request arriving while
  ``max_queue_length`` requests wait is rejected at once (``dropped``);
* a batch is *due* when ``max_batch_size`` rows wait, or when the oldest waiting row has
  waited ``max_queue_delay`` (the window), whichever comes first; it is *dispatched* at
  ``max(due, executor free)``: while the model runs, the next batch forms, and it goes as
  soon as the executor frees (at once, if its window already expired);
* at dispatch the batch takes the oldest waiting rows, at most ``max_batch_size``, all that
  arrived up to that instant (an arrival at exactly the dispatch instant is included);
* a row still queued ``request_timeout`` after its arrival leaves the queue unrun
  (``timeouts``; the runtime answers 504 then); a dispatched row always completes;
* the batch runs for ``exec_table[size]`` seconds (from the latency profile); every row's
  latency is ``completion - arrival + request_overhead`` and its queue age is
  ``dispatch - arrival`` (the runtime's ``batchpilot_queue_age_seconds``; a timed-out row
  observes its timeout).

The rule is the runtime's own: the exact engine drives ``batchpilot_runtime.scheduler.Scheduler``
(the class the runtime's ``BatchWorker`` cuts every batch with) on a simulated clock, cutting
the next batch at ``max(ready, executor free)`` as the worker does; the fast engine and
:func:`batchpilot_operator.tune.slo_check.meets_slo` re-derive the same rule for speed, and
``tests/operator/test_batching_conformance.py`` holds all of them to the same batches (sizes
and instants, in order) on both real traces, Poisson and on/off arrivals. Not modelled: other
lanes sharing the executor (priorities), multi-row requests, and CPU contention between HTTP
handling and the model.

The HTTP front end is a queue too: the runtime's event loop reads, decodes and answers one
request at a time, at ``front_end_cost`` CPU seconds each (the profile's ``frontEndCost``, the
server process's own CPU per request). A request reaches the batcher when the loop starts on it,
``max(arrival, when the loop finished the request before)``, so a burst faster than
``1 / front_end_cost`` queues in front of the batcher, and every row's latency counts from its
arrival at the pod. Without a backlog the loop starts at the arrival and nothing changes: the
idle cost of the loop is in ``request_overhead`` (measured at low load), so it is not counted
twice. The batcher's queue age and timeouts start where the runtime starts them, at the handler.

Replicas sit behind one Service and share the arrivals: each request goes to one replica,
chosen at random with a fixed seed (``split="random"``, what kube-proxy's iptables mode does
per connection, and what a client without keep-alive sees per request), or round-robin
(``split="round-robin"``, IPVS / a gateway). The assignment depends on the request's index
only, so the same request goes to the same replica at every rate scale (common random
numbers: comparisons between settings and rates are not blurred by split noise).

Two engines give identical answers where both apply (tests hold them to it):
:func:`simulate_exact` steps through every arrival with the runtime's Scheduler and handles
drops and timeouts; :func:`_fast_replica` walks batch by batch with binary searches over the sorted
arrival times (O(batches x log B)), and hands over to the exact engine the moment the run
would drop or time out a request. :func:`batchpilot_operator.tune.slo_check.meets_slo` walks
the same way with early exit: it stops as soon as more requests missed a target than the p99
allows.

Quantiles use the nearest-rank definition (p99 = the ceil(0.99 n)-th smallest value), so
"p99 <= T" is exactly "at most n - ceil(0.99 n) requests exceed T".
"""

from __future__ import annotations

import bisect
import math
import random
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Literal

from batchpilot_runtime.config import LaneConfig
from batchpilot_runtime.scheduler import Pending, QueueFull, Scheduler, State

Split = Literal["random", "round-robin"]


@dataclass(frozen=True)
class LaneSettings:
    """The batching knobs of one lane (the fields of ``spec.lanes[]`` that shape batches).

    Its fields are :class:`LaneConfig`'s of the same names (:func:`_lane_config` passes them by
    name), with the same lower bounds but none above: a simulation may explore settings the CRD
    would refuse, an infinite timeout among them. A plain frozen dataclass, so the tuner keys its
    tables by it and builds thousands of them cheaply (tests/operator/test_crd_lane_contract.py
    holds the fields and the bounds to the model's)."""

    max_batch_size: int
    max_queue_delay: float
    max_queue_length: int = 1_000_000
    request_timeout: float = math.inf

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError("max_batch_size must be at least 1")
        if self.max_queue_delay < 0:
            raise ValueError("max_queue_delay must not be negative")
        if self.max_queue_length < 1:
            raise ValueError("max_queue_length must be at least 1")


@dataclass(frozen=True)
class Targets:
    """What a run must meet: p99 latency and p99 queue age (seconds), already with margin."""

    latency: float
    queue_age: float
    quantile: float = 0.99


def allowed_misses(n: int, quantile: float) -> int:
    """How many of ``n`` values may exceed T while the nearest-rank quantile stays <= T."""
    return n - math.ceil(quantile * n - 1e-9)


def nearest_rank(sorted_values: Sequence[float], quantile: float) -> float:
    if not sorted_values:
        return math.nan
    k = max(0, math.ceil(quantile * len(sorted_values) - 1e-9) - 1)
    return sorted_values[k]


@dataclass
class SimResult:
    """Everything one run measured (all replicas together)."""

    requests: int
    latencies: list[float] = field(default_factory=list)  # served in time (not dropped/timed out)
    queue_waits: list[float] = field(default_factory=list)  # every dispatched request: dispatch - arrival
    batch_sizes: list[int] = field(default_factory=list)
    oldest_ages: list[float] = field(default_factory=list)  # per batch: the oldest row's wait
    exec_times: list[float] = field(default_factory=list)  # per batch: its execution time
    dropped: int = 0
    timeouts: int = 0
    busy: float = 0.0  # executor-seconds, summed over replicas
    span: float = 0.0  # first arrival to last completion (or arrival)
    replicas: int = 1

    @property
    def failed(self) -> int:
        return self.dropped + self.timeouts

    def latency_quantile(self, quantile: float = 0.99) -> float:
        """Quantile over all requests; dropped and timed-out ones count as infinitely late."""
        values = sorted(self.latencies) + [math.inf] * self.failed
        return nearest_rank(values, quantile)

    def queue_age_quantile(self, quantile: float = 0.99) -> float:
        """Quantile of queue wait at dispatch over requests; dropped/timed-out count as infinite."""
        values = sorted(self.queue_waits)
        values += [math.inf] * (self.requests - len(values))
        return nearest_rank(values, quantile)

    @property
    def mean_batch_size(self) -> float:
        return sum(self.batch_sizes) / len(self.batch_sizes) if self.batch_sizes else 0.0

    @property
    def utilization(self) -> float:
        """Fraction of executor time busy, averaged over replicas, over the run's span."""
        if self.span <= 0:
            return 0.0
        return self.busy / (self.span * self.replicas)

    @property
    def throughput(self) -> float:
        """Requests served (in time) per second of span."""
        return len(self.latencies) / self.span if self.span > 0 else 0.0

    def summary(self, quantile: float = 0.99) -> dict[str, float | int]:
        lat = sorted(self.latencies)
        return {
            "requests": self.requests,
            "p50_latency_s": nearest_rank(lat, 0.5),
            "p99_latency_s": self.latency_quantile(quantile),
            "p99_queue_age_s": self.queue_age_quantile(quantile),
            "max_queue_age_s": max(self.oldest_ages, default=0.0),
            "mean_batch_size": self.mean_batch_size,
            "batches": len(self.batch_sizes),
            "utilization": self.utilization,
            "throughput_rps": self.throughput,
            "dropped": self.dropped,
            "timeouts": self.timeouts,
        }


def split_arrivals(
    arrivals: Sequence[float], replicas: int, split: Split = "random", seed: int = 0
) -> list[list[float]]:
    """Each request to one replica; the choice depends only on the request's index."""
    if replicas < 1:
        raise ValueError("replicas must be at least 1")
    if replicas == 1:
        return [list(arrivals)]
    parts: list[list[float]] = [[] for _ in range(replicas)]
    if split == "round-robin":
        for idx, t in enumerate(arrivals):
            parts[idx % replicas].append(t)
    else:
        rng = random.Random(seed)
        for t in arrivals:
            parts[rng.randrange(replicas)].append(t)
    return parts


def front_end(arrivals: Sequence[float], cost: float) -> list[float]:
    """When the pod's HTTP loop starts on each request (FIFO, ``cost`` seconds each): the instant
    the request reaches the batcher. Equal to the arrivals when the loop keeps up."""
    out: list[float] = []
    free = -math.inf
    for a in arrivals:
        start = a if a > free else free
        out.append(start)
        free = start + cost
    return out


class _NeedsExact(Exception):
    """The fast engine met a drop or an expiry; the exact engine must take over."""


def check_table(settings: LaneSettings, exec_table: Sequence[float]) -> None:
    if len(exec_table) <= settings.max_batch_size:
        raise ValueError(
            f"exec_table covers batch sizes up to {len(exec_table) - 1}, settings need {settings.max_batch_size}"
        )


@dataclass(frozen=True)
class RequestRecord:
    """One request's fate in :func:`simulate_requests`: ``outcome`` is ``ok``,
    ``rejected_full`` (dropped at admission) or ``timed_out``; ``latency`` (None when
    dropped) and ``queue_age`` (dispatch - arrival; the timeout when timed out; None when
    dropped) in seconds; ``done`` is when the runtime answered."""

    arrival: float
    outcome: Literal["ok", "rejected_full", "timed_out"]
    latency: float | None
    queue_age: float | None

    @property
    def done(self) -> float:
        return self.arrival + (self.latency or 0.0)


def exact_replica(
    arr: Sequence[float],
    s: LaneSettings,
    ex: Sequence[float],
    overhead: float,
    out: SimResult,
    scale: Sequence[float] | None = None,
    records: list[RequestRecord] | None = None,
    *,
    delay: float = 0.0,
    origin: Sequence[float] | None = None,
) -> float:
    """Event-by-event engine for one replica: the runtime's own :class:`Scheduler` (admission,
    readiness, batch forming, timeouts at the cut) on a simulated clock, stepped the way its
    ``BatchWorker`` steps it: the next batch is cut at ``max(ready, model free) + delay``,
    after every arrival up to that instant. Returns the replica's last event time. With
    ``records``, every request's fate is appended to it as well. ``arr`` are the instants the
    requests reach the batcher; ``origin`` (default ``arr``) their arrivals at the pod, where
    latency counts from (:func:`front_end`)."""
    TO = s.request_timeout
    sched = Scheduler([_lane_config(s)])
    lane = sched.lanes[0]
    timers: deque[Pending] = deque()  # admitted requests in arrival order: their timeouts fire in it
    free = -math.inf
    nxt = 0
    n = len(arr)
    last = arr[-1] if n else 0.0

    def timed_out(p: Pending) -> None:
        out.timeouts += 1
        out.queue_waits.append(TO)
        if records is not None:
            records.append(RequestRecord(p.data, "timed_out", p.arrival - p.data + TO + overhead, TO))

    def fire_timers(at: float) -> None:
        # The runtime's per-request timer: a request still queued at arrival + timeout leaves.
        while timers and (timers[0].state is not State.QUEUED or timers[0].arrival + TO <= at):
            p = timers.popleft()
            if sched.withdraw(p, State.TIMED_OUT):
                timed_out(p)

    while nxt < n or lane.live_count:
        ready = sched.ready_at(lane)
        head = lane.head()
        if ready is None or head is None:
            t = expiry = math.inf
        else:
            t = max(ready, free) + delay
            expiry = head.arrival + TO
        if nxt < n and arr[nxt] <= t and arr[nxt] < expiry:
            # An arrival comes first (or at the cut's instant): admitted, or refused when full.
            x = arr[nxt]
            o = x if origin is None else origin[nxt]
            nxt += 1
            fire_timers(x)
            p = Pending(o, 0, x, rows=1)  # its data: the arrival at the pod, where latency counts from
            try:
                sched.admit(p)
            except QueueFull:
                out.dropped += 1
                if records is not None:
                    records.append(RequestRecord(o, "rejected_full", None, None))
                continue
            timers.append(p)
            continue
        if expiry <= t:
            fire_timers(expiry)  # the head's timer fires before its batch could go (takes at least it)
            continue
        # The cut at t: the scheduler's batch (the oldest rows, at most max_batch_size).
        members, expired = sched.take(lane, t)
        for p in expired:
            timed_out(p)
        if not members:
            continue
        size = len(members)
        e = ex[size] if scale is None else ex[size] * scale[len(out.batch_sizes) % len(scale)]
        done = t + e
        out.batch_sizes.append(size)
        out.oldest_ages.append(t - members[0].arrival)
        out.exec_times.append(e)
        out.busy += e
        for p in members:
            a = p.arrival
            out.queue_waits.append(t - a)
            out.latencies.append(done - p.data + overhead)
            if records is not None:
                records.append(RequestRecord(p.data, "ok", done - p.data + overhead, t - a))
        free = done
        last = max(last, done)
    return last


def _lane_config(s: LaneSettings) -> LaneConfig:
    """The runtime's lane config for the simulated lane (built unvalidated: a simulation may
    explore settings the CRD would refuse, an infinite timeout among them)."""
    return LaneConfig.model_construct(name="simulated", priority=0, **{f.name: getattr(s, f.name) for f in fields(s)})


def _fast_replica(
    arr: Sequence[float],
    s: LaneSettings,
    ex: Sequence[float],
    overhead: float,
    out: SimResult,
    scale: Sequence[float] | None = None,
    *,
    delay: float = 0.0,
    origin: Sequence[float] | None = None,
) -> float:
    """Batch-by-batch engine for one replica; raises _NeedsExact on a drop or an expiry.
    ``origin``: as for :func:`exact_replica`."""
    org = arr if origin is None else origin
    B, W, L, TO = s.max_batch_size, s.max_queue_delay, s.max_queue_length, s.request_timeout
    n = len(arr)
    i = 0
    free = -math.inf
    last = arr[-1] if n else 0.0
    br = bisect.bisect_right
    sizes = out.batch_sizes
    waits = out.queue_waits
    lats = out.latencies
    oldest = out.oldest_ages
    execs = out.exec_times
    busy = 0.0
    while i < n:
        a0 = arr[i]
        due = a0 + W
        if i + B - 1 < n:
            fill = arr[i + B - 1]
            if fill < due:
                due = fill
        t = (free if free > due else due) + delay
        if i + L < n and arr[i + L] <= t:
            raise _NeedsExact  # L rows waited and one more arrived: a drop
        if a0 + TO <= t:
            raise _NeedsExact  # the oldest row's timer fired before its batch went
        hi = i + B if i + B < n else n
        j = br(arr, t, i, hi)
        size = j - i
        e = ex[size] if scale is None else ex[size] * scale[len(sizes) % len(scale)]
        done = t + e
        busy += e
        execs.append(e)
        sizes.append(size)
        oldest.append(t - a0)
        for k in range(i, j):
            waits.append(t - arr[k])
            lats.append(done - org[k] + overhead)
        free = done
        i = j
    out.busy += busy
    return max(last, free)


def simulate(
    arrivals: Sequence[float],
    settings: LaneSettings,
    exec_table: Sequence[float],
    replicas: int = 1,
    split: Split = "random",
    seed: int = 0,
    request_overhead: float = 0.0,
    engine: Literal["auto", "exact"] = "auto",
    exec_scale: Sequence[float] | None = None,
    dispatch_delay: float = 0.0,
    front_end_cost: float = 0.0,
) -> SimResult:
    """Run the lane over ``arrivals`` (sorted seconds) and return every measurement.

    ``exec_scale`` (optional) multiplies the k-th batch's execution time of each replica by
    ``exec_scale[k % len(exec_scale)]``: pre-drawn noise, for studying how a heavier tail of
    forward times than the profile's moves the prediction (bench/tune_validation.py does).

    ``dispatch_delay`` (seconds) delays every dispatch past ``max(due, executor free)``: the
    runtime's measured batch cut delay (``batchpilot_batch_cut_delay_seconds``; the event loop
    and the model thread sharing few cores), carried in a profile as ``dispatchDelay``. Rows
    arriving during the delay join the batch, as they do in the runtime.

    ``front_end_cost`` (seconds of the HTTP loop per request, the profile's ``frontEndCost``):
    each replica's requests reach its batcher through its loop (:func:`front_end`).
    """
    check_table(settings, exec_table)
    result = SimResult(requests=len(arrivals), replicas=replicas)
    last = arrivals[-1] if arrivals else 0.0
    for part in split_arrivals(arrivals, replicas, split, seed):
        if not part:
            continue
        handled, origin = (front_end(part, front_end_cost), part) if front_end_cost > 0 else (part, None)
        args = (handled, settings, exec_table, request_overhead)
        scratch = SimResult(requests=len(part))
        end: float | None = None
        if engine == "auto":
            try:
                end = _fast_replica(*args, scratch, exec_scale, delay=dispatch_delay, origin=origin)
            except _NeedsExact:
                scratch = SimResult(requests=len(part))
        if end is None:
            end = exact_replica(*args, scratch, exec_scale, delay=dispatch_delay, origin=origin)
        result.latencies += scratch.latencies
        result.queue_waits += scratch.queue_waits
        result.batch_sizes += scratch.batch_sizes
        result.oldest_ages += scratch.oldest_ages
        result.exec_times += scratch.exec_times
        result.dropped += scratch.dropped
        result.timeouts += scratch.timeouts
        result.busy += scratch.busy
        last = max(last, end)
    result.span = last - (arrivals[0] if arrivals else 0.0)
    return result


def simulate_requests(
    arrivals: Sequence[float],
    settings: LaneSettings,
    exec_table: Sequence[float],
    request_overhead: float = 0.0,
    exec_scale: Sequence[float] | None = None,
    engine: Literal["auto", "exact"] = "auto",
    front_end_cost: float = 0.0,
) -> list[RequestRecord]:
    """One replica, request by request: every request's outcome, latency and queue age. For
    studies that need the time structure (bench/canary_eval.py windows them as Prometheus
    would). The exact engine lists them in the order the runtime answered them; ``auto``
    walks batch by batch when nothing is dropped or timed out (every request is then served,
    in arrival order, with the same latencies) and replays exactly otherwise. With
    ``front_end_cost``, requests reach the batcher through the HTTP loop (:func:`front_end`)."""
    check_table(settings, exec_table)
    handled, origin = (front_end(arrivals, front_end_cost), arrivals) if front_end_cost > 0 else (arrivals, None)
    if engine == "auto":
        scratch = SimResult(len(arrivals))
        try:
            _fast_replica(handled, settings, exec_table, request_overhead, scratch, exec_scale, origin=origin)
        except _NeedsExact:
            pass
        else:
            return [
                RequestRecord(a, "ok", lat, wait)
                for a, lat, wait in zip(arrivals, scratch.latencies, scratch.queue_waits, strict=True)
            ]
    records: list[RequestRecord] = []
    exact_replica(
        handled, settings, exec_table, request_overhead, SimResult(len(arrivals)), exec_scale, records, origin=origin
    )
    return records


def simulate_exact(
    arrivals: Sequence[float],
    settings: LaneSettings,
    exec_table: Sequence[float],
    replicas: int = 1,
    split: Split = "random",
    seed: int = 0,
    request_overhead: float = 0.0,
    exec_scale: Sequence[float] | None = None,
    dispatch_delay: float = 0.0,
    front_end_cost: float = 0.0,
) -> SimResult:
    """The event-by-event engine only (the reference the fast engine is tested against)."""
    return simulate(
        arrivals,
        settings,
        exec_table,
        replicas,
        split,
        seed,
        request_overhead,
        "exact",
        exec_scale,
        dispatch_delay,
        front_end_cost,
    )
