"""A work queue of policy keys, in controller-runtime's shape (asyncio).

* Coalescing: a key is queued at most once; events for a key while it waits are one
  reconcile, events while it runs give exactly one more run after it.
* Per-key serialization: a key is never reconciled by two workers at once.
* Bounded concurrency and fairness: ``workers`` reconciles at a time, first queued first
  served, so one policy waiting on a slow Prometheus holds one worker, not the others.
* Urgency: ``add(key, urgent=True)`` (a spec change nobody has acted on yet) goes before
  the routine work, so a change applied during a take-over's 1,000 initial reconciles is not
  served last.
* Requeue: :meth:`WorkQueue.add_after` (the planner's ``requeue_after``); the earliest due
  time per key wins. A reconcile that raises is retried with a per-key exponential backoff.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

log = logging.getLogger(__name__)

K = TypeVar("K", bound=Hashable)

Reconciler = Callable[[K], Awaitable[float | None]]
"""Reconcile one key; returns seconds until it wants to run again (None: only on events)."""


class WorkQueue(Generic[K]):
    def __init__(
        self,
        reconcile: Reconciler[K],
        *,
        workers: int = 8,
        backoff_base: float = 0.5,
        backoff_max: float = 60.0,
        observe: Callable[[int, int], None] | None = None,
    ) -> None:
        """``observe(depth, pending_requeues)`` is called whenever either changes."""
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        self._reconcile = reconcile
        self._observe = observe
        self.workers = workers
        self.backoff_base = backoff_base
        self.backoff_max = backoff_max
        self._tokens: asyncio.Queue[None] = asyncio.Queue()  # one token per queued key
        self._normal: collections.deque[K] = collections.deque()
        self._urgent: collections.deque[K] = collections.deque()
        self._dirty: set[K] = set()
        self._processing: set[K] = set()
        self._timers: dict[K, tuple[float, asyncio.TimerHandle]] = {}
        self._failures: dict[K, int] = {}
        self._tasks: list[asyncio.Task[None]] = []

    # ---- producers ---------------------------------------------------------------------
    def add(self, key: K, urgent: bool = False) -> None:
        if key in self._dirty:
            if urgent and key in self._normal:
                self._normal.remove(key)
                self._urgent.append(key)
            return
        self._dirty.add(key)
        if key not in self._processing:
            self._push(key, urgent)
        self._observed()

    def _push(self, key: K, urgent: bool) -> None:
        (self._urgent if urgent else self._normal).append(key)
        self._tokens.put_nowait(None)

    def add_after(self, key: K, delay: float) -> None:
        if delay <= 0:
            self.add(key)
            return
        loop = asyncio.get_running_loop()
        due = loop.time() + delay
        existing = self._timers.get(key)
        if existing is not None:
            if existing[0] <= due:
                return
            existing[1].cancel()
        self._timers[key] = (due, loop.call_at(due, self._fire, key))
        self._observed()

    def forget(self, key: K) -> None:
        """Drop a key's pending requeue and backoff (the object is gone)."""
        timer = self._timers.pop(key, None)
        if timer is not None:
            timer[1].cancel()
        self._failures.pop(key, None)
        self._observed()

    def _observed(self) -> None:
        if self._observe is not None:
            self._observe(self._tokens.qsize(), len(self._timers))

    def _fire(self, key: K) -> None:
        self._timers.pop(key, None)
        self.add(key)

    # ---- introspection -----------------------------------------------------------------
    def __len__(self) -> int:
        return self._tokens.qsize()

    @property
    def pending_requeues(self) -> int:
        return len(self._timers)

    # ---- consumers ---------------------------------------------------------------------
    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._worker(), name=f"reconcile-worker-{i}") for i in range(self.workers)]

    async def stop(self, grace: float = 10.0) -> None:
        """Stop taking work and cancel the workers (a reconcile running in a thread finishes
        there: the caller shuts its executor down after this)."""
        for _, handle in self._timers.values():
            handle.cancel()
        self._timers.clear()
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=grace)
        self._tasks = []

    async def _worker(self) -> None:
        while True:
            await self._tokens.get()
            key = self._urgent.popleft() if self._urgent else self._normal.popleft()
            self._observed()
            self._dirty.discard(key)
            self._processing.add(key)
            requeue: float | None
            try:
                requeue = await asyncio.shield(self._reconcile(key))
                self._failures.pop(key, None)
            except asyncio.CancelledError:
                self._processing.discard(key)
                raise
            except Exception:
                failures = self._failures[key] = self._failures.get(key, 0) + 1
                requeue = min(self.backoff_max, self.backoff_base * 2 ** (failures - 1))
                log.exception("reconcile of %s failed (%d in a row); retrying in %.1fs", key, failures, requeue)
            finally:
                self._processing.discard(key)
                if key in self._dirty:
                    self._push(key, False)
            if requeue is not None:
                self.add_after(key, requeue)
