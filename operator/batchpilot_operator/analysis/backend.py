"""What the analysis reads from a metrics store: one instant query's :class:`Measurement`,
through a :class:`MetricsBackend` (Prometheus: ``batchpilot_operator.prom``; tests inject their own)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Measurement:
    """The result of one instant query: a scalar, or histogram buckets.

    ``value`` is None when the query returned no series or NaN (no traffic): that is no
    data, not an error. ``buckets`` holds ``(le, count)`` pairs when the answer was one
    series per ``le`` (a ``sum by (le)`` query). ``error`` is set when the query failed.
    """

    query: str
    value: float | None = None
    error: str | None = None
    buckets: tuple[tuple[float, float], ...] | None = None
    groups: tuple[tuple[str, float], ...] | None = None
    """One value per value of the one label a ``sum by (label)`` query keeps (e.g. ``code``)."""


class MetricsBackend(Protocol):
    """What the analysis needs from a metrics store: run instant queries at one instant
    (``at``, Unix seconds; None: now), never raise for store faults (unreachable, timeout,
    bad response): those come back as ``error``."""

    def measure(self, queries: Sequence[str], at: float | None = None) -> Mapping[str, Measurement]: ...


def finite(value: float | None) -> float | None:
    if value is None or not math.isfinite(value):
        return None
    return value


def not_nan(value: float | None) -> float | None:
    """NaN is "no data"; +Inf stays (a quantile in the +Inf bucket is a breach, not a gap)."""
    if value is None or math.isnan(value):
        return None
    return value
