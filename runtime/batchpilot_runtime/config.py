"""The runtime's configuration: one immutable file per revision, written by the operator.

This module is the contract between the operator and the runtime. It needs only pydantic,
so the operator (whose image has no torch) imports it to build the ConfigMap it mounts.

:class:`LaneConfig` is where a lane's fields are declared, once: name, alias, type, bounds,
default and description. The operator's ``LaneSpec`` (``spec.lanes[]``) is a subclass that adds
the fields only the operator reads, and the lane schema of ``crds/batchingpolicy.yaml`` is
written from it by ``hack/gen_crd.py`` (``tests/operator/test_crd_lane_contract.py`` fails when
the CRD and the models differ).

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
from pydantic.fields import FieldInfo

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


def is_duration(field: FieldInfo) -> bool:
    """Whether a model's field is a :data:`Duration` (the CRD types it as a duration string)."""
    return any(isinstance(m, BeforeValidator) and m.func is parse_duration for m in field.metadata)


LANE_NAME_PATTERN = r"^[a-z]([a-z0-9-]{0,30}[a-z0-9])?$"
MODEL_SOURCE_PATTERN = r"^(builtin:(mlp|transformer|tiny-mlp)|torchscript:.+|python:[A-Za-z_][\w.]*:[A-Za-z_]\w*)$"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True)


class LaneConfig(_Model):
    """One workload lane: its own queue, batching window, limits and priority.

    The one declaration of the lane's fields: ``spec.lanes[]`` in the operator's spec and in
    the CRD is these fields and the operator's own (``batchpilot_operator.spec.LaneSpec``).
    A new field here reaches the CRD by ``hack/gen_crd.py``."""

    # The pattern allows at most 32 characters; the CRD states it too, for CEL's cost estimate.
    name: str = Field(pattern=LANE_NAME_PATTERN, json_schema_extra={"maxLength": 32})
    max_batch_size: int = Field(alias="maxBatchSize", ge=1, le=4096, description="most rows in one model call")
    max_queue_delay: Duration = Field(
        alias="maxQueueDelay", description="batching window, the longest a row waits for batch-mates (e.g. 2ms)"
    )
    max_queue_length: int = Field(
        alias="maxQueueLength",
        ge=1,
        le=1_000_000,
        description="rows that may wait; beyond it requests are answered 429",
    )
    request_timeout: Duration = Field(
        alias="requestTimeout", description="a request still queued after this is answered 504 and not run"
    )
    priority: int = Field(
        default=0, ge=0, le=100, description="higher is served first (background lanes still progress)"
    )

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
    isolation: Literal["process", "thread"] = Field(
        default="process",
        description="process: the model runs in its own process (its latency is not the HTTP loop's); "
        "thread: in the server's interpreter, beside the loop (bench/model_isolation.py compares them)",
    )


TENANT_HEADER = "X-Batchpilot-Tenant"
DEFAULT_TENANT = "default"
"""The tenant of a request that names none (no header, no ``parameters.tenant``)."""
OTHER_TENANT = "other"
"""The tenant of a request naming a tenant the policy does not declare."""
MAX_TENANTS = 8
"""Declared tenants at most: with ``default`` and ``other``, a ``tenant`` label takes at most 10 values."""
TENANT_NAME_PATTERN = LANE_NAME_PATTERN
HEADER_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9-]{0,62}$"


class TenantsConfig(_Model):
    """Which tenants the metrics tell apart (the ``tenant`` label), and where a request names its own.

    A request's tenant is the ``header`` (default ``X-Batchpilot-Tenant``), else its
    ``parameters.tenant``; a declared name is kept, any other name counts as ``other`` and a
    request naming none as ``default``, so the label is bounded by the declared list.
    """

    names: list[str] = Field(default_factory=list, max_length=MAX_TENANTS)
    header: str = Field(default=TENANT_HEADER, pattern=HEADER_NAME_PATTERN)

    @model_validator(mode="after")
    def _names(self) -> TenantsConfig:
        for name in self.names:
            if not re.match(TENANT_NAME_PATTERN, name):
                raise ValueError(f"tenant name {name!r} must match {TENANT_NAME_PATTERN} (like a lane name)")
            if name in (DEFAULT_TENANT, OTHER_TENANT):
                raise ValueError(f"tenant name {name!r} is reserved (requests naming no tenant, or an undeclared one)")
        if len(set(self.names)) != len(self.names):
            raise ValueError("tenants: names must be unique")
        return self

    def label(self, named: str | None) -> str:
        """The ``tenant`` label of a request that named ``named`` (None or empty: none)."""
        if not named or named == DEFAULT_TENANT:
            return DEFAULT_TENANT
        return named if named in self.names else OTHER_TENANT

    @property
    def labels(self) -> list[str]:
        """Every value the ``tenant`` label can take."""
        return [*self.names, DEFAULT_TENANT, OTHER_TENANT]


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
    tenants: TenantsConfig | None = Field(
        default=None, description="absent: every request is tenant 'default' (the config of a policy without tenants)"
    )

    @property
    def tenant_config(self) -> TenantsConfig:
        return self.tenants or TenantsConfig()

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
