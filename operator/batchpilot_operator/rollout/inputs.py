"""What :func:`~batchpilot_operator.rollout.plan` reads (:class:`PlanInputs`: the policy, its
status, its children as observed, the manual commands, one analysis) and what it decides
(:class:`Decision`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal

from batchpilot_operator.analysis import AnalysisResult
from batchpilot_operator.spec import PolicySpec
from batchpilot_operator.status import Status
from batchpilot_operator.traffic import RouteObserved, RouteTarget

ANNOTATION_PREFIX = "batchpilot.dev/"
PAUSE_ANNOTATION = ANNOTATION_PREFIX + "pause"
PROMOTE_ANNOTATION = ANNOTATION_PREFIX + "promote"
ABORT_ANNOTATION = ANNOTATION_PREFIX + "abort"
RETRY_ANNOTATION = ANNOTATION_PREFIX + "retry"
RESUME_ANNOTATION = ANNOTATION_PREFIX + "resume"
"""Who resumed (``user@time``): ``kubectl batchpilot resume`` sets it as it removes the pause."""

POLL_SECONDS = 5.0
"""Requeue while waiting for pods (first rollout, canary step, promotion finishing)."""
ROUTE_DRAIN_SECONDS = 10.0
"""A routed canary (``trafficRouting``) that is leaving keeps its pods this long after the
HTTPRoute is read sending it nothing: the gateway's data plane applies a route some time after
the apiserver holds it (Contour, then Envoy), and requests it already sent must finish. Argo
Rollouts waits likewise before scaling a canary down (``scaleDownDelaySeconds``)."""
CANARY_READY_DEADLINE = 600.0
"""The default of ``spec.rollout.progressDeadline`` (Argo Rollouts' progressDeadlineSeconds)."""

EventType = Literal["Normal", "Warning"]
CommandName = Literal["promote", "abort", "retry"]


@dataclass(frozen=True)
class TrackObserved:
    """One track's Deployment as observed.

    ``revision``: the revision of its pod template; ``replicas``: its ``spec.replicas``;
    ``ready_replicas``: ready pods running that revision (for a Deployment whose
    ``status.observedGeneration`` is current, ``controller.new_ready_replicas``: ready pods less
    any old pod still there, at most ``updatedReplicas``).
    """

    revision: str | None
    replicas: int = 0
    ready_replicas: int = 0
    settled: bool = True
    """Its controller has observed the current generation: False for a moment after every
    scale or template change, when ``ready_replicas`` reads 0 (safe for the route) and says
    nothing of a loss (``Degraded`` waits for it)."""


@dataclass(frozen=True)
class Observed:
    stable: TrackObserved | None = None
    canary: TrackObserved | None = None
    route: RouteObserved | None = None
    """The HTTPRoute's weights as read (spec.rollout.trafficRouting only)."""


@dataclass(frozen=True)
class Commands:
    """Manual commands, read from the policy's annotations (never from spec)."""

    pause: str | None = None
    promote: str | None = None
    abort: str | None = None
    retry: str | None = None
    resume: str | None = None

    @classmethod
    def from_annotations(cls, annotations: Mapping[str, str] | None) -> Commands:
        ann = annotations or {}
        return cls(
            pause=ann.get(PAUSE_ANNOTATION),
            promote=ann.get(PROMOTE_ANNOTATION),
            abort=ann.get(ABORT_ANNOTATION),
            retry=ann.get(RETRY_ANNOTATION),
            resume=ann.get(RESUME_ANNOTATION),
        )

    @property
    def paused(self) -> bool:
        return self.pause is not None and self.pause.strip().lower() not in ("", "false")

    def get(self, name: CommandName) -> str | None:
        value: str | None = getattr(self, name)
        return value or None


@dataclass(frozen=True)
class PlanInputs:
    spec: PolicySpec
    generation: int
    status: Status
    observed: Observed
    now: datetime
    analysis: AnalysisResult | None = None
    commands: Commands = field(default_factory=Commands)
    pod_trouble: Mapping[str, str] = field(default_factory=dict)
    """Per track ("stable", "canary"): why its pods are not ready, in words (e.g.
    ``pod p-canary-x: Unschedulable: 0/2 nodes are available: ...``), as the controller read
    them from the pods when :func:`pods_needed` said so; absent when not read."""


@dataclass(frozen=True)
class Event:
    type: EventType
    reason: str
    message: str


@dataclass(frozen=True)
class Decision:
    status: Status
    stable_revision: str
    stable_replicas: int
    canary_revision: str | None
    canary_replicas: int
    keep_revisions: tuple[str, ...]
    """Revisions whose ConfigMaps must exist; delete this policy's other revision ConfigMaps."""
    events: tuple[Event, ...] = ()
    rollout_outcomes: tuple[str, ...] = ()
    """One entry per finished rollout: Promoted, RolledBack, Aborted, Superseded."""
    rollback_reasons: tuple[str, ...] = ()
    """One entry per rollback: AnalysisFailed, MetricsUnavailable, CanaryNotReady, Aborted."""
    analysis_outcomes: tuple[str, ...] = ()
    """One entry per analysis consumed: Successful, Failed, Inconclusive, Error."""
    requeue_after: float | None = None
    """Seconds until plan() should run again without an outside change; None: no timer."""
    route: RouteTarget | None = None
    """With spec.rollout.trafficRouting: the HTTPRoute weights to write (before any canary
    scale-down of this decision; see ``traffic``)."""
