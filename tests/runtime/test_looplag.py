"""The event-loop lag probe on a real asyncio loop: a callback that holds the loop shows up as
the lag of the timer due meanwhile."""

from __future__ import annotations

import asyncio
import time

import pytest

from batchpilot_runtime.looplag import LoopLagProbe

HOLD = 0.3


def test_a_held_loop_shows_as_lag_and_a_free_one_does_not() -> None:
    lags: list[float] = []

    async def scenario() -> tuple[int, int]:
        probe = LoopLagProbe(lags.append, interval=0.01)
        probe.start()
        probe.start()  # idempotent: one sampler
        await asyncio.sleep(0.2)
        free = len(lags)
        # A callback that keeps the loop for HOLD seconds, as a burst of parsing would.
        asyncio.get_running_loop().call_soon(time.sleep, HOLD)
        await asyncio.sleep(0.1)
        await probe.stop()
        return free, probe.samples

    free, samples = asyncio.run(scenario())
    assert samples == len(lags) >= free + 1 >= 2
    # The timer due while the loop was held ran at least most of HOLD late ...
    assert max(lags[free:]) >= 0.5 * HOLD
    # ... while before it, no sample came near that (a free loop runs its timers on time).
    assert max(lags[:free]) < 0.5 * HOLD
    assert min(lags) >= 0.0


def test_stop_ends_the_sampling() -> None:
    lags: list[float] = []

    async def scenario() -> int:
        probe = LoopLagProbe(lags.append, interval=0.005)
        probe.start()
        await asyncio.sleep(0.05)
        await probe.stop()
        stopped_at = len(lags)
        await asyncio.sleep(0.05)
        return stopped_at

    assert asyncio.run(scenario()) == len(lags) > 0


def test_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="interval"):
        LoopLagProbe(lambda _: None, interval=0)
