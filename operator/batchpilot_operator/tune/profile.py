"""A model's latency profile: execution time by batch size, measured on the target device.

The file is small YAML (JSON is YAML too), written by ``batchpilot profile`` and read by
``batchpilot tune`` and ``batchpilot validate``::

    apiVersion: batchpilot.dev/v1alpha1
    kind: LatencyProfile
    model: {name: mlp, source: "builtin:mlp", device: cpu, dtype: float32, threads: 2}
    quantile: p90            # which column exec_time() reads (conservative by default)
    requestOverhead: 150us   # per request, outside the model (HTTP, decode); not executor time
    dispatchDelay: 300us     # optional: each batch is cut this late (runtime's /admin/profile sets it)
    points:
      - {batchSize: 1, p50: 1.1ms, p90: 1.3ms, p99: 2ms, mean: 1.2ms, samples: 100}
      - {batchSize: 8, p50: 2.9ms, p90: 3.2ms, p99: 4ms, mean: 3ms, samples: 100}

Times are Go-style duration strings (or plain float seconds). Between measured batch sizes
the time is interpolated linearly; below the smallest it is the smallest's time; above the
largest it is extrapolated along the last segment (never decreasing), and
:meth:`LatencyProfile.extrapolated` says so. Pure: pydantic and PyYAML only.
"""

from __future__ import annotations

import bisect
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from batchpilot_runtime.config import Duration

PROFILE_API_VERSION: Literal["batchpilot.dev/v1alpha1"] = "batchpilot.dev/v1alpha1"
PROFILE_KIND: Literal["LatencyProfile"] = "LatencyProfile"

Quantile = Literal["p50", "p90", "p99", "mean"]
PointSource = Literal["live", "warmup", "warmup+live"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True)


class ProfiledModel(_Model):
    """What was measured: the same fields as the policy's model, plus where."""

    name: str = Field(min_length=1)
    source: str = Field(min_length=1)
    device: str = Field(default="cpu", min_length=1, description="cpu, cuda, or a device description")
    dtype: str = "float32"
    threads: int | None = Field(default=None, ge=1)
    host: str | None = None


class ProfilePoint(_Model):
    """Forward time of one batch of ``batch_size`` rows (seconds)."""

    batch_size: int = Field(alias="batchSize", ge=1, le=65536)
    p50: Duration = Field(gt=0)
    p90: Duration | None = Field(default=None, gt=0)
    p99: Duration = Field(gt=0)
    mean: Duration | None = Field(default=None, gt=0)
    samples: int | None = Field(default=None, ge=1)
    source: PointSource | None = Field(
        default=None,
        description="where a runtime's /admin/profile took the samples: live batches, or timed passes "
        "at warm-up (slower than back-to-back live passes; a merge prefers live points)",
    )

    @model_validator(mode="after")
    def _ordered(self) -> ProfilePoint:
        if self.p99 < self.p50:
            raise ValueError(f"batchSize {self.batch_size}: p99 ({self.p99}) is below p50 ({self.p50})")
        if self.p90 is not None and not (self.p50 <= self.p90 <= self.p99):
            raise ValueError(f"batchSize {self.batch_size}: p90 must lie between p50 and p99")
        return self

    def value(self, quantile: Quantile) -> float:
        if quantile == "p50":
            return self.p50
        if quantile == "p99":
            return self.p99
        if quantile == "p90":
            # Missing p90: the midpoint of p50 and p99 stands in (a conservative-leaning guess).
            return self.p90 if self.p90 is not None else (self.p50 + self.p99) / 2
        return self.mean if self.mean is not None else self.p50


class LatencyProfile(_Model):
    """Execution time by batch size for one model on one device."""

    api_version: Literal["batchpilot.dev/v1alpha1"] = Field(default=PROFILE_API_VERSION, alias="apiVersion")
    kind: Literal["LatencyProfile"] = PROFILE_KIND
    model: ProfiledModel
    quantile: Quantile = Field(default="p90", description="the column exec_time() reads unless told otherwise")
    request_overhead: Duration = Field(
        default=0.0,
        alias="requestOverhead",
        description="per-request time outside the model executor (HTTP, decoding); adds to latency only",
    )
    dispatch_delay: Duration = Field(
        default=0.0,
        alias="dispatchDelay",
        description="typical delay of each batch cut past the dispatch rule (the runtime's measured "
        "batch cut delay); delays the executor too, unlike requestOverhead",
    )
    front_end_cost: Duration = Field(
        default=0.0,
        alias="frontEndCost",
        description="CPU seconds the runtime's HTTP loop spends on each request (decode, answer): the "
        "loop serves requests one at a time, so a burst above 1/frontEndCost per second queues in "
        "front of the batcher (the simulator's front end; 0: not modelled)",
    )
    warmup_scale: float | None = Field(
        default=None,
        alias="warmupScale",
        gt=0,
        description="a runtime's /admin/profile: the factor its warm-up passes were scaled by in the "
        "points that have them (live / warm-up at the sizes with both; the level passes run at now)",
    )
    points: list[ProfilePoint] = Field(min_length=1)
    measured_at: str | None = Field(default=None, alias="measuredAt")
    note: str | None = None

    @model_validator(mode="after")
    def _sorted_unique(self) -> LatencyProfile:
        sizes = [p.batch_size for p in self.points]
        if sizes != sorted(set(sizes)):
            raise ValueError(f"points: batch sizes must be unique and increasing, got {sizes}")
        return self

    @property
    def batch_sizes(self) -> list[int]:
        return [p.batch_size for p in self.points]

    @property
    def max_batch_size(self) -> int:
        return self.points[-1].batch_size

    def extrapolated(self, batch_size: int) -> bool:
        """True when ``batch_size`` lies beyond the largest measured size."""
        return batch_size > self.max_batch_size

    def exec_time(self, batch_size: int, quantile: Quantile | None = None) -> float:
        """Seconds the model takes for one batch of ``batch_size`` rows.

        Reads the profile's ``quantile`` column (default p90: conservative without letting
        a few scheduler hiccups dominate every simulated batch), interpolated linearly.
        """
        if batch_size < 1:
            raise ValueError(f"batch size must be at least 1, got {batch_size}")
        q = quantile or self.quantile
        sizes = self.batch_sizes
        values = [p.value(q) for p in self.points]
        if batch_size <= sizes[0]:
            return values[0]
        if len(sizes) == 1:
            # One point: assume time proportional to rows beyond it (pessimistic, no batching gain).
            return values[0] * batch_size / sizes[0]
        k = bisect.bisect_left(sizes, batch_size)
        if k < len(sizes) and sizes[k] == batch_size:
            return values[k]
        if k >= len(sizes):
            k = len(sizes) - 1
        x0, x1 = sizes[k - 1], sizes[k]
        y0, y1 = values[k - 1], values[k]
        slope = max(0.0, (y1 - y0) / (x1 - x0))
        return y0 + slope * (batch_size - x0)

    def exec_table(self, max_batch_size: int, quantile: Quantile | None = None) -> list[float]:
        """``table[b]`` = exec_time(b) for b in 1..max_batch_size (``table[0]`` is 0)."""
        return [0.0] + [self.exec_time(b, quantile) for b in range(1, max_batch_size + 1)]

    def to_yaml(self) -> str:
        data = self.model_dump(mode="json", by_alias=True, exclude_none=True)
        return yaml.safe_dump(data, sort_keys=False)


def load_profile(path: str | Path) -> LatencyProfile:
    """Read and validate a latency profile (YAML or JSON)."""
    text = Path(path).read_text()
    data = yaml.safe_load(text)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a latency profile must be a mapping, got {type(data).__name__}")
    return LatencyProfile.model_validate(data)
