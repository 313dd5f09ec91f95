"""One reconcile of one BatchingPolicy: observe, (maybe) analyse, plan, execute.

The decision is :func:`batchpilot_operator.rollout.plan` (pure); this module only gathers
its inputs and carries out the :class:`Decision`. The policy's body and its children are
read from a :class:`ChildReader`: the operator passes its watch-fed caches
(``control.cache``), so a reconcile issues no GET or LIST; without one it reads the API.
The kopf handlers in ``handlers.py`` call :func:`reconcile` and nothing else.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

from pydantic import ValidationError

from batchpilot_operator import children, crashpoints, fairness, ledger, modelwatch, opmetrics, recommender, traffic
from batchpilot_operator.analysis import AnalysisResult, MetricsBackend, run_analysis
from batchpilot_operator.children import LABEL_ENVIRONMENT, LABEL_REVISION, LABEL_TRACK, Manifest, Track
from batchpilot_operator.kube import Kube, TransientKubeError, same_json
from batchpilot_operator.rollout import (
    Commands,
    Decision,
    Observed,
    PlanInputs,
    TrackObserved,
    analysis_due,
    analysis_target,
    plan,
    pods_needed,
)
from batchpilot_operator.spec import PolicySpec, TrafficRouting, parse_spec
from batchpilot_operator.status import Status

log = logging.getLogger(__name__)

EmitEvent = Callable[[str, str, str], None]
"""(type, reason, message) -> None: posts a Kubernetes Event on the policy."""


class ChildReader(Protocol):
    """Where a reconcile reads a policy's children from (the caches, or the API itself)."""

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> Manifest | None: ...

    def list_owned(self, api_version: str, kind: str, namespace: str, policy: str) -> list[Manifest]: ...


@dataclass
class ReconcileResult:
    writes: int
    decision: Decision | None
    requeue_after: float | None


def environment_of(body: dict[str, Any]) -> str | None:
    """The policy's ``batchpilot.dev/environment`` label (staging, prod, ...), if any."""
    value = ((body.get("metadata") or {}).get("labels") or {}).get(LABEL_ENVIRONMENT)
    return str(value) if value else None


def new_ready_replicas(status: dict[str, Any]) -> int:
    """Ready pods that surely run the Deployment's current template.

    ``readyReplicas`` counts the old ReplicaSet's pods too: in the middle of a rolling update
    (maxSurge 1: 1 old and 2 new pods, the second new one not ready yet) ``min(updatedReplicas,
    readyReplicas)`` already says 2 of 2, and a promotion would move the whole route to a stable
    half of which still runs the old revision. Counting every old pod as ready gives the lower
    bound (what ``kubectl rollout status`` waits for: no old pod left, every new one ready)."""
    updated = int(status.get("updatedReplicas", 0))
    old = max(0, int(status.get("replicas", 0)) - updated)
    return max(0, min(updated, int(status.get("readyReplicas", 0)) - old))


def observe_track(deployment: Manifest | None) -> TrackObserved | None:
    if deployment is None:
        return None
    spec = deployment.get("spec", {})
    status = deployment.get("status") or {}
    labels = spec.get("template", {}).get("metadata", {}).get("labels", {})
    current = status.get("observedGeneration", 0) >= deployment["metadata"].get("generation", 0)
    ready = new_ready_replicas(status) if current else 0
    return TrackObserved(
        revision=labels.get(LABEL_REVISION), replicas=spec.get("replicas", 0), ready_replicas=ready, settled=current
    )


def invalid_spec_status(body: dict[str, Any], error: ValidationError, now: datetime) -> dict[str, Any]:
    """Status of a policy whose spec the models reject (the CRD should have caught it)."""
    status = dict(body.get("status") or {})
    message = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors())
    status["message"] = f"invalid spec: {message}"
    status["observedGeneration"] = body["metadata"].get("generation", 0)
    status["conditions"] = [
        {
            "type": "Stalled",
            "status": "True",
            "reason": "InvalidSpec",
            "message": message,
            "lastTransitionTime": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
            "observedGeneration": status["observedGeneration"],
        }
    ]
    return status


def reconcile(
    kube: Kube,
    metrics: MetricsBackend,
    body: dict[str, Any],
    emit: EmitEvent,
    now: datetime | None = None,
    reader: ChildReader | None = None,
) -> ReconcileResult:
    now = now or datetime.now(UTC)
    reader = reader or kube
    meta = body["metadata"]
    name, namespace = meta["name"], meta["namespace"]
    if meta.get("deletionTimestamp"):
        return ReconcileResult(0, None, None)
    try:
        spec = parse_spec(body.get("spec") or {})
    except ValidationError as exc:
        new_status = invalid_spec_status(body, exc, now)
        if not same_json(new_status, body.get("status")):
            kube.replace_status(namespace, name, meta["resourceVersion"], new_status)
            emit("Warning", "InvalidSpec", new_status["message"])
            return ReconcileResult(1, None, None)
        return ReconcileResult(0, None, None)

    status = Status.from_dict(body.get("status"))
    status = recommender.refresh(kube, spec, body, status, now, emit)  # spec.tuning; no I/O unless due
    deployments: dict[Track, Manifest | None] = {
        track: reader.get("apps/v1", "Deployment", namespace, children.deployment_name(name, track))
        for track in ("stable", "canary")
    }
    routing = spec.rollout.traffic_routing
    route: Manifest | None = None
    if routing is not None:
        # Read from the API (not a cache): the weights are written against this resourceVersion.
        route = kube.get(traffic.GATEWAY_API_VERSION, traffic.HTTPROUTE_KIND, namespace, routing.gateway_api.http_route)
    observed = Observed(
        stable=observe_track(deployments["stable"]),
        canary=observe_track(deployments["canary"]),
        route=traffic.observe_route(route, routing, name) if routing is not None else None,
    )

    analysis: AnalysisResult | None = None
    target = analysis_target(status)
    if target is not None and analysis_due(spec, status, now):
        canary_revision, stable_revision = target
        analysis = run_analysis(
            metrics,
            spec,
            policy=name,
            namespace=namespace,
            canary_revision=canary_revision,
            stable_revision=stable_revision,
            now=now,
            history=status.rollout.evidence if status.rollout is not None else None,
            environment=environment_of(body),
            unlike_load=fairness.unlike_load(spec, status.rollout.step_index if status.rollout is not None else 0),
        )
        if routing is not None:
            analysis = fairness.judge_load(
                metrics,
                analysis,
                routing,
                policy=name,
                namespace=namespace,
                spec=spec,
                step_index=status.rollout.step_index if status.rollout is not None else 0,
                now=now,
                emit=emit,
            )
        # With spec.tuning: the latency model beside each revision over the same window (no verdict).
        analysis = modelwatch.attach(kube, spec, status, analysis, policy=name, namespace=namespace)

    trouble: dict[str, str] = {}
    tracks = pods_needed(spec, status, observed, now)
    if tracks:  # only in trouble: one LIST of the policy's pods (they are not cached)
        pods = kube.list_owned("v1", "Pod", namespace, name)
        for track in tracks:
            mine = [p for p in pods if (p["metadata"].get("labels") or {}).get(LABEL_TRACK) == track]
            summary = children.pod_trouble(mine)
            if summary:
                trouble[track] = summary

    decision = plan(
        PlanInputs(
            spec=spec,
            generation=meta.get("generation", 0),
            status=status,
            observed=observed,
            now=now,
            analysis=analysis,
            commands=Commands.from_annotations(meta.get("annotations")),
            pod_trouble=trouble,
        )
    )

    def announce() -> None:
        for event in decision.events:
            emit(event.type, event.reason, event.message)
        opmetrics.record(namespace, name, spec, decision)

    writes = execute(kube, body, spec, decision, deployments, reader, route, announce)
    requeue = decision.requeue_after
    due = recommender.next_due(decision.status) if spec.tuning is not None else None
    if due is not None:  # the next spec.tuning recommendation is a due time too
        until = max(0.0, (due - now).total_seconds())
        requeue = until if requeue is None else min(requeue, until)
    return ReconcileResult(writes, decision, requeue)


def execute(
    kube: Kube,
    body: dict[str, Any],
    spec: PolicySpec,
    decision: Decision,
    deployments: dict[Track, Manifest | None],
    reader: ChildReader | None = None,
    route: Manifest | None = None,
    announce: Callable[[], None] | None = None,
) -> int:
    """Write the status, announce it, then make the children match the decision; count the writes.

    The status goes first: it is the record of the decision (ledger, failure count, stable
    revision). A crash after it replays the same decision from it: the children converge
    and nothing is decided twice. (Children first, a crash before the status write would
    lose the decision: a rolled-back canary re-created, a counted failure forgotten, a
    promotion's stable switch reverted and redone.) ``announce`` (the decision's Events and
    operator metrics) runs right after the status write: whoever sees a decision in the
    status, or its effect on a child, finds its Event and its count already there. Writes are ordered so that no pod ever
    runs a revision whose ConfigMap is missing: ConfigMaps before the Deployments that mount
    them; a ConfigMap is deleted only once no Deployment, as observed, runs its revision.
    See ``crashpoints`` for the points the drills crash at.

    The children's order never drops a request: ConfigMaps, the stable, the canary scaled
    up, the Services, the route's weights (``traffic``), and only then a canary scaled away.
    """
    meta = body["metadata"]
    name, namespace = meta["name"], meta["namespace"]
    reader = reader or kube
    status_written = _write_status(kube, body, decision)
    writes = int(status_written)
    if announce is not None:
        announce()
    if status_written:
        if decision.analysis_outcomes:
            crashpoints.reached("analysis-recorded")
        if any(e.reason == "StepAdvanced" for e in decision.events):
            crashpoints.reached("step-advanced")
        if "RolledBack" in decision.rollout_outcomes:
            crashpoints.reached("rollback-half-done")
    writes += archive_decisions(kube, reader, body, decision.status)
    configmaps = {
        cm["metadata"]["labels"][LABEL_REVISION]: cm
        for cm in reader.list_owned("v1", "ConfigMap", namespace, name)
        if LABEL_REVISION in (cm["metadata"].get("labels") or {})
    }
    needed = [decision.stable_revision] + ([decision.canary_revision] if decision.canary_revision else [])
    writes += _write_configmaps(kube, body, spec, needed, configmaps)
    writes += _write_deployments(kube, body, spec, decision, deployments, status_written)
    service = children.build_service(name, namespace, meta["uid"])
    writes += kube.apply(service, reader.get("v1", "Service", namespace, name))
    routing = spec.rollout.traffic_routing
    if routing is not None:
        writes += write_route(kube, reader, body, routing, decision, route)
    if not (decision.canary_revision and decision.canary_replicas > 0) and deployments["canary"] is not None:
        writes += kube.delete("apps/v1", "Deployment", namespace, children.deployment_name(name, "canary"))
    writes += _prune_configmaps(kube, namespace, decision, needed, deployments, configmaps)
    return writes


def _write_status(kube: Kube, body: dict[str, Any], decision: Decision) -> bool:
    """Replace the policy's status with the decision's, unless it is the same; whether it wrote."""
    meta = body["metadata"]
    new_status = decision.status.to_dict()
    if decision.status.current_step_index is not None and decision.status.step_count:
        new_status["stepLabel"] = f"{decision.status.current_step_index + 1}/{decision.status.step_count}"
    if same_json(new_status, body.get("status") or {}):
        return False
    kube.replace_status(meta["namespace"], meta["name"], meta["resourceVersion"], new_status)
    return True


def _write_configmaps(
    kube: Kube, body: dict[str, Any], spec: PolicySpec, needed: list[str], configmaps: dict[str, Manifest]
) -> int:
    """Create the ConfigMap of each needed revision that has none (before any Deployment mounts it)."""
    meta = body["metadata"]
    writes = 0
    for revision in needed:
        if revision in configmaps:
            # Immutable and named by its content hash: an existing one is final. (Rebuilt from
            # the current spec, the stable revision's ConfigMap would differ mid-canary, and
            # applying it would only be refused, once per reconcile.)
            continue
        manifest = children.build_configmap(meta["name"], meta["namespace"], meta["uid"], spec, revision)
        if kube.apply(manifest, None):
            writes += 1
            crashpoints.reached("configmap-written")
    return writes


def _write_deployments(
    kube: Kube,
    body: dict[str, Any],
    spec: PolicySpec,
    decision: Decision,
    deployments: dict[Track, Manifest | None],
    status_written: bool,
) -> int:
    """Apply the stable's Deployment, then the canary's while the decision runs one (scaled up
    before the Services and the route send it traffic; scaled away only after them)."""
    meta = body["metadata"]
    name, namespace, uid = meta["name"], meta["namespace"], meta["uid"]
    stable = children.build_deployment(
        name,
        namespace,
        uid,
        spec,
        "stable",
        decision.stable_revision,
        decision.stable_replicas,
        environment=environment_of(body),
    )
    running = observe_track(deployments["stable"])
    if (
        deployments["stable"] is not None
        and running is not None
        and running.revision == decision.stable_revision != spec.revision()
    ):
        # The spec's pod fields belong to the canary: the stable keeps what it runs.
        stable = children.keep_running_pod_fields(stable, deployments["stable"])
    writes = int(kube.apply(stable, deployments["stable"]))
    if "Promoted" in decision.rollout_outcomes and status_written:
        crashpoints.reached("promotion-half-done")
    if decision.canary_revision and decision.canary_replicas > 0:
        created = kube.apply(
            children.build_deployment(
                name,
                namespace,
                uid,
                spec,
                "canary",
                decision.canary_revision,
                decision.canary_replicas,
                environment=environment_of(body),
            ),
            deployments["canary"],
        )
        writes += created
        if created and deployments["canary"] is None:
            crashpoints.reached("canary-created")
    return writes


def _prune_configmaps(
    kube: Kube,
    namespace: str,
    decision: Decision,
    needed: list[str],
    deployments: dict[Track, Manifest | None],
    configmaps: dict[str, Manifest],
) -> int:
    """Delete the ConfigMaps of revisions that no Deployment runs, as observed before this
    reconcile's writes, and that the decision neither needs nor keeps."""
    keep = set(decision.keep_revisions) | set(needed)
    for deployment in deployments.values():
        running = observe_track(deployment)
        if running is not None and running.revision is not None:
            keep.add(running.revision)
    writes = 0
    for revision, cm in configmaps.items():
        if revision not in keep:
            writes += kube.delete("v1", "ConfigMap", namespace, cm["metadata"]["name"])
    return writes


def archive_decisions(kube: Kube, reader: ChildReader, body: dict[str, Any], status: Status) -> int:
    """Append the status ledger's decisions that the policy's ledger ConfigMap lacks (``ledger``).

    After the status write: a crash between the two loses nothing, since the next reconcile
    appends them from status (a decision leaves status only after :data:`DECISION_LIMIT`
    newer ones, each of which got here first)."""
    meta = body["metadata"]
    name, namespace = meta["name"], meta["namespace"]
    cm_name = ledger.archive_name(name)
    current = reader.get("v1", "ConfigMap", namespace, cm_name)
    if ledger.up_to_date(current, status.ledger):  # the common case: no parse of the archive
        return 0
    archive = ledger.archived(current)
    entries = ledger.merged(archive, status.ledger)
    if len(entries) == len(archive):
        return 0
    keep = (status.stable_revision, status.canary_revision, status.desired_revision)
    last = {ledger.LAST_ANNOTATION: ledger.digest(entries[-1])}
    manifest = children.build_ledger_configmap(
        name, namespace, meta["uid"], cm_name, ledger.archive_data(entries, keep), last
    )
    return int(kube.apply(manifest, current))


def write_route(
    kube: Kube,
    reader: ChildReader,
    body: dict[str, Any],
    routing: TrafficRouting,
    decision: Decision,
    route: Manifest | None,
) -> int:
    """The track Services, then the HTTPRoute's weights (only ``spec.rules``, by server-side
    apply under our field manager, conditional on the route's resourceVersion)."""
    meta = body["metadata"]
    name, namespace, uid = meta["name"], meta["namespace"], meta["uid"]
    writes = 0
    ports: dict[str, int] = {}
    for track in ("stable", "canary"):
        svc_name = traffic.track_service_name(name, track)
        current = reader.get("v1", "Service", namespace, svc_name)
        if current is not None and not children.owned_by_policy(current, name):
            # A track Service someone else made (labelled with the policy): used as it is.
            ports[track] = children.service_port(current) or children.TRACK_SERVICE_PORT
            continue
        writes += kube.apply(children.build_track_service(name, namespace, uid, track), current)
        ports[track] = children.TRACK_SERVICE_PORT
    if decision.route is None:
        return writes
    if route is None:
        raise TransientKubeError(
            f"HTTPRoute {namespace}/{routing.gateway_api.http_route} (spec.rollout.trafficRouting) not found"
        )
    try:
        rules = traffic.route_rules(route, routing, name, decision.route, ports)
    except traffic.RouteError as exc:
        raise TransientKubeError(str(exc)) from exc
    if same_json(rules, (route.get("spec") or {}).get("rules")):
        return writes
    kube.apply_fields(traffic.route_apply_body(route, rules))
    log.info(
        "%s/%s: HTTPRoute %s weights stable %d / canary %d%s",
        namespace,
        name,
        routing.gateway_api.http_route,
        decision.route.stable_weight,
        decision.route.canary_weight,
        " (+ header rule)" if decision.route.header and routing.header else "",
    )
    return writes + 1
