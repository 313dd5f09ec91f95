"""Whether one setting meets the SLO at one traffic: the tuner's verdict, with early exit.

:func:`meets_slo` answers what :func:`batchpilot_operator.tune.simulator.simulate` followed by a
comparison of its quantiles with the targets would, but walks batch by batch the way the
simulator's fast engine does and stops at the first request over budget: the quantile fixes how
many requests may miss (:func:`batchpilot_operator.tune.simulator.allowed_misses`), and misses only
accumulate. Where the run would drop or time out a request it replays that replica exactly, with
the runtime's own Scheduler. ``tests/operator/test_batching_conformance.py`` holds it to the
simulator's verdict on both real traces, Poisson and on/off arrivals.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

from batchpilot_operator.tune.simulator import (
    LaneSettings,
    SimResult,
    Targets,
    allowed_misses,
    check_table,
    exact_replica,
    front_end,
)


def _fast_misses(
    arr: Sequence[float],
    s: LaneSettings,
    ex: Sequence[float],
    targets: Targets,
    overhead: float,
    budget: int,
    delay: float = 0.0,
    origin: Sequence[float] | None = None,
) -> tuple[int, int] | None:
    """Misses of one replica (latency, queue age), stopping once either passes ``budget``.

    None when the run would drop or time out a request (the caller replays it exactly).
    ``origin``: as for :func:`exact_replica` (sorted like ``arr``: the front end is FIFO, so
    the oldest row by arrival at the pod is the latest one of its batch).
    """
    org = arr if origin is None else origin
    B, W, L, TO = s.max_batch_size, s.max_queue_delay, s.max_queue_length, s.request_timeout
    t_lat = targets.latency - overhead
    t_age = targets.queue_age
    br = bisect.bisect_right
    bl = bisect.bisect_left
    m = len(arr)
    i = 0
    free = -math.inf
    lat_miss = 0
    age_miss = 0
    while i < m:
        a0 = arr[i]
        due = a0 + W
        if i + B - 1 < m:
            fill = arr[i + B - 1]
            if fill < due:
                due = fill
        t = (free if free > due else due) + delay
        if (i + L < m and arr[i + L] <= t) or a0 + TO <= t:
            return None
        hi = i + B if i + B < m else m
        j = br(arr, t, i, hi)
        done = t + ex[j - i]
        if done - org[i] > t_lat:  # the oldest row is late; count the late ones exactly
            lat_miss += bl(org, done - t_lat, i, j) - i
            if t - a0 > t_age:
                age_miss += bl(arr, t - t_age, i, j) - i
            if lat_miss > budget or age_miss > budget:
                return lat_miss, age_miss
        elif t - a0 > t_age:
            age_miss += bl(arr, t - t_age, i, j) - i
            if age_miss > budget:
                return lat_miss, age_miss
        free = done
        i = j
    return lat_miss, age_miss


def _exact_misses(
    arr: Sequence[float],
    s: LaneSettings,
    ex: Sequence[float],
    targets: Targets,
    overhead: float,
    delay: float = 0.0,
    origin: Sequence[float] | None = None,
) -> tuple[int, int]:
    sub = SimResult(requests=len(arr))
    exact_replica(arr, s, ex, overhead, sub, delay=delay, origin=origin)
    lat_miss = sum(1 for x in sub.latencies if x > targets.latency) + sub.failed
    age_miss = sum(1 for x in sub.queue_waits if x > targets.queue_age) + (len(arr) - len(sub.queue_waits))
    return lat_miss, age_miss


def meets_slo(
    parts: Sequence[Sequence[float]],
    settings: LaneSettings,
    exec_table: Sequence[float],
    targets: Targets,
    request_overhead: float = 0.0,
    dispatch_delay: float = 0.0,
    front_end_cost: float = 0.0,
) -> bool:
    """Whether p99 latency and p99 queue age stay within ``targets`` (arrivals already split).

    Same verdict as ``simulate(...)`` followed by comparing its quantiles with the targets,
    but it stops at the first request over budget: the quantile fixes how many requests
    may miss (:func:`allowed_misses`), and misses only accumulate as the run goes on.
    Dropped and timed-out requests count as misses of both targets.
    """
    check_table(settings, exec_table)
    n = sum(len(p) for p in parts)
    budget = allowed_misses(n, targets.quantile)
    lat_miss = 0
    age_miss = 0
    for arr in parts:
        if not arr:
            continue
        left = budget - max(lat_miss, age_miss)
        handled, origin = (front_end(arr, front_end_cost), arr) if front_end_cost > 0 else (arr, None)
        got = _fast_misses(handled, settings, exec_table, targets, request_overhead, left, dispatch_delay, origin)
        if got is None:
            got = _exact_misses(handled, settings, exec_table, targets, request_overhead, dispatch_delay, origin)
        lat_miss += got[0]
        age_miss += got[1]
        if lat_miss > budget or age_miss > budget:
            return False
    return True
