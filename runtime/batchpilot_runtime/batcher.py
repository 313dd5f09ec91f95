"""The dynamic batcher: the batching rule (``scheduler``) and the model worker thread.

Two layers:

* :class:`~batchpilot_runtime.scheduler.Scheduler` (in ``scheduler.py``, re-exported here) is
  pure bookkeeping with an injected ``now``: admission (queue bounds), which lane dispatches
  next (priority without starvation), and which requests form a batch. It holds no lock and
  starts no thread, so unit tests drive it with a fake clock and the tuner's simulator drives
  it on a simulated one. The dispatch rule and lane choice are described there.
* :class:`BatchWorker` owns one thread that runs the model's batches (the model itself lives in
  its own process, :mod:`batchpilot_runtime.modelproc`, unless ``model.isolation: thread``).
  After each forward pass it takes the next ready batch straight from the scheduler (under a
  lock) and runs it, so there is no event-loop hop between batches: while one batch runs, the
  lane queues keep filling, and the next batch is cut the moment the model is free (adaptive
  batch size under load).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from batchpilot_runtime.config import LaneConfig
from batchpilot_runtime.scheduler import Batch, Pending, Scheduler, State, cut_delay

RunFn = Callable[[np.ndarray[Any, Any]], np.ndarray[Any, Any]]
DeliverFn = Callable[[Batch, "np.ndarray[Any, Any] | None", "BaseException | None", float], None]
ExpireFn = Callable[[list[Pending]], None]


class BatchWorker:
    """The worker thread: waits for a ready lane, cuts a batch, runs it on the model, hands results back.

    ``deliver(batch, output, error, exec_seconds)`` and ``expire(requests)`` are called on the
    worker thread; they must hand off to the event loop themselves (``call_soon_threadsafe``).
    """

    def __init__(
        self,
        lanes: Sequence[LaneConfig],
        run: RunFn,
        deliver: DeliverFn,
        expire: ExpireFn,
        on_dispatch: Callable[[Batch], None] | None = None,
        clock: Callable[[], float] = time.perf_counter,
        on_admit: Callable[[int, float, int], None] | None = None,
    ) -> None:
        self.scheduler = Scheduler(lanes)
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self._run = run
        self._deliver = deliver
        self._expire = expire
        self._on_dispatch = on_dispatch
        self._on_admit = on_admit
        self._clock = clock
        self._free_at = -float("inf")  # when the model returned from the previous batch
        self._flush = False
        self._stop = False
        self._waiting = False
        self.busy = False
        self.batches = 0
        self.busy_seconds = 0.0
        """Worker time spent on batches, from the cut to the hand-off of the results: the forward
        pass plus what the worker does around it (stacking inputs, metrics, waking the loop,
        waiting for the GIL). Only the worker thread writes it."""
        self._thread = threading.Thread(target=self._loop, name="batchpilot-model", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def submit(self, req: Pending) -> None:
        """Admit ``req`` (raises :class:`QueueFull`) and wake the worker if it is waiting."""
        with self.lock:
            self.scheduler.admit(req)
            if self._waiting:
                self.cond.notify()
        if self._on_admit is not None:
            self._on_admit(req.lane, req.arrival, req.rows)

    def withdraw(self, req: Pending, state: State) -> bool:
        with self.lock:
            return self.scheduler.withdraw(req, state)

    def depth_rows(self) -> dict[str, int]:
        with self.lock:
            return self.scheduler.depth_rows()

    def flush(self) -> None:
        """Draining: dispatch whatever is queued without waiting for windows."""
        with self.lock:
            self._flush = True
            self.cond.notify()

    def stop(self) -> None:
        """Finish queued work, then end the thread."""
        with self.lock:
            self._flush = True
            self._stop = True
            self.cond.notify()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)

    def _next(self) -> Batch | None:
        sched = self.scheduler
        with self.lock:
            while True:
                now = self._clock()
                lane, wake = sched.select(now, self._flush)
                if lane is not None:
                    batch, expired = sched.take(lane, now)
                    if expired:
                        self._expire(expired)
                    if batch:
                        rows = sum(r.rows for r in batch)
                        delay = None if self._flush else cut_delay(lane.cfg, batch, rows, now, self._free_at)
                        return Batch(lane=lane, requests=batch, rows=rows, formed_at=now, cut_delay=delay)
                    continue
                if self._stop and sched.pending_count() == 0:
                    return None
                self._waiting = True
                self.busy = False
                self.cond.wait(None if wake is None else max(wake - now, 0.0))
                self._waiting = False

    def _loop(self) -> None:
        while True:
            batch = self._next()
            if batch is None:
                return
            self.busy = True
            if self._on_dispatch is not None:
                self._on_dispatch(batch)
            reqs = batch.requests
            error: BaseException | None = None
            output: np.ndarray[Any, Any] | None = None
            t0 = self._clock()
            try:
                x = reqs[0].data if len(reqs) == 1 else np.concatenate([r.data for r in reqs])
                output = self._run(x)
                if output.shape[0] != batch.rows:
                    raise RuntimeError(f"model returned {output.shape[0]} rows for a batch of {batch.rows} rows")
            except Exception as exc:  # the batch fails, the server keeps serving
                error = exc
                output = None
            exec_s = self._clock() - t0
            self._free_at = t0 + exec_s
            self.batches += 1
            self._deliver(batch, output, error, exec_s)
            self.busy_seconds += self._clock() - batch.formed_at
