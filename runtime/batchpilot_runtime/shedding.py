"""How long a rejected client should wait: an overload-proportional, jittered ``Retry-After``.

A fixed ``Retry-After: 1`` keeps clients that honour it coming back every second: under a
sustained overload the population of clients waiting to retry grows (arrivals beyond capacity
keep joining it until they give up), and the server spends its CPU rejecting their retries
instead of running batches (drill 8 measured a third of the goodput lost that way). Here the
hint grows with the overload: ``base`` is the ratio of requests rejected to requests admitted
over the last second (rounded up, at least 1 s, at most ``cap``), and each answer carries a
value drawn uniformly from ``[base, 2 * base]`` so that clients rejected in the same second do
not come back in the same second. With N clients waiting to retry and a capacity of C per
second, the retries arrive at about N / base per second, and base settles near sqrt(N / C):
the retry traffic grows with the square root of the backlog instead of in proportion to it.

Pure (clock and random source injected); the server calls :meth:`admitted`, :meth:`rejected`
and :meth:`retry_after`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

WINDOW_S = 1.0


class RetryAfter:
    def __init__(
        self,
        clock: Callable[[], float],
        cap: int = 30,
        rng: random.Random | None = None,
    ) -> None:
        if cap < 1:
            raise ValueError(f"cap must be at least 1 second, got {cap}")
        self.clock = clock
        self.cap = cap
        self.rng = rng or random.Random()
        self._window_start = clock()
        self._admitted = 0
        self._rejected = 0
        self._last_admitted = 0
        self._last_rejected = 0

    def _roll(self) -> None:
        now = self.clock()
        elapsed = now - self._window_start
        if elapsed < WINDOW_S:
            return
        if elapsed >= 2 * WINDOW_S:  # an idle gap: the last full window saw nothing
            self._last_admitted = self._last_rejected = 0
        else:
            self._last_admitted, self._last_rejected = self._admitted, self._rejected
        self._admitted = self._rejected = 0
        self._window_start = now

    def admitted(self) -> None:
        self._roll()
        self._admitted += 1

    def rejected(self) -> None:
        self._roll()
        self._rejected += 1

    def base(self) -> int:
        """Seconds: rejections per admission over the last full second (or this one, if more)."""
        self._roll()
        admitted = max(self._last_admitted, self._admitted, 1)
        rejected = max(self._last_rejected, self._rejected)
        return max(1, min(self.cap, math.ceil(rejected / admitted)))

    def retry_after(self) -> str:
        """The header value for one rejected request (whole seconds, as HTTP requires)."""
        base = self.base()
        return str(min(self.cap, self.rng.randint(base, 2 * base)))
