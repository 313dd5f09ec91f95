"""The runtime's configuration: one immutable file per revision, written by the operator.

This module is the contract between the operator and the runtime. It needs only pydantic,
so the operator (whose image has no torch) imports it to build the ConfigMap it mounts.

Durations are Kubernetes/Go-style strings (``5ms``, ``1m30s``) everywhere a human writes
them; :func:`parse_duration` is the one place they are parsed. Inside Python they are float
seconds; serialised they are canonical duration strings again.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    model_validator,
)

_DURATION_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNIT_SECONDS = {
    "ns": 1e-9,
    "us": 1e-6,
    "µs": 1e-6,
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
}
# The same grammar as a regular expression, used by the CRD's OpenAPI `pattern` too.
DURATION_PATTERN = r"^(([0-9]+(\.[0-9]*)?|\.[0-9]+)(ns|us|µs|ms|s|m|h))+$"


def parse_duration(value: object) -> float:
    """Parse a Go/Kubernetes duration string (``250us``, ``5ms``, ``1m30s``) into seconds.

    Numbers (already seconds) pass through, so models round-trip. Negative or malformed
    values raise ``ValueError`` with the offending text.
    """
    if isinstance(value, bool):
        raise ValueError(f"expected a duration string such as '5ms', got {value!r}")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip()
        pos = 0
        seconds = 0.0
        for match in _DURATION_PART.finditer(text):
            if match.start() != pos:
                break
            seconds += float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
            pos = match.end()
        if pos != len(text) or not text:
            raise ValueError(
                f"invalid duration {value!r}: use a number with a unit (ns, us, ms, s, m, h), "
                "e.g. '5ms', '1.5s' or '1m30s'"
            )
    else:
        raise ValueError(f"expected a duration string such as '5ms', got {value!r}")
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"duration must be finite and not negative, got {value!r}")
    return seconds


def format_duration(seconds: float) -> str:
    """Canonical short string for a duration in seconds: ``0.005 -> '5ms'``, ``90 -> '1m30s'``."""
    if seconds == 0:
        return "0s"
    micros = round(seconds * 1e6)
    if micros < 1000:
        return f"{micros}us"
    if micros < 1_000_000:
        ms = micros / 1000
        return f"{ms:g}ms"
    if micros < 60_000_000:
        return f"{micros / 1e6:g}s"
    total_s = micros / 1e6
    hours, rest = divmod(total_s, 3600)
    minutes, secs = divmod(rest, 60)
    out = ""
    if hours:
        out += f"{int(hours)}h"
    if minutes:
        out += f"{int(minutes)}m"
    if secs:
        out += f"{secs:g}s"
    return out


Duration = Annotated[
    float,
    BeforeValidator(parse_duration),
    PlainSerializer(format_duration, return_type=str, when_used="json"),
]
"""A duration: written as a Go-style string, held as float seconds."""

LANE_NAME_PATTERN = r"^[a-z]([a-z0-9-]{0,30}[a-z0-9])?$"
MODEL_SOURCE_PATTERN = r"^(builtin:(mlp|transformer|tiny-mlp)|torchscript:.+|python:[A-Za-z_][\w.]*:[A-Za-z_]\w*)$"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True)


class LaneConfig(_Model):
    """One workload lane: its own queue, batching window, limits and priority."""

    name: str = Field(pattern=LANE_NAME_PATTERN)
    max_batch_size: int = Field(alias="maxBatchSize", ge=1, le=4096)
    max_queue_delay: Duration = Field(
        alias="maxQueueDelay", description="batching window: the longest a row waits for batch-mates"
    )
    max_queue_length: int = Field(alias="maxQueueLength", ge=1, le=1_000_000)
    request_timeout: Duration = Field(alias="requestTimeout")
    priority: int = Field(default=0, ge=0, le=100, description="higher is served first")

    @model_validator(mode="after")
    def _timeout_covers_window(self) -> LaneConfig:
        if self.request_timeout <= self.max_queue_delay:
            raise ValueError(
                f"lane {self.name!r}: requestTimeout ({format_duration(self.request_timeout)}) must be "
                f"longer than maxQueueDelay ({format_duration(self.max_queue_delay)})"
            )
        return self


class ModelConfig(_Model):
    """What the runtime serves and where it runs."""

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
    source: str = Field(
        pattern=MODEL_SOURCE_PATTERN,
        description="builtin:mlp | builtin:transformer | torchscript:<path> | python:<module>:<factory>",
    )
    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    threads: int | None = Field(default=None, ge=1, le=256, description="torch intra-op threads on CPU")


class RuntimeConfig(_Model):
    """The whole runtime configuration of one revision (the ConfigMap's ``config.json``)."""

    policy: str = Field(default="local", min_length=1)
    revision: str = Field(default="dev", min_length=1)
    track: str = Field(default="stable")
    model: ModelConfig
    lanes: list[LaneConfig] = Field(min_length=1, max_length=8)
    default_lane: str | None = Field(default=None, alias="defaultLane")
    port: int = Field(default=8000, ge=1, le=65535)
    drain_timeout: Duration = Field(default=30.0, alias="drainTimeout")

    @model_validator(mode="after")
    def _lanes_consistent(self) -> RuntimeConfig:
        names = [lane.name for lane in self.lanes]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"lanes: duplicate lane name(s) {dupes}; each lane name must be unique")
        if self.default_lane is not None and self.default_lane not in names:
            raise ValueError(f"defaultLane {self.default_lane!r} is not one of the lanes {names}")
        return self

    @property
    def default_lane_name(self) -> str:
        """The lane a request without a lane goes to: ``defaultLane``, else the first lane."""
        return self.default_lane or self.lanes[0].name

    def lane(self, name: str) -> LaneConfig:
        for lane in self.lanes:
            if lane.name == name:
                return lane
        raise KeyError(name)

    def to_json(self) -> str:
        return self.model_dump_json(by_alias=True, exclude_none=True, indent=2)


def load_config(path: str | Path) -> RuntimeConfig:
    """Read a runtime config from a JSON or YAML file (JSON is YAML).

    Strict on types, as the policy's CRD is: ``"maxBatchSize": "8"`` is an error, not an 8.
    Durations may be strings or seconds.
    """
    data = yaml.safe_load(Path(path).read_text())
    return RuntimeConfig.model_validate(data, strict=True)
