"""The overload-proportional Retry-After (pure: clock and random source injected)."""

from __future__ import annotations

import random

import pytest

from batchpilot_runtime.shedding import RetryAfter


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_no_overload_says_one_second() -> None:
    clock = Clock()
    ra = RetryAfter(clock, rng=random.Random(1))
    assert ra.base() == 1
    for _ in range(100):
        ra.admitted()
    ra.rejected()
    assert ra.base() == 1
    assert {ra.retry_after() for _ in range(50)} <= {"1", "2"}


def test_grows_with_rejections_per_admission_and_is_jittered() -> None:
    clock = Clock()
    ra = RetryAfter(clock, rng=random.Random(1))
    for _ in range(100):
        ra.admitted()
    for _ in range(450):
        ra.rejected()
    assert ra.base() == 5  # 4.5 rejections per admission, rounded up
    clock.now += 1.0  # the full window becomes "last second"; this one starts empty
    assert ra.base() == 5
    values = {int(ra.retry_after()) for _ in range(200)}
    assert min(values) == 5 and max(values) == 10, values


def test_capped_and_forgets_an_old_overload() -> None:
    clock = Clock()
    ra = RetryAfter(clock, cap=30, rng=random.Random(1))
    ra.admitted()
    for _ in range(1000):
        ra.rejected()
    assert ra.base() == 30 and int(ra.retry_after()) == 30
    clock.now += 5.0  # an idle gap: nothing from before counts
    assert ra.base() == 1


def test_bad_cap_is_an_error() -> None:
    with pytest.raises(ValueError, match="cap must be at least 1"):
        RetryAfter(Clock(), cap=0)
