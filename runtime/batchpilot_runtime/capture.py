"""What the runtime records about its own traffic and hardware, for the tuner.

* :class:`ArrivalRing`: the recent arrivals of one lane (arrival time and rows of each
  *admitted* request) in a preallocated ring, bounded by count (``capacity``; the oldest entry
  is overwritten) and by age (entries older than ``max_age`` seconds are never served). Memory
  is fixed at start: 12 bytes per slot (a float64 time and an int32 row count), so the default
  65,536 slots cost 768 KiB per lane (2.25 MiB with the outcomes below). Recording is two array stores and an increment on the
  event loop (no lock: only the loop writes, and snapshots run on the loop too).
* :class:`OutcomeRing`: what became of the same lane's admitted requests (arrival time, latency
  as the server measured it, queue wait at dispatch, its batch's pass and the answer's hand-off
  to the event loop; a request that timed out or failed has latency, pass and hand-off -1),
  recorded when each is answered, with the same bounds (24 bytes a slot). The operator compares
  them with what the tuner's model predicts for the same arrivals: the model's measured error
  (:mod:`batchpilot_operator.tune.calibration`); the pass and hand-off tell a slow pass or loop
  from a wrong queue.
* :class:`LiveProfile`: forward time per batch size, from timed passes at warm-up and from
  live batches (the last ``per_size`` samples of each size), rendered in the format
  ``batchpilot profile`` writes (a ``LatencyProfile``), so the profile comes from the hardware
  the pod really runs on.
* :class:`RecentDurations`, of two kinds. Batch cut delays: how late each batch was cut
  compared with the dispatch rule (``max(due, model free)``, what the tuner's simulator
  assumes), the load-dependent delay when the event loop and the worker thread share few
  cores; exported as the histogram ``batchpilot_batch_cut_delay_seconds`` and summarised in the
  arrivals document. Request overhead: each served request's latency less its queue wait and
  its batch's forward time (parsing, the hand-offs, the answer), whose mean is the profile's
  ``requestOverhead``.
* :class:`Capture`: one per runtime process; serves ``GET /admin/arrivals`` and
  ``GET /admin/profile`` on the metrics/admin side (next to ``/metrics``, not under ``/v2``).

Times are ``time.perf_counter()`` on the hot path; a snapshot converts them to Unix seconds
with one offset taken at snapshot time, so documents from several pods merge on wall time.
"""

from __future__ import annotations

import math
import os
import statistics
import threading
import time
from array import array
from collections import deque
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import numpy as np

from batchpilot_runtime.config import LaneConfig, RuntimeConfig, format_duration

DEFAULT_CAPACITY = 65_536
DEFAULT_MAX_AGE = 3600.0
PROFILE_SAMPLES_PER_SIZE = 256
WARMUP_PASSES = 3
"""Timed passes per warm batch size at start-up (after the untimed warm-up pass)."""
RECENT_SAMPLES = 4096
ARRIVAL_SLOT_BYTES = 12
OUTCOME_SLOT_BYTES = 24
SLOT_BYTES = ARRIVAL_SLOT_BYTES + OUTCOME_SLOT_BYTES
"""Bytes per slot of one lane: its arrival and its outcome."""
FAILED = -1.0
"""Latency recorded for a request that was admitted but not served (timed out, failed)."""
CAPTURE_API_VERSION = "batchpilot.dev/v1alpha1"
ARRIVALS_KIND = "ArrivalCapture"


class ArrivalRing:
    """A fixed-size ring of (arrival time, rows), bounded by count and by age."""

    __slots__ = ("capacity", "max_age", "rows", "times", "total")

    def __init__(self, capacity: int = DEFAULT_CAPACITY, max_age: float = DEFAULT_MAX_AGE) -> None:
        if capacity < 1:
            raise ValueError(f"arrival ring capacity must be at least 1, got {capacity}")
        if not max_age > 0:
            raise ValueError(f"arrival ring max age must be positive, got {max_age}")
        self.capacity = capacity
        self.max_age = max_age
        self.times = array("d", bytes(8 * capacity))
        self.rows = array("i", bytes(4 * capacity))
        self.total = 0  # arrivals recorded since start (the next slot is total % capacity)

    def record(self, t: float, rows: int) -> None:
        i = self.total % self.capacity
        self.times[i] = t
        self.rows[i] = rows
        self.total += 1

    @property
    def nbytes(self) -> int:
        return self.times.itemsize * len(self.times) + self.rows.itemsize * len(self.rows)

    @property
    def overwritten(self) -> int:
        """Arrivals lost to the count bound since start."""
        return max(0, self.total - self.capacity)

    def snapshot(self, now: float, since: float | None = None) -> tuple[list[float], list[int]]:
        """Held arrivals no older than ``max_age`` (and than ``since`` seconds), oldest first."""
        times, rows = self.snapshot_arrays(now, since)
        return times.tolist(), rows.tolist()

    def snapshot_arrays(
        self, now: float, since: float | None = None
    ) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        """:meth:`snapshot` as numpy arrays (float64 times, int32 rows)."""
        times, rows = _held(self.total, self.capacity, self.times, self.rows)
        keep = times >= _horizon(now, self.max_age, since)
        return times[keep], rows[keep]


def _seconds(values: np.ndarray[Any, Any]) -> list[float]:
    return list(np.round(values.astype(np.float64), 6).tolist())


def _horizon(now: float, max_age: float, since: float | None) -> float:
    """The oldest time a snapshot serves: ``max_age`` ago, or ``since`` ago if that is later."""
    return now - max_age if since is None else max(now - max_age, now - since)


def _held(total: int, capacity: int, *buffers: array[Any]) -> list[np.ndarray[Any, Any]]:
    """The held slots of a ring's parallel ``buffers``, oldest first, as numpy copies
    (vectorised: a snapshot of a full ring takes a few ms on the event loop, not a Python loop
    over 65,536 slots)."""
    n = min(total, capacity)
    first = (total - n) % capacity
    views = [np.frombuffer(b, dtype=np.dtype(b.typecode)) for b in buffers]
    if first + n <= capacity:
        return [v[first : first + n].copy() for v in views]
    return [np.concatenate((v[first:], v[: first + n - capacity])) for v in views]


class OutcomeRing:
    """A fixed-size ring of (arrival time, latency, queue wait, pass, hand-off) of answered
    requests: the latency's parts after the batch is cut, its batch's forward pass and the time
    the answer then took to reach the request's handler on the event loop (what a profile's
    pass time cannot say of a loaded machine: docs/tuning.md "Where the demo's windows miss");
    both :data:`FAILED` for a request that was not served."""

    __slots__ = ("arrivals", "capacity", "handoffs", "latencies", "max_age", "passes", "total", "waits")

    def __init__(self, capacity: int = DEFAULT_CAPACITY, max_age: float = DEFAULT_MAX_AGE) -> None:
        if capacity < 1:
            raise ValueError(f"outcome ring capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self.max_age = max_age
        self.arrivals = array("d", bytes(8 * capacity))
        self.latencies = array("f", bytes(4 * capacity))
        self.waits = array("f", bytes(4 * capacity))
        self.passes = array("f", bytes(4 * capacity))
        self.handoffs = array("f", bytes(4 * capacity))
        self.total = 0

    def record(
        self, arrival: float, latency: float, wait: float, pass_s: float = FAILED, handoff: float = FAILED
    ) -> None:
        i = self.total % self.capacity
        self.arrivals[i] = arrival
        self.latencies[i] = latency
        self.waits[i] = wait
        self.passes[i] = pass_s
        self.handoffs[i] = handoff
        self.total += 1

    @property
    def nbytes(self) -> int:
        return sum(a.itemsize * len(a) for a in self._buffers())

    def _buffers(self) -> tuple[array[Any], ...]:
        return (self.arrivals, self.latencies, self.waits, self.passes, self.handoffs)

    def snapshot_arrays(self, now: float, since: float | None = None) -> list[np.ndarray[Any, Any]]:
        """Held outcomes whose request arrived no earlier than ``max_age`` (and ``since``) ago,
        in arrival order: arrivals, latencies, queue waits, passes, hand-offs."""
        held = _held(self.total, self.capacity, *self._buffers())
        keep = held[0] >= _horizon(now, self.max_age, since)
        held = [a[keep] for a in held]
        by_arrival = np.argsort(held[0], kind="stable")
        return [a[by_arrival] for a in held]


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank quantile of sorted values (the simulator's definition)."""
    k = max(0, math.ceil(q * len(sorted_values) - 1e-9) - 1)
    return sorted_values[k]


def _warmup_scale(warm: dict[int, list[float]], live: dict[int, list[float]], min_live: int) -> float | None:
    """How much slower a pass runs now than it did at warm-up: the median over the batch sizes
    with both warm-up passes and ``min_live`` live batches of live median / warm-up median
    (None: no such size yet). Warm-up passes are timed at start-up, one size after another,
    often beside other pods starting, or on an idle machine that serving later keeps busy:
    their level is that moment's, not the pod's."""
    ratios = []
    for size, passes in warm.items():
        timed = statistics.median(passes) if passes else 0.0
        if timed > 0 and len(live.get(size, ())) >= min_live:
            ratios.append(statistics.median(live[size]) / timed)
    return statistics.median(ratios) if ratios else None


class LiveProfile:
    """Forward time per batch size from warm-up and live batches (bounded per size)."""

    def __init__(self, per_size: int = PROFILE_SAMPLES_PER_SIZE) -> None:
        self.per_size = per_size
        self.warmup: dict[int, list[float]] = {}
        self.live: dict[int, deque[float]] = {}
        self.live_batches = 0
        self._lock = threading.Lock()  # the worker thread adds, the event loop reads

    def add_warmup(self, rows: int, seconds: float) -> None:
        with self._lock:
            self.warmup.setdefault(rows, []).append(seconds)

    def add_live(self, rows: int, seconds: float) -> None:
        with self._lock:
            d = self.live.get(rows)
            if d is None:
                d = self.live[rows] = deque(maxlen=self.per_size)
            d.append(seconds)
            self.live_batches += 1

    def samples(self) -> tuple[dict[int, list[float]], dict[int, list[float]]]:
        with self._lock:
            return {k: list(v) for k, v in self.warmup.items()}, {k: list(v) for k, v in self.live.items()}

    def warmup_scale(self, min_live: int = 20) -> float | None:
        """How much slower a pass runs now than it did at warm-up (see :func:`_warmup_scale`)."""
        return _warmup_scale(*self.samples(), min_live)

    def points(self, min_live: int = 20) -> list[dict[str, Any]]:
        """One point per batch size (see :meth:`snapshot`)."""
        return self.snapshot(min_live)[0]

    def snapshot(self, min_live: int = 20) -> tuple[list[dict[str, Any]], float | None]:
        """One point per batch size: live samples when there are ``min_live``, else warm-up and live,
        the warm-up passes scaled by :func:`_warmup_scale` to the level the live batches run at now
        (the sizes the pod serves seldom or never, past its lanes' maxima among them); and that
        scale, from the same samples (None: not measured yet)."""
        out: list[dict[str, Any]] = []
        warm, live_all = self.samples()
        measured = _warmup_scale(warm, live_all, min_live)
        scale = measured or 1.0
        for size in sorted(set(warm) | set(live_all)):
            live = live_all.get(size, [])
            xs = live if len(live) >= min_live else [*(x * scale for x in warm.get(size, ())), *live]
            if not xs:
                continue
            xs.sort()
            # The profile format holds microseconds; keep every value positive and ordered.
            p50 = max(_quantile(xs, 0.5), 1e-6)
            p90 = max(_quantile(xs, 0.9), p50)
            p99 = max(_quantile(xs, 0.99), p90)
            out.append(
                {
                    "batchSize": size,
                    "p50": format_duration(p50),
                    "p90": format_duration(p90),
                    "p99": format_duration(p99),
                    "mean": format_duration(max(statistics.fmean(xs), 1e-6)),
                    "samples": len(xs),
                    "source": "live" if len(live) >= min_live else ("warmup+live" if live else "warmup"),
                }
            )
        return out, measured


class RecentDurations:
    """The last ``keep`` values of one duration (seconds), for a summary: batch cut delays (their
    histogram is in metrics), the time requests spend outside the queue and the model."""

    def __init__(self, keep: int = RECENT_SAMPLES) -> None:
        self.samples: deque[float] = deque(maxlen=keep)
        self.total = 0

    def add(self, seconds: float) -> None:
        self.samples.append(seconds)
        self.total += 1

    def summary(self) -> dict[str, Any]:
        xs = sorted(list(self.samples))
        if not xs:
            return {"samples": 0}
        return {
            "samples": len(xs),
            "p50": _quantile(xs, 0.5),
            "p90": _quantile(xs, 0.9),
            "p99": _quantile(xs, 0.99),
            "mean": statistics.fmean(xs),
        }


class FrontEndMeter:
    """CPU seconds the server process spends per request on its HTTP loop: the simulator's
    ``frontEndCost``. The loop answers one request at a time, so a burst above ``1 / cost``
    requests per second queues before the batcher.

    The process's CPU time is read at window boundaries (a window closes at the first request,
    scrape or profile read at least ``window`` seconds after it opened; an idle spell is one long
    window). Its CPU has three parts: an idle rate (timers, scrapes: the median CPU per second of
    the windows without requests), a cost per request (the loop: read, decode, answer) and a cost
    per batch (the worker thread: gathering the rows, the hand-off to the model process; on this
    runtime as large as a request's), so the CPU per request falls as batches fill: 1.4 ms at
    batch 1, 0.25 ms at batches of 64 (bench/results/front_end.json). A single ratio measured at a
    trickle would state the first and bound a pod at high load to a fifth of what it serves.
    The cost per request is the least-squares split of the windows' CPU beyond the idle rate into
    the two parts, and it is stated only when the windows' batch fill varied enough to tell them
    apart (a pod that only ever ran batches of one cannot): otherwise None, not modelled."""

    def __init__(
        self,
        window: float = 1.0,
        keep: int = 600,
        min_requests: int = 200,
        cpu: Any = time.process_time,
        min_spread: float = 0.05,
    ) -> None:
        self.window = window
        self.min_requests = min_requests
        self.min_spread = min_spread
        self._cpu = cpu
        # (seconds, cpu seconds, requests, batches) per closed window
        self.windows: deque[tuple[float, float, int, int]] = deque(maxlen=keep)
        self._opened: tuple[float, float] | None = None
        self._requests = 0
        self._batches = 0
        self.total = 0

    def tick(self, now: float) -> None:
        """Close the open window if it is old enough (cheap: one clock read per call when not)."""
        if self._opened is None:
            self._opened = (now, self._cpu())
            return
        start, cpu0 = self._opened
        if now - start < self.window:
            return
        cpu = self._cpu()
        self.windows.append((now - start, cpu - cpu0, self._requests, self._batches))
        self._opened = (now, cpu)
        self._requests = 0
        self._batches = 0

    def count(self, now: float) -> None:
        """One request answered (any status: a rejection costs the loop too)."""
        self.tick(now)
        self._requests += 1
        self.total += 1

    def count_batch(self) -> None:
        """One batch run (the worker thread; an int add under the GIL)."""
        self._batches += 1

    def split(self) -> tuple[float, float] | None:
        """(CPU seconds per request, per batch), or None before ``min_requests`` requests in
        closed windows or when their batch fill did not vary enough to tell the two apart."""
        idle = sorted(c / d for d, c, n, _ in self.windows if n == 0 and d > 0)
        idle_rate = _quantile(idle, 0.5) if idle else 0.0
        busy = [(n, k, c - idle_rate * d) for d, c, n, k in self.windows if n > 0]
        if sum(n for n, _, _ in busy) < self.min_requests:
            return None
        snn = sum(n * n for n, _, _ in busy)
        skk = sum(k * k for _, k, _ in busy)
        snk = sum(n * k for n, k, _ in busy)
        sny = sum(n * y for n, _, y in busy)
        sky = sum(k * y for _, k, y in busy)
        det = snn * skk - snk * snk
        if skk == 0 or det <= self.min_spread * snn * skk:  # requests and batches in lockstep
            return None
        per_request = (skk * sny - snk * sky) / det
        per_batch = (snn * sky - snk * sny) / det
        if per_batch < 0:
            return max(sny / snn, 0.0), 0.0
        if per_request < 0:
            return 0.0, max(sky / skk, 0.0)
        return per_request, per_batch

    def cost(self) -> float | None:
        """CPU seconds of the HTTP loop per request (:meth:`split`'s first part)."""
        got = self.split()
        return None if got is None else got[0]


def capture_bounds_from_env() -> tuple[int, float]:
    """(capacity, max age) from ``BATCHPILOT_ARRIVAL_CAPACITY`` / ``BATCHPILOT_ARRIVAL_MAX_AGE``.

    A capacity of 0 turns arrival capture off (for A/B benchmarks).
    """
    raw_cap = os.environ.get("BATCHPILOT_ARRIVAL_CAPACITY", str(DEFAULT_CAPACITY))
    raw_age = os.environ.get("BATCHPILOT_ARRIVAL_MAX_AGE", str(DEFAULT_MAX_AGE))
    try:
        cap = int(raw_cap)
        age = float(raw_age)
    except ValueError as exc:
        raise ValueError(
            f"BATCHPILOT_ARRIVAL_CAPACITY must be an integer and BATCHPILOT_ARRIVAL_MAX_AGE a number of "
            f"seconds, got {raw_cap!r} and {raw_age!r}"
        ) from exc
    if cap < 0 or not age > 0:
        raise ValueError(f"arrival capture bounds must be capacity >= 0 and max age > 0, got {cap}, {age}")
    return cap, age


def _wall(t_perf: float, offset: float) -> float:
    return t_perf + offset


class Capture:
    """Arrival rings of every lane, the live profile and the cut delays of one runtime process."""

    def __init__(
        self,
        cfg: RuntimeConfig,
        track: str,
        capacity: int = DEFAULT_CAPACITY,
        max_age: float = DEFAULT_MAX_AGE,
        clock: Any = time.perf_counter,
        wall: Any = time.time,
    ) -> None:
        self.cfg = cfg
        self.track = track
        self.enabled = capacity > 0
        self.rings = [ArrivalRing(capacity, max_age) for _ in cfg.lanes] if self.enabled else []
        self.outcomes = [OutcomeRing(capacity, max_age) for _ in cfg.lanes] if self.enabled else []
        self.capacity = capacity
        self.max_age = max_age
        self.profile = LiveProfile()
        self.cut = [RecentDurations() for _ in cfg.lanes]
        self.overhead = RecentDurations()  # per served request: latency - queue wait - its batch's forward time
        self.front_end = FrontEndMeter()
        self.started = wall()
        self._clock = clock
        self._wall = wall
        self.model: dict[str, Any] = {"name": cfg.model.name, "source": cfg.model.source, "device": cfg.model.device}

    def record(self, lane: int, t: float, rows: int) -> None:
        """One admitted request (hot path: called on the event loop after admission)."""
        if self.enabled:
            self.rings[lane].record(t, rows)

    def record_outcome(
        self, lane: int, arrival: float, latency: float, wait: float, pass_s: float = FAILED, handoff: float = FAILED
    ) -> None:
        """One admitted request answered: its latency (:data:`FAILED` when it was not served),
        its queue wait at dispatch, its batch's pass and the answer's hand-off to the event loop
        (:data:`FAILED` when not served; hot path: on the event loop, after the answer)."""
        if self.enabled:
            self.outcomes[lane].record(arrival, latency, wait, pass_s, handoff)

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.rings) + sum(r.nbytes for r in self.outcomes)

    def arrivals_doc(self, since: float | None = None, pod: str | None = None) -> dict[str, Any]:
        """The ``/admin/arrivals`` document: bounds, revision, lane settings and arrivals."""
        now = self._clock()
        offset = self._wall() - now
        now_wall = _wall(now, offset)
        span = self.max_age if since is None else min(since, self.max_age)
        window_start = max(self.started, now_wall - span)
        lanes: list[dict[str, Any]] = []
        for i, lane in enumerate(self.cfg.lanes):
            entry: dict[str, Any] = {
                "name": lane.name,
                "settings": _lane_settings(lane),
                "batchCutDelay": self.cut[i].summary(),
            }
            if self.enabled:
                ring = self.rings[i]
                times, rows = ring.snapshot_arrays(now, since)
                base = _wall(float(times[0]), offset) if len(times) else now_wall
                full = ring.total > ring.capacity and len(times) == ring.capacity
                entry |= {
                    # With the ring full, arrivals before the oldest held one may be lost: the
                    # lane's record covers only from that one on.
                    "coveredFrom": base if full else window_start,
                    "recorded": ring.total,
                    "overwritten": ring.overwritten,
                    "held": len(times),
                    "base": base,
                    # Offsets from base (seconds, microsecond resolution) keep the document small.
                    "times": np.round(times + (offset - base), 6).tolist(),
                    "rows": rows.tolist(),
                    "outcomes": self._outcomes_entry(i, now, since, offset, base),
                }
            lanes.append(entry)
        return {
            "apiVersion": CAPTURE_API_VERSION,
            "kind": ARRIVALS_KIND,
            "policy": self.cfg.policy,
            "revision": self.cfg.revision,
            "track": self.track,
            "pod": pod,
            "capturedAt": now_wall,
            "runningSince": self.started,
            "windowStart": window_start,
            "enabled": self.enabled,
            "bounds": {"capacity": self.capacity, "maxAge": self.max_age, "bytesPerLane": self.capacity * SLOT_BYTES},
            "defaultLane": self.cfg.default_lane_name,
            "lanes": lanes,
        }

    def _outcomes_entry(self, lane: int, now: float, since: float | None, offset: float, base: float) -> dict[str, Any]:
        """Answered requests of the window: arrival offsets from ``base`` (as ``times``), latency,
        queue wait, the batch's pass and the answer's hand-off to the loop in seconds (latency,
        pass and hand-off -1: admitted, not served)."""
        arrivals, latencies, waits, passes, handoffs = self.outcomes[lane].snapshot_arrays(now, since)
        return {
            "recorded": self.outcomes[lane].total,
            "times": np.round(arrivals + (offset - base), 6).tolist(),
            "latency": _seconds(latencies),
            "queueWait": _seconds(waits),
            "pass": _seconds(passes),
            "handoff": _seconds(handoffs),
        }

    def profile_doc(self, device: str, threads: int | None) -> dict[str, Any]:
        """The ``/admin/profile`` document, in the format ``batchpilot profile`` writes."""
        points, scale = self.profile.snapshot()
        model: dict[str, Any] = {
            "name": self.cfg.model.name,
            "source": self.cfg.model.source,
            "device": device,
            "dtype": self.cfg.model.dtype,
        }
        if threads is not None:
            model["threads"] = threads
        host = os.environ.get("HOSTNAME") or os.uname().nodename
        if host:
            model["host"] = host
        sources = sorted({p["source"] for p in points})
        delays = sorted(x for cut in self.cut for x in list(cut.samples))
        dispatch_delay = _quantile(delays, 0.5) if delays else 0.0
        overhead = self.overhead.summary()
        self.front_end.tick(self._clock())
        front_end = self.front_end.cost()
        return {
            "apiVersion": CAPTURE_API_VERSION,
            "kind": "LatencyProfile",
            "model": model,
            # The simulator's queue grows by the sum of its passes' times, whose expectation is the
            # mean per batch size: a tail column (p90) for every pass overstates a busy period's
            # backlog (bench/results/latency_model_grid.json measures both).
            "quantile": "mean",
            # The mean time a served request spent outside the queue and the model (parsing, the
            # hand-offs between the loop, the worker and the model process, the answer): the
            # simulator adds it to every request.
            "requestOverhead": format_duration(max(overhead["mean"], 0.0)) if overhead["samples"] else "0s",
            # The median batch cut delay over all lanes: the simulator delays every dispatch by it.
            "dispatchDelay": format_duration(dispatch_delay),
            # CPU of this process per request (absent until enough requests): the simulator's HTTP loop.
            **({"frontEndCost": format_duration(front_end)} if front_end is not None else {}),
            # The factor the warm-up passes of the points were scaled by (absent: not yet measured).
            **({"warmupScale": round(scale, 4)} if scale is not None else {}),
            "points": points,
            "measuredAt": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "note": (
                f"measured by the runtime of revision {self.cfg.revision} ({self.track}): timed passes at "
                f"warm-up and the last {self.profile.per_size} live batches per size "
                f"({self.profile.live_batches} live batches so far; points from {', '.join(sources) or 'nothing'})"
            ),
        }


def _lane_settings(lane: LaneConfig) -> dict[str, Any]:
    return lane.model_dump(mode="json", by_alias=True, exclude={"name"})
