"""Unit tests of the batcher's pure scheduling logic (fake clock, no threads)."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

from batchpilot_runtime.batcher import BatchWorker
from batchpilot_runtime.config import LaneConfig
from batchpilot_runtime.scheduler import Batch, Pending, QueueFull, Scheduler, State


def cfg(name: str, max_batch: int = 4, delay: float = 0.01, queue: int = 100, timeout: float = 100.0,
        priority: int = 0) -> LaneConfig:  # fmt: skip
    return LaneConfig(
        name=name, max_batch_size=max_batch, max_queue_delay=delay, max_queue_length=queue,
        request_timeout=timeout, priority=priority,
    )  # fmt: skip


def req(lane: int, t: float, rows: int = 1, marker: float = 0.0) -> Pending:
    return Pending(np.full((rows, 2), marker, dtype=np.float32), lane, t)


def markers(batch: list[Pending]) -> list[float]:
    return [float(p.data[0, 0]) for p in batch]


def test_waits_for_window_then_dispatches_partial_batch() -> None:
    s = Scheduler([cfg("a", delay=0.01)])
    s.admit(req(0, 0.0, marker=1))
    assert s.select(0.005) == (None, pytest.approx(0.01))
    lane, _ = s.select(0.01)
    assert lane is s.lanes[0]
    batch, expired = s.take(lane, 0.01)
    assert markers(batch) == [1] and expired == []
    assert batch[0].state is State.DISPATCHED and batch[0].dispatched_at == 0.01
    assert s.select(0.02) == (None, None)


def test_full_lane_dispatches_at_once_and_never_splits_requests() -> None:
    s = Scheduler([cfg("a", max_batch=4, delay=10.0)])
    for m, rows in [(1, 1), (2, 2), (3, 2), (4, 3)]:
        s.admit(req(0, 0.0, rows=rows, marker=m))
    lane, _ = s.select(0.0)
    assert lane is not None
    assert markers(s.take(lane, 0.0)[0]) == [1, 2]  # 1+2 rows; the next (2 rows) would overflow
    assert s.lanes[0].live_rows == 5
    lane, _ = s.select(0.0)
    assert lane is not None  # 5 rows queued >= 4: still full
    assert markers(s.take(lane, 0.0)[0]) == [3]
    assert s.select(0.0)[0] is None  # 3 rows left, window not expired


def test_queue_bound_counts_live_requests() -> None:
    s = Scheduler([cfg("a", queue=2)])
    a, b = req(0, 0.0), req(0, 0.0)
    s.admit(a)
    s.admit(b)
    with pytest.raises(QueueFull, match="queue is full"):
        s.admit(req(0, 0.0))
    assert s.withdraw(a, State.TIMED_OUT)
    assert not s.withdraw(a, State.CANCELLED)  # exactly one transition
    s.admit(req(0, 0.0))  # room again
    assert s.depth_rows() == {"a": 2}


def test_stale_entries_are_compacted_so_memory_stays_bounded() -> None:
    s = Scheduler([cfg("a", queue=4)])
    for _ in range(1000):
        p = req(0, 0.0)
        s.admit(p)
        s.withdraw(p, State.CANCELLED)
    assert len(s.lanes[0].queue) <= 2 * 4 + 17


def test_expired_requests_are_not_dispatched() -> None:
    s = Scheduler([cfg("a", delay=0.01, timeout=0.5)])
    s.admit(req(0, 0.0, marker=1))
    s.admit(req(0, 0.6, marker=2))
    lane, _ = s.select(0.61)
    assert lane is not None
    batch, expired = s.take(lane, 0.61)
    assert markers(batch) == [2]
    assert markers(expired) == [1] and expired[0].state is State.TIMED_OUT


def test_priority_with_bounded_skips() -> None:
    s = Scheduler([cfg("bg", max_batch=1, priority=0), cfg("hi", max_batch=1, priority=10)], max_skips=2)
    for i in range(6):
        s.admit(req(1, 0.0, marker=100 + i))
    s.admit(req(0, 0.0, marker=1))
    order = []
    while True:
        lane, _ = s.select(1.0)
        if lane is None:
            break
        order.extend(markers(s.take(lane, 1.0)[0]))
    assert order == [100, 101, 1, 102, 103, 104, 105]


def test_equal_priority_serves_oldest_first() -> None:
    s = Scheduler([cfg("a", max_batch=1), cfg("b", max_batch=1)])
    s.admit(req(1, 0.0, marker=2))
    s.admit(req(0, 0.1, marker=1))
    lane, _ = s.select(1.0)
    assert lane is not None and lane.name == "b"


def test_flush_dispatches_without_waiting() -> None:
    s = Scheduler([cfg("a", delay=10.0)])
    s.admit(req(0, 0.0))
    assert s.select(0.0)[0] is None
    assert s.select(0.0, flush=True)[0] is not None


def test_worker_fails_one_batch_and_continues() -> None:
    results: list[tuple[list[float], Any, str | None]] = []
    done = threading.Event()

    def run(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        if (x[:, 0] < 0).any():
            raise ValueError("negative")
        return x * 2

    def deliver(batch: Batch, out: Any, err: BaseException | None, exec_s: float) -> None:
        results.append(
            (markers(batch.requests), None if out is None else out[:, 0].tolist(), str(err) if err else None)
        )
        if len(results) == 2:
            done.set()

    w = BatchWorker([cfg("a", max_batch=2, delay=5.0)], run, deliver, lambda _: None)
    w.start()
    for m in (-1.0, 2.0, 3.0, 4.0):
        w.submit(req(0, time.perf_counter(), marker=m))
    assert done.wait(10)
    w.stop()
    w.join(5)
    assert results == [([-1.0, 2.0], None, "negative"), ([3.0, 4.0], [6.0, 8.0], None)]
