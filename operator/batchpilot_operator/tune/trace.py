"""Arrival traces: load, normalise, and time-scale to a target mean rate.

Two input formats:

* the Azure LLM inference trace CSV (``TIMESTAMP,ContextTokens,GeneratedTokens``, timestamps
  like ``2023-11-16 18:17:03.9799600``), as in ``shared/traces/``;
* a plain list of arrival timestamps in seconds, one per line (e.g. exported from
  Prometheus or a load balancer log). Blank lines and ``#`` comments are skipped; a
  non-numeric first line is taken as a header; with several comma-separated columns the
  first is the timestamp.

Scaling multiplies every inter-arrival gap by one constant, so bursts keep their shape
(a uniform or Poisson replay at the same mean rate would hide them).
"""

from __future__ import annotations

import csv
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path


@dataclass(frozen=True)
class Trace:
    """Arrival times in seconds, sorted, starting at 0."""

    arrivals: tuple[float, ...]
    source: str = ""

    def __post_init__(self) -> None:
        if len(self.arrivals) < 2:
            raise ValueError(f"trace {self.source or ''}: needs at least 2 arrivals, got {len(self.arrivals)}")

    @classmethod
    def from_times(cls, times: Sequence[float], source: str = "") -> Trace:
        ordered = sorted(float(t) for t in times)
        if any(not math.isfinite(t) for t in ordered):
            raise ValueError(f"trace {source}: timestamps must be finite numbers")
        t0 = ordered[0] if ordered else 0.0
        return cls(tuple(t - t0 for t in ordered), source)

    @property
    def count(self) -> int:
        return len(self.arrivals)

    @property
    def duration(self) -> float:
        """Seconds from the first arrival to the last."""
        return self.arrivals[-1]

    @property
    def mean_rate(self) -> float:
        """Requests per second: (arrivals - 1) / duration, the inverse of the mean gap."""
        if self.duration <= 0:
            raise ValueError("trace has all arrivals at one instant: its rate is undefined")
        return (self.count - 1) / self.duration

    def gap_cv(self) -> float:
        """Coefficient of variation of inter-arrival gaps (1 for Poisson)."""
        gaps = [b - a for a, b in zip(self.arrivals, self.arrivals[1:], strict=False)]
        mean = sum(gaps) / len(gaps)
        var = sum((g - mean) ** 2 for g in gaps) / len(gaps)
        return math.sqrt(var) / mean if mean > 0 else math.inf

    def spread(self, width: float, seed: int = 0) -> Trace:
        """Each arrival moved uniformly at random within ``[t, t + width)`` (fixed ``seed``): for a
        trace whose timestamps are rounded to ``width``-second buckets (the conversation trace's
        3 s), so a bucket's requests are spread over it instead of arriving as one burst."""
        if not width > 0:
            raise ValueError(f"spread width must be positive, got {width}")
        rng = random.Random(seed)
        return Trace.from_times([t + rng.uniform(0.0, width) for t in self.arrivals], self.source)

    def scale_factor(self, rate: float) -> float:
        """The factor arrival times are divided by to reach ``rate`` requests/s."""
        if rate <= 0:
            raise ValueError(f"rate must be positive, got {rate}")
        return rate / self.mean_rate

    def scaled_arrivals(self, rate: float) -> list[float]:
        """Arrival times compressed (or stretched) so the mean rate is ``rate`` requests/s."""
        k = 1.0 / self.scale_factor(rate)
        return [t * k for t in self.arrivals]

    def scaled(self, rate: float) -> Trace:
        return Trace(tuple(self.scaled_arrivals(rate)), self.source)

    def window(self, start: float, end: float) -> Trace:
        """The arrivals in ``[start, end)`` seconds, re-based to 0."""
        return Trace.from_times([t for t in self.arrivals if start <= t < end], self.source)


def _parse_azure_timestamp(text: str) -> float:
    text = text.strip()
    date_part, _, time_part = text.partition(" ")
    if "." in time_part:
        whole, frac = time_part.split(".", 1)
    else:
        whole, frac = time_part, "0"
    base = datetime.fromisoformat(f"{date_part} {whole}")
    return base.timestamp() + float("0." + frac)


def load_trace(path: str | Path) -> Trace:
    """Load an arrival trace in either supported format (see the module docstring)."""
    p = Path(path)
    text = p.read_text()
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    if not lines:
        raise ValueError(f"{p}: empty trace")
    header = lines[0].strip().lower()
    if header.startswith("timestamp") and "contexttokens" in header.replace(" ", ""):
        times: list[float] = []
        reader = csv.reader(lines[1:])
        for lineno, row in enumerate(reader, start=2):
            if not row:
                continue
            try:
                times.append(_parse_azure_timestamp(row[0]))
            except ValueError as exc:
                raise ValueError(f"{p}:{lineno}: bad TIMESTAMP {row[0]!r}: {exc}") from exc
        return Trace.from_times(times, str(p))
    rows = lines
    try:
        float(rows[0].split(",")[0])
    except ValueError:
        rows = rows[1:]  # a header line
    times = []
    for lineno, line in enumerate(rows, start=1):
        cell = line.split(",")[0].strip()
        try:
            times.append(float(cell))
        except ValueError as exc:
            raise ValueError(f"{p}: line {lineno}: expected a timestamp in seconds, got {cell!r}") from exc
    return Trace.from_times(times, str(p))
