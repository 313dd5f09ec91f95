"""Fake runtime documents for the pure tuner tests: arrival captures, latency profiles, Poisson arrivals."""

from __future__ import annotations

import random
from typing import Any

from batchpilot_operator.tune.captures import merge_profiles
from batchpilot_operator.tune.live import lane_settings_from_spec
from batchpilot_operator.tune.profile import LatencyProfile
from batchpilot_operator.tune.simulator import simulate

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


def pods_doc(slowdown: float, rate: float = 100.0, seconds: float = 30.0, seed: int = 1) -> dict[str, Any]:
    """One pod's capture whose requests took ``slowdown`` x what the model says for the same arrivals."""
    times = poisson(rate, seconds, seed)
    doc = capture_doc("a", times, window_start=1000.0, captured_at=1000.0 + seconds)
    profile = merge_profiles([profile_doc(1.0)])
    sim = simulate(
        [t - 1000.0 for t in times],
        lane_settings_from_spec(LANE_SETTINGS),
        profile.exec_table(LANE_SETTINGS["maxBatchSize"]),
        1,
        "random",
        0,
        profile.request_overhead,
        dispatch_delay=profile.dispatch_delay,
    )
    assert len(sim.latencies) == len(times)
    base = times[0]
    doc["lanes"][0]["outcomes"] = {
        "recorded": len(times),
        "times": [t - base for t in times],
        "latency": [x * slowdown for x in sim.latencies],
        "queueWait": [x * slowdown for x in sim.queue_waits],
    }
    return doc


def revision_doc(revision: str, slowdown: float, seed: int) -> dict[str, Any]:
    doc = pods_doc(slowdown, seed=seed)
    doc["revision"] = revision
    doc["pod"] = f"{revision}-pod"
    return doc
