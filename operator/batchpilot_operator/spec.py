"""The BatchingPolicy spec as pydantic models: the Python twin of ``crds/batchingpolicy.yaml``.

Every cross-field rule here is also a CEL rule in the CRD, with the same message, so a
policy is judged the same way at admission and by ``batchpilot validate`` in CI
(tests/operator/test_crd.py holds the two to the same table of cases, the models here and the
real kube-apiserver). A lane's fields are declared once, in ``batchpilot_runtime.config.LaneConfig``;
:class:`LaneSpec` adds the operator's own, and ``hack/gen_crd.py`` writes the CRD's lane schema
from it (tests/operator/test_crd_lane_contract.py fails when the two differ).
Pure: imports no kopf and no Kubernetes client.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from batchpilot_runtime.config import (
    DEFAULT_TENANT,
    HEADER_NAME_PATTERN,
    LANE_NAME_PATTERN,
    MAX_TENANTS,
    MODEL_SOURCE_PATTERN,
    OTHER_TENANT,
    TENANT_HEADER,
    Duration,
    LaneConfig,
    ModelConfig,
    RuntimeConfig,
    TenantsConfig,
    format_duration,
    is_duration,
)

GROUP = "batchpilot.dev"
VERSION = "v1alpha1"
KIND = "BatchingPolicy"
PLURAL = "batchingpolicies"
API_VERSION = f"{GROUP}/{VERSION}"


class _Spec(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True)


_FROM_MANIFEST = "batchpilot.from_manifest"
"""Validation-context key set by :func:`parse_spec`: the input is a manifest, typed as the CRD."""


def _duration_string(value: object, info: ValidationInfo) -> object:
    # The CRD types every duration `string`; Python callers may still pass float seconds.
    if info.context and info.context.get(_FROM_MANIFEST) and not isinstance(value, str):
        raise ValueError(f"must be a duration string such as '5ms' or '1m30s' (the CRD's type: string), got {value!r}")
    return value


SpecDuration = Annotated[Duration, BeforeValidator(_duration_string)]
"""A duration field of the spec: a string in manifests (as admission demands), float seconds inside."""


def _whole_number(value: object) -> object:
    # JSON has one number type: kubectl and Argo CD send `8.0` as 8 and the apiserver admits it
    # as an integer, so the twin does too; 8.5, "8" and true stay rejected, as there.
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


SpecInt = Annotated[int, BeforeValidator(_whole_number)]
"""An integer field of the spec (the CRD's `type: integer`)."""


DEFAULT_MAX_ERROR_RATE = 0.01


class SLO(_Spec):
    p99_latency: SpecDuration = Field(alias="p99Latency", gt=0)
    max_queue_age: SpecDuration = Field(alias="maxQueueAge", gt=0)
    max_error_rate: float = Field(
        default=DEFAULT_MAX_ERROR_RATE,
        alias="maxErrorRate",
        ge=0,
        le=1,
        description="largest fraction of well-formed requests answered 429/503/504/500 over an analysis",
    )


class LaneSpec(LaneConfig):
    """A lane of the spec: the runtime's lane (:class:`LaneConfig`, where its fields are declared)
    plus what only the operator reads, typed as the CRD types them (see :meth:`_as_the_crd_types`).

    The runtime's fields pass to the pods through :meth:`runtime_lane`; the others never reach a
    pod, so they are no part of the revision."""

    slo: SLO | None = None
    expected_rate: float | None = Field(
        default=None,
        alias="expectedRate",
        gt=0,
        description="requests/s the lane must sustain (all replicas), for `batchpilot validate`",
    )

    @field_validator(*LaneConfig.model_fields, mode="before")
    @classmethod
    def _as_the_crd_types(cls, value: object, info: ValidationInfo) -> object:
        # The runtime's fields, as SpecInt and SpecDuration type the spec's own: a whole float
        # is an integer, and a manifest spells every duration as a string.
        assert info.field_name is not None
        field = LaneConfig.model_fields[info.field_name]
        if field.annotation is int:
            return _whole_number(value)
        if is_duration(field):
            return _duration_string(value, info)
        return value

    @model_validator(mode="after")
    def _timeout_covers_window(self) -> LaneSpec:
        # The runtime's rule, in the words of the CRD's CEL rule (it replaces LaneConfig's).
        if self.request_timeout <= self.max_queue_delay:
            raise ValueError(
                f"spec.lanes[{self.name}].requestTimeout must be longer than maxQueueDelay: "
                "raise requestTimeout or shorten the window"
            )
        return self

    @model_validator(mode="after")
    def _window_under_slo(self) -> LaneSpec:
        if self.slo is not None and self.max_queue_delay >= self.slo.p99_latency:
            raise ValueError(
                f"spec.lanes[{self.name}].maxQueueDelay must be shorter than the lane's slo.p99Latency: "
                "shorten the batching window or relax the SLO"
            )
        return self

    def runtime_lane(self) -> LaneConfig:
        """The lane as the runtime reads it: every field of :class:`LaneConfig`, none of the operator's."""
        return LaneConfig(**{name: getattr(self, name) for name in LaneConfig.model_fields})


RUNTIME_LANE_KEYS = frozenset(field.alias or name for name, field in LaneConfig.model_fields.items())
"""The keys of a lane in a manifest that its pods run (the others are the operator's)."""


class ModelSpec(_Spec):
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
    image: str = Field(min_length=1, max_length=512)
    source: str = Field(pattern=MODEL_SOURCE_PATTERN)
    device: Literal["auto", "cpu", "cuda"] = "cuda"
    dtype: Literal["float32", "float16", "bfloat16"] = "float16"
    threads: SpecInt | None = Field(default=None, ge=1, le=256)


class Resources(_Spec):
    gpus: SpecInt = Field(default=1, ge=0, le=16)
    cpu: str | None = Field(default=None, pattern=r"^([0-9]+m|[0-9]+(\.[0-9]+)?)$")
    memory: str | None = Field(default=None, pattern=r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|k|M|G|T)?$")


class Toleration(_Spec):
    key: str | None = None
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: SpecInt | None = Field(default=None, alias="tolerationSeconds")


class CanaryStep(_Spec):
    weight: SpecInt = Field(ge=1, le=100)
    pause: SpecDuration = Field(default=60.0, description="how long the step runs before the next one")


class OnMetricsUnavailable(_Spec):
    action: Literal["Hold", "Rollback"] = "Hold"
    deadline: SpecDuration = Field(default=600.0, description="with Rollback: how long metrics may be missing")


def _default_steps() -> list[CanaryStep]:
    return [CanaryStep(weight=25, pause=60.0), CanaryStep(weight=50, pause=60.0)]


class RolloutSpec(_Spec):
    steps: list[CanaryStep] = Field(default_factory=_default_steps, min_length=1, max_length=20)
    analysis_interval: SpecDuration = Field(default=30.0, alias="analysisInterval", gt=0)
    failure_limit: SpecInt = Field(default=2, alias="failureLimit", ge=1, le=100)
    min_samples: SpecInt = Field(
        default=100,
        alias="minSamples",
        ge=1,
        description="fewer requests in an analysis window: Inconclusive (a p99 needs 100)",
    )
    confidence: float = Field(
        default=0.95,
        ge=0.5,
        le=0.9999,
        description=(
            "how sure the analysis must be before it blames the canary: that the canary is over its SLO budget"
            " and worse than the stable over the same window (exact tests on the requests over the objective)"
        ),
    )
    max_p99_increase: float | None = Field(
        default=None,
        alias="maxP99Increase",
        gt=0,
        le=9,
        description=(
            "opt-in: how much the canary's p99 latency may exceed the stable's over the same window, as a fraction"
            " (0.25: 1.25x the stable's), judged like an SLO (more than 1% of its requests slower than that, with"
            " the confidence, fails it); absent: only the lanes' SLOs are judged, and a regression that stays"
            " inside them passes"
        ),
    )
    max_inconclusive: SpecInt = Field(
        default=10,
        alias="maxInconclusive",
        ge=1,
        le=1000,
        description=(
            "Inconclusive analyses in a row before the rollout stalls (it never rolls back for this);"
            " one that passes the step on a breach both tracks share is not counted"
        ),
    )
    on_metrics_unavailable: OnMetricsUnavailable = Field(
        default_factory=OnMetricsUnavailable, alias="onMetricsUnavailable"
    )
    history_limit: SpecInt = Field(default=5, alias="historyLimit", ge=1, le=50)
    # issue 11 (drills): a canary whose pods are not all ready this long after its step began
    # (unschedulable, crash loop, image pull) is rolled back with reason CanaryNotReady.
    progress_deadline: SpecDuration = Field(
        default=600.0,
        alias="progressDeadline",
        gt=0,
        description="how long a step may wait for its canary pods to be ready before the canary is rolled back",
    )
    warmup: SpecDuration = Field(
        default=0.0,
        ge=0,
        le=3600.0,
        description=(
            "how long a step's canary pods serve once they are all ready before the step clock starts and its"
            " first analysis window opens (Argo Rollouts' initialDelay, Kubernetes' minReadySeconds): traffic"
            " to pods that have just started is not judged"
        ),
    )
    traffic_routing: TrafficRouting | None = Field(default=None, alias="trafficRouting")

    @model_validator(mode="after")
    def _steps_increasing(self) -> RolloutSpec:
        weights = [s.weight for s in self.steps]
        if any(b <= a for a, b in itertools.pairwise(weights)):
            raise ValueError("spec.rollout.steps: weights must increase strictly from step to step (e.g. 10, 25, 50)")
        return self


MAX_TUNING_WINDOW = 3600.0
"""The runtime keeps at most an hour of arrivals (batchpilot_runtime.capture.DEFAULT_MAX_AGE)."""


class TuningSpec(_Spec):
    """Scheduled recommendations from the pods' own traffic (absent: off). Never edits the spec."""

    interval: Duration = Field(default=3600.0, ge=10.0, description="how often to recommend")
    window: Duration | None = Field(
        default=None, description="arrivals to read, back from now (default: the interval, at most 1h)"
    )
    growth: float = Field(default=2.0, ge=1.0, le=100.0, description="traffic growth to plan for (2: doubling)")
    margin: float = Field(default=0.2, ge=0.0, lt=1.0, description="safety margin under the SLO")

    @model_validator(mode="after")
    def _window(self) -> TuningSpec:
        if self.window is not None and not 0 < self.window <= MAX_TUNING_WINDOW:
            raise ValueError("spec.tuning.window must be greater than zero and at most 1h (the runtime keeps 1h)")
        return self

    @property
    def read_window(self) -> float:
        return self.window if self.window is not None else min(self.interval, MAX_TUNING_WINDOW)


# ---- issue 12: tenants the metrics and the canary analysis slice by --------------------------


class TenantsSpec(_Spec):
    """The tenants a policy's metrics tell apart and the canary analysis judges one by one.

    At most :data:`MAX_TENANTS` names, so the runtime's ``tenant`` label takes at most 10 values
    (the names, ``default`` for requests naming none, ``other`` for undeclared names)."""

    names: list[Annotated[str, Field(pattern=LANE_NAME_PATTERN)]] = Field(min_length=1, max_length=MAX_TENANTS)
    header: str = Field(default=TENANT_HEADER, pattern=HEADER_NAME_PATTERN, max_length=63)

    @model_validator(mode="after")
    def _names(self) -> TenantsSpec:
        if len(set(self.names)) != len(self.names):
            raise ValueError("spec.tenants.names must be unique")
        if {DEFAULT_TENANT, OTHER_TENANT} & set(self.names):
            raise ValueError(
                "spec.tenants.names: 'default' and 'other' are reserved (requests naming no tenant, or an undeclared one)"
            )
        return self

    def runtime(self) -> TenantsConfig:
        return TenantsConfig(names=list(self.names), header=self.header)


class PolicySpec(_Spec):
    model: ModelSpec
    replicas: SpecInt = Field(default=1, ge=1, le=1000)
    resources: Resources = Field(default_factory=Resources)
    node_selector: dict[str, str] = Field(default_factory=dict, alias="nodeSelector")
    tolerations: list[Toleration] = Field(default_factory=list, max_length=32)
    lanes: list[LaneSpec] = Field(min_length=1, max_length=8)
    default_lane: str | None = Field(default=None, alias="defaultLane")
    slo: SLO
    rollout: RolloutSpec = Field(default_factory=RolloutSpec)
    tuning: TuningSpec | None = None
    tenants: TenantsSpec | None = None

    @model_validator(mode="after")
    def _policy_rules(self) -> PolicySpec:
        names = [lane.name for lane in self.lanes]
        if len(set(names)) != len(names):
            raise ValueError("spec.lanes: lane names must be unique")
        if self.default_lane is not None and self.default_lane not in names:
            raise ValueError("spec.defaultLane must name one of spec.lanes")
        for lane in self.lanes:
            if lane.slo is None and lane.max_queue_delay >= self.slo.p99_latency:
                raise ValueError(
                    f"spec.lanes[{lane.name}].maxQueueDelay must be shorter than spec.slo.p99Latency: "
                    "shorten the batching window or relax the SLO"
                )
        return self

    def lane_slo(self, lane: str) -> SLO:
        for spec_lane in self.lanes:
            if spec_lane.name == lane:
                return spec_lane.slo or self.slo
        raise KeyError(lane)

    def revision_relevant(self) -> dict[str, Any]:
        """The part of the spec that the pods run: a change here is a new revision.

        Replicas, SLOs and the rollout block are read by the operator only, so changing
        them never restarts a pod nor starts a canary.
        """
        data = self.model_dump(mode="json", by_alias=True, exclude_none=True)
        return {
            key: data[key]
            for key in ("model", "resources", "nodeSelector", "tolerations", "lanes", "defaultLane", "tenants")
            if key in data
        } | {"lanes": [_lane_runtime_fields(lane) for lane in data["lanes"]]}

    def revision(self) -> str:
        """A short, stable hash of :meth:`revision_relevant` (10 hex characters)."""
        canonical = json.dumps(self.revision_relevant(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:10]

    def runtime_config(self, policy: str, revision: str, track: str = "stable") -> RuntimeConfig:
        """The runtime's config for this spec (track is filled in by the pod, not the ConfigMap)."""
        return RuntimeConfig(
            policy=policy,
            revision=revision,
            track=track,
            model=ModelConfig(
                name=self.model.name,
                source=self.model.source,
                device=self.model.device,
                dtype=self.model.dtype,
                threads=self.model.threads,
            ),
            lanes=[lane.runtime_lane() for lane in self.lanes],
            default_lane=self.default_lane,
            tenants=self.tenants.runtime() if self.tenants is not None else None,
        )

    @property
    def tenant_slices(self) -> list[str]:
        """The tenant slices the canary analysis judges besides each lane's total: every value of
        the ``tenant`` label (declared names, ``default``, ``other``); none without spec.tenants."""
        return self.tenants.runtime().labels if self.tenants is not None else []


def _lane_runtime_fields(lane: dict[str, Any]) -> dict[str, Any]:
    """A lane without its operator-only fields (SLO, expected rate)."""
    return {k: v for k, v in lane.items() if k in RUNTIME_LANE_KEYS}


def parse_spec(spec: dict[str, Any]) -> PolicySpec:
    """Validate a raw ``.spec`` mapping (from the API or a YAML file) exactly as admission types it.

    Strict, as the CRD's OpenAPI schema is: an integer field takes only an integer (not ``"8"``,
    ``8.5`` or ``true``), a number field a number, a string field a string and every duration a
    string. A null is dropped first, as the apiserver prunes a null of a non-nullable field
    (so a required field set to null is missing, and an optional one takes its default).
    """
    return PolicySpec.model_validate(_drop_nulls(spec), strict=True, context={_FROM_MANIFEST: True})


def _drop_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


def describe_duration(seconds: float) -> str:
    return format_duration(seconds)


# --------------------------------------------------------------------------- traffic routing (issue 13)

HTTP_HEADER_NAME_PATTERN = r"^[A-Za-z0-9!#$%&'*+\-.^_`|~]+$"
"""An HTTP header name (RFC 7230 token), as Gateway API's HTTPHeaderName admits it."""
K8S_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
SECTION_NAME_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"


class HeaderMatch(_Spec):
    """Requests carrying this header (exact value) go to the canary from its first ready step."""

    name: str = Field(min_length=1, max_length=256, pattern=HTTP_HEADER_NAME_PATTERN)
    value: str = Field(min_length=1, max_length=4096)


class GatewayAPIRouting(_Spec):
    http_route: str = Field(
        alias="httpRoute",
        min_length=1,
        max_length=253,
        pattern=K8S_NAME_PATTERN,
        description="the HTTPRoute (in the policy's namespace) that fronts the model",
    )
    rule: str | None = Field(
        default=None,
        min_length=1,
        max_length=253,
        pattern=SECTION_NAME_PATTERN,
        description="the name of the route's rule whose backendRefs the operator weighs (default: its first rule)",
    )


class TrafficRouting(_Spec):
    """Canary weights set exactly on a Gateway API HTTPRoute instead of the replica ratio."""

    gateway_api: GatewayAPIRouting = Field(alias="gatewayAPI")
    header: HeaderMatch | None = None
    min_canary_load_ratio: float = Field(
        default=0.5,
        alias="minCanaryLoadRatio",
        ge=0,
        le=1,
        description=(
            "a canary pod fed below this fraction of a stable pod's arrival rate cannot pass a step"
            " (its batches would be smaller, its latency optimistic): such an analysis is Inconclusive"
        ),
    )
    dynamic_stable_scale: bool = Field(
        default=False,
        alias="dynamicStableScale",
        description=(
            "scale the stable down as the canary's weight rises (ceil(replicas x (100 - weight) / 100) pods,"
            " once the route is seen sending the canary that weight), so every pod of both tracks carries"
            " about a promoted pod's load; a rollback or abort then keeps weight on the canary until the"
            " stable's pods are ready again"
        ),
    )


RolloutSpec.model_rebuild()
PolicySpec.model_rebuild()
