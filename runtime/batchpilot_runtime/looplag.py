"""How long a request that arrives now waits before the event loop reads it.

The server's latency histogram starts when the handler runs; the time a request's bytes wait
in the socket while the loop is busy (other requests' parsing and answers, the worker's
hand-offs) or while the loop's thread waits for a core is invisible to it. On a pod with few
cores that wait reached a p99 of 75-103 ms at 460-1000 req/s (``bench/results/front_end.json``)
beside a server p99 that looked healthy.

:class:`LoopLagProbe` samples it the way Node's ``monitorEventLoopDelay`` does: a timer due
every ``interval`` seconds records how late it ran. A timer that comes due at a given moment
waits for what a request arriving then waits for (the callbacks already ready, then the
loop's own turn on a core), so the samples are that wait at moments spread evenly over
time, whatever the traffic. Requests that come in bursts arrive mostly when the loop is
busiest and wait longer than the average moment: read the samples as a lower bound of
their wait. The simulator's front end (``tune.simulator.front_end``) models
the same wait as a FIFO queue; this is what to check it against.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

DEFAULT_INTERVAL = 0.02
"""Seconds between samples: 50 timer callbacks a second, a few microseconds of loop time each."""


class LoopLagProbe:
    """Observe, every ``interval`` seconds, how late the running loop ran a timer due then."""

    def __init__(self, observe: Callable[[float], None], interval: float = DEFAULT_INTERVAL) -> None:
        if interval <= 0:
            raise ValueError(f"interval must be positive, got {interval}")
        self.observe = observe
        self.interval = interval
        self.samples = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start sampling on the running loop (idempotent)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self.run(), name="loop-lag-probe")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + self.interval
            await asyncio.sleep(self.interval)
            # asyncio runs a timer up to one clock resolution early: never below zero.
            self.observe(max(0.0, loop.time() - due))
            self.samples += 1
