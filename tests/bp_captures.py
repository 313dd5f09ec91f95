"""Fake runtime documents for the pure tuner tests: arrival captures, latency profiles, Poisson arrivals."""

from __future__ import annotations

import random
from typing import Any

from batchpilot_operator.tune.profile import LatencyProfile

LANE_SETTINGS = {"maxBatchSize": 4, "maxQueueDelay": "1ms", "maxQueueLength": 1000, "requestTimeout": "1s"}


def capture_doc(
    pod: str,
    times: list[float],
    rows: list[int] | None = None,
    *,
    window_start: float,
    captured_at: float,
    lane: str = "interactive",
    covered_from: float | None = None,
    revision: str = "r1",
    cut_p50: float | None = None,
) -> dict[str, Any]:
    base = times[0] if times else captured_at
    entry: dict[str, Any] = {
        "name": lane,
        "settings": LANE_SETTINGS,
        "recorded": len(times),
        "overwritten": 0,
        "held": len(times),
        "base": base,
        "coveredFrom": window_start if covered_from is None else covered_from,
        "times": [t - base for t in times],
        "rows": rows if rows is not None else [1] * len(times),
        "batchCutDelay": {"samples": 10, "p50": cut_p50} if cut_p50 is not None else {"samples": 0},
    }
    return {
        "apiVersion": "batchpilot.dev/v1alpha1",
        "kind": "ArrivalCapture",
        "policy": "shop",
        "revision": revision,
        "track": "stable",
        "pod": pod,
        "capturedAt": captured_at,
        "windowStart": window_start,
        "enabled": True,
        "lanes": [entry],
    }


def profile_doc(scale: float, sizes: tuple[int, ...] = (1, 2, 4, 8)) -> dict[str, Any]:
    return {
        "apiVersion": "batchpilot.dev/v1alpha1",
        "kind": "LatencyProfile",
        "model": {"name": "m", "source": "builtin:tiny-mlp", "device": "cpu"},
        "points": [
            {"batchSize": b, "p50": (1 + b * 0.25) * scale * 1e-3, "p90": (1.2 + b * 0.25) * scale * 1e-3,
             "p99": (2 + b * 0.3) * scale * 1e-3, "samples": 10}
            for b in sizes
        ],
    }  # fmt: skip


PROFILE = LatencyProfile.model_validate(
    {
        "model": {"name": "m", "source": "builtin:tiny-mlp"},
        "points": [
            {"batchSize": 1, "p50": "2ms", "p90": "2ms", "p99": "2ms"},
            {"batchSize": 8, "p50": "3ms", "p90": "3ms", "p99": "3ms"},
            {"batchSize": 32, "p50": "6ms", "p90": "6ms", "p99": "6ms"},
        ],
    }
)


def poisson(rate: float, seconds: float, seed: int = 1) -> list[float]:
    rng = random.Random(seed)
    t, out = 1000.0, []
    while t < 1000.0 + seconds:
        t += rng.expovariate(rate)
        out.append(t)
    return out
