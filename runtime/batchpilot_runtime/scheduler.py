"""The batching rule: per-lane queues, admission, lane choice and batch forming.

:class:`Scheduler` is pure bookkeeping with an injected ``now``: it holds no lock, starts no
thread and imports no numpy, so the same code decides batches in the runtime (driven by
:class:`batchpilot_runtime.batcher.BatchWorker` on the wall clock) and in the tuner's
simulator (``batchpilot_operator.tune.simulator``, driven on a simulated clock): one rule,
not copies of it.

Dispatch rule (per lane): a lane is *ready* when its queued rows reach ``max_batch_size``
(full) or its oldest live request has waited ``max_queue_delay`` (window), or when the server
is draining (flush). A batch takes requests in FIFO order while they fit in ``max_batch_size``
rows; a request is never split across batches. A request found past its ``request_timeout``
when a batch is cut leaves unrun.

Lane choice (no starvation): among ready lanes the one with the highest ``priority`` goes
first (ties: the lane whose oldest request is older). A ready lane that has been passed over
:data:`MAX_SKIPS` times in a row goes next regardless of priority. So an interactive lane is
always preferred, and a background lane with a ready batch still gets at least one of every
``MAX_SKIPS + 1`` dispatches while the interactive lane is saturated.

Every admitted request leaves the scheduler exactly once: dispatched in a batch, timed out
(its lane's ``request_timeout`` passed before dispatch; it is never run), or cancelled.
"""

from __future__ import annotations

import enum
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from batchpilot_runtime.config import LaneConfig

MAX_SKIPS = 4
"""A ready lane passed over this many times in a row is served next, whatever its priority."""


class State(enum.IntEnum):
    QUEUED = 0
    DISPATCHED = 1
    TIMED_OUT = 2
    CANCELLED = 3


class Pending:
    """One admitted request: its rows, its timing and the future its handler awaits."""

    __slots__ = ("arrival", "data", "dispatched_at", "exec_s", "future", "lane", "rows", "state", "tenant", "timer")

    def __init__(
        self,
        data: Any,
        lane: int,
        arrival: float,
        future: Any = None,
        tenant: str = "default",
        rows: int | None = None,
    ) -> None:
        self.data = data  # the input rows (a numpy array); in the simulator, the arrival at the pod
        self.tenant = tenant
        self.rows = int(data.shape[0]) if rows is None else rows
        self.lane = lane
        self.arrival = arrival
        self.future = future
        self.state = State.QUEUED
        self.dispatched_at = 0.0
        self.exec_s = 0.0  # its batch's forward time, once run (the runtime's overhead accounting)
        self.timer: Any = None


@dataclass
class LaneQueue:
    """The queue of one lane. ``live_*`` count requests still QUEUED (stale entries are skipped)."""

    cfg: LaneConfig
    index: int
    queue: deque[Pending] = field(default_factory=deque)
    live_count: int = 0
    live_rows: int = 0
    skips: int = 0

    @property
    def name(self) -> str:
        return self.cfg.name

    def head(self) -> Pending | None:
        """The oldest live request, dropping stale (timed-out or cancelled) entries in front of it."""
        q = self.queue
        while q:
            first = q[0]
            if first.state is State.QUEUED:
                return first
            q.popleft()
        return None

    def compact(self) -> None:
        self.queue = deque(p for p in self.queue if p.state is State.QUEUED)


@dataclass
class Batch:
    lane: LaneQueue
    requests: list[Pending]
    rows: int
    formed_at: float
    cut_delay: float | None = None
    """Seconds the cut came after ``max(due, model free)`` (the dispatch rule); None when flushing."""


class QueueFull(Exception):
    """The lane's queue is at ``max_queue_length`` requests."""


class Scheduler:
    """Admission, lane choice and batch forming. Not thread-safe: callers hold one lock."""

    def __init__(self, lanes: Sequence[LaneConfig], max_skips: int = MAX_SKIPS) -> None:
        self.lanes = [LaneQueue(cfg=cfg, index=i) for i, cfg in enumerate(lanes)]
        self.by_name = {lane.name: lane for lane in self.lanes}
        self.max_skips = max_skips

    # -- admission -----------------------------------------------------------------------------
    def admit(self, req: Pending) -> None:
        """Queue ``req`` in its lane or raise :class:`QueueFull` (the caller answers 429)."""
        lane = self.lanes[req.lane]
        if lane.live_count >= lane.cfg.max_queue_length:
            raise QueueFull(
                f"lane {lane.name!r} queue is full ({lane.live_count} requests waiting, "
                f"maxQueueLength {lane.cfg.max_queue_length}); retry later"
            )
        lane.queue.append(req)
        lane.live_count += 1
        lane.live_rows += req.rows
        # Stale entries (timed out / cancelled mid-queue) are dropped lazily; compact when they
        # could make the deque grow past twice the bound, so memory stays bounded.
        if len(lane.queue) > 2 * lane.cfg.max_queue_length + 16:
            lane.compact()

    def withdraw(self, req: Pending, state: State) -> bool:
        """Move a still-queued request to ``state`` (TIMED_OUT or CANCELLED). False if dispatched."""
        if req.state is not State.QUEUED:
            return False
        req.state = state
        lane = self.lanes[req.lane]
        lane.live_count -= 1
        lane.live_rows -= req.rows
        return True

    # -- dispatch ------------------------------------------------------------------------------
    def depth_rows(self) -> dict[str, int]:
        return {lane.name: lane.live_rows for lane in self.lanes}

    def pending_count(self) -> int:
        return sum(lane.live_count for lane in self.lanes)

    def _ready(self, lane: LaneQueue, now: float, flush: bool) -> bool:
        if lane.live_count == 0:
            return False
        if flush or lane.live_rows >= lane.cfg.max_batch_size:
            return True
        head = lane.head()
        return head is not None and now - head.arrival >= lane.cfg.max_queue_delay

    def ready_at(self, lane: LaneQueue) -> float | None:
        """When ``lane`` is ready by the dispatch rule with the requests it holds now (None:
        empty): its oldest live request's window end, or the arrival of the request that
        brought its rows to ``max_batch_size``, whichever is first. A lane is ready at ``now``
        (:meth:`select`) exactly when this is at or before it."""
        head = lane.head()
        if head is None:
            return None
        due = head.arrival + lane.cfg.max_queue_delay
        if lane.live_rows >= lane.cfg.max_batch_size:
            rows = 0
            for req in lane.queue:
                if req.state is State.QUEUED:
                    rows += req.rows
                    if rows >= lane.cfg.max_batch_size:
                        return min(due, req.arrival)
        return due

    def select(self, now: float, flush: bool = False) -> tuple[LaneQueue | None, float | None]:
        """The lane to dispatch now, or ``(None, wake_at)``: when the next window expires (None: idle)."""
        ready: list[LaneQueue] = []
        wake: float | None = None
        for lane in self.lanes:
            if self._ready(lane, now, flush):
                ready.append(lane)
            elif lane.live_count:
                head = lane.head()
                if head is not None:
                    at = head.arrival + lane.cfg.max_queue_delay
                    wake = at if wake is None else min(wake, at)
        if not ready:
            return None, wake
        starved = [lane for lane in ready if lane.skips >= self.max_skips]
        pool = starved or ready

        def key(lane: LaneQueue) -> tuple[int, float]:
            head = lane.head()
            return (lane.cfg.priority, -(head.arrival if head is not None else now))

        chosen = max(pool, key=key)
        for lane in ready:
            if lane is chosen:
                lane.skips = 0
            else:
                lane.skips += 1
        return chosen, None

    def take(self, lane: LaneQueue, now: float) -> tuple[list[Pending], list[Pending]]:
        """Cut a batch from ``lane``: (dispatched requests, requests found past their timeout)."""
        batch: list[Pending] = []
        expired: list[Pending] = []
        rows = 0
        limit = lane.cfg.max_batch_size
        timeout = lane.cfg.request_timeout
        q = lane.queue
        while q:
            head = q[0]
            if head.state is not State.QUEUED:
                q.popleft()
                continue
            if now - head.arrival >= timeout:
                q.popleft()
                self.withdraw(head, State.TIMED_OUT)
                expired.append(head)
                continue
            if rows + head.rows > limit:
                break
            q.popleft()
            head.state = State.DISPATCHED
            head.dispatched_at = now
            lane.live_count -= 1
            lane.live_rows -= head.rows
            rows += head.rows
            batch.append(head)
        return batch, expired


def cut_delay(cfg: LaneConfig, batch: Sequence[Pending], rows: int, now: float, free_at: float) -> float:
    """How long after the dispatch rule's instant a batch was cut (seconds, >= 0).

    The rule (and the tuner's simulator) dispatches at ``max(due, free)``: ``due`` is when the
    window of the oldest row expired or when the batch filled (the arrival of the request that
    completed ``max_batch_size`` rows), ``free`` when the model returned from the previous
    batch. Anything later is time the worker spent elsewhere: handing results to the event
    loop, waiting for the lock or the GIL, waking from its timer.
    """
    due = batch[0].arrival + cfg.max_queue_delay
    if rows >= cfg.max_batch_size:
        due = min(due, batch[-1].arrival)
    return max(0.0, now - max(due, free_at))
