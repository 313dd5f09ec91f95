"""Canary traffic through a Gateway API HTTPRoute (``spec.rollout.trafficRouting``), pure.

Without ``trafficRouting`` the canary's share is its share of pods behind one Service
(``rollout.split_replicas``). With it, the operator runs two Services, ``<policy>-stable`` and
``<policy>-canary`` (one per track), and sets the weights of the named rule's backendRefs to
the step's weight exactly. Three functions decide it; ``controller`` carries them out:

* :func:`split_for_routing`: replicas per track. The stable keeps all ``replicas`` for the
  whole rollout (it can take 100% back at any moment, so a rollback never waits for pods); the
  canary gets ``round(replicas * w / (100 - w))`` pods (at least 1, at most ``replicas``): the
  count at which a canary pod's share ``w / c`` equals a stable pod's ``(100 - w) / replicas``,
  so its per-pod arrival rate is as close to the stable's as whole pods allow (``fairness``
  judges what remains). With ``dynamicStableScale`` (Argo Rollouts' field of that name) the
  stable gives up pods as the weight rises: ``ceil(replicas * (100 - w) / 100)`` (at least 1),
  and the canary gets ``round(stable * w / (100 - w))`` beside it, so every pod of both tracks
  carries about a promoted pod's load (at 50% of 2 replicas, 1 pod each at 50%, where without
  it 2 + 2 pods each carry 25%: a canary that never meets a promoted pod's load cannot show a
  regression that only that load brings out). The stable is scaled down only for the weight
  the route is *seen* sending the canary (``rollout.finish``), never ahead of it.
* :func:`desired_route`: the weight to write now, from the status the planner decided and the
  observed Deployments and route. The order never drops a request: a weight moves to the
  canary only once the canary's pods of that step are ready (until then it keeps the weight
  it had, or 0 for a new revision); a rollback, abort or supersede sets it to 0 at once, and
  the canary Deployment goes only when the route is *observed* at 0, and then only after
  ``rollout.ROUTE_DRAIN_SECONDS`` more (the data plane follows the route a moment later); with
  ``dynamicStableScale`` the weight leaves the canary only as fast as the stable's ready pods
  can take it back (``RouteInputs.stable_capacity``); a promotion keeps the last weight on the canary (which runs the
  new revision), and the header rule with it, until the stable runs it with every pod ready,
  then moves 100% to the stable and drops the header rule in one write, and the canary goes
  once the route shows neither.
* :func:`route_rules`: the HTTPRoute's ``spec.rules`` with only the target rule's backendRefs
  (and, with ``header``, one rule of ours before it sending matching requests to the canary)
  changed. Gateway API types ``spec.rules`` as an atomic list, so a server-side apply owns the
  whole list: the operator applies the live list with just these changes, guarded by the
  route's resourceVersion, so a concurrent change by another manager is never overwritten.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from batchpilot_operator.spec import PolicySpec, TrafficRouting

Manifest = dict[str, Any]
GATEWAY_API_VERSION = "gateway.networking.k8s.io/v1"
HTTPROUTE_KIND = "HTTPRoute"


class RouteError(ValueError):
    """The HTTPRoute cannot carry the weights (no such rule, no rules): a spec/route mismatch."""


def track_service_name(policy: str, track: str) -> str:
    return f"{policy}-{track}"


def split_for_routing(total: int, weight: int, dynamic_stable: bool = False) -> tuple[int, int]:
    """(stable, canary) replicas for a canary weight under traffic routing (``dynamic_stable``:
    the stable scaled to its share, ``dynamicStableScale``)."""
    if total < 1:
        raise ValueError(f"total replicas must be >= 1, got {total}")
    if not 0 <= weight <= 100:
        raise ValueError(f"weight must be 0..100, got {weight}")
    if weight == 0:
        return total, 0
    if weight >= 100:
        return total, total
    stable = dynamic_stable_replicas(total, weight) if dynamic_stable else total
    return stable, max(1, min(total, math.floor(stable * weight / (100 - weight) + 0.5)))


def scales_stable(spec: PolicySpec) -> bool:
    """Whether the stable is scaled to its share of the route (``dynamicStableScale``)."""
    return spec.rollout.traffic_routing is not None and spec.rollout.traffic_routing.dynamic_stable_scale


def dynamic_stable_replicas(total: int, weight: int) -> int:
    """The stable's pods under ``dynamicStableScale`` while the route sends the canary ``weight``
    percent: enough that none carries more than a promoted pod's share (``100 / total``)."""
    if weight <= 0:
        return total
    return max(1, math.ceil(total * (100 - min(weight, 100)) / 100))


def stable_capacity(total: int, ready: int) -> int:
    """The share of the traffic (percent) that ``ready`` stable pods take at a promoted pod's load
    each: under ``dynamicStableScale`` the weight leaves the canary no faster than this grows."""
    return min(100, math.floor(100 * max(0, ready) / total))


@dataclass(frozen=True)
class RouteObserved:
    """The route's weights as last read from the apiserver (None: route or rule missing)."""

    stable_weight: int
    canary_weight: int
    header_rule: bool


@dataclass(frozen=True)
class RouteTarget:
    canary_weight: int
    header: bool

    @property
    def stable_weight(self) -> int:
        return 100 - self.canary_weight


@dataclass(frozen=True)
class RouteInputs:
    """What :func:`desired_route` decides on (all from the planner's decision and observation)."""

    rollout_revision: str | None
    """The canary revision in flight (status.rollout.revision), None when no canary runs."""
    step_weight: int
    step_index: int
    step_ready: bool
    """The canary's pods of the current step are ready (status.rollout.stepStartedAt is set)."""
    canary_ready_revision: str | None
    """Revision of the canary Deployment when at least one of its pods is ready, else None."""
    promoting: bool
    """A promotion is finishing: the stable is not yet ready at the new revision."""
    observed: RouteObserved | None
    previous_step_weight: int = 0
    canary_revision: str | None = None
    """Revision of the canary Deployment's pod template, ready or not (None: no Deployment)."""
    stable_capacity: int = 100
    """The share (percent) the stable's ready pods can take (:func:`stable_capacity`); under 100
    only with ``dynamicStableScale``, where the weight leaves the canary no faster than this."""


def desired_route(inputs: RouteInputs) -> RouteTarget:
    """The weights to write now (see the module doc for the order of operations)."""
    target = _desired_route(inputs)
    current = inputs.observed.canary_weight if inputs.observed is not None else 0
    floor = min(current, 100 - inputs.stable_capacity)
    if target.canary_weight < floor:
        # dynamicStableScale: the stable scaled down for this weight is still coming back up.
        return RouteTarget(canary_weight=floor, header=target.header)
    return target


def _desired_route(inputs: RouteInputs) -> RouteTarget:
    current = inputs.observed.canary_weight if inputs.observed is not None else 0
    if inputs.rollout_revision is None:
        if inputs.promoting:
            # The canary runs the promoted revision; the stable is still rolling to it. The
            # header traffic stays on the canary too: without the rule it would follow the
            # weights, and part of it would reach the stable's old revision.
            return RouteTarget(canary_weight=current, header=True)
        return RouteTarget(canary_weight=0, header=False)
    if inputs.step_ready:
        return RouteTarget(canary_weight=inputs.step_weight, header=True)
    routed = inputs.observed is not None and (inputs.observed.canary_weight > 0 or inputs.observed.header_rule)
    if inputs.canary_ready_revision == inputs.rollout_revision or (
        routed and inputs.canary_revision == inputs.rollout_revision
    ):
        # A later step waiting for its extra pods: keep what the ready pods already take. Also
        # while the scaled Deployment's status is of its previous generation (no ready count to
        # trust for a moment): the route already sends this revision traffic, and a weight kept
        # is no weight moved onto pods not known ready.
        return RouteTarget(canary_weight=min(current, inputs.previous_step_weight), header=True)
    # A new (or superseding) canary whose pods are not ready: nothing goes to it yet.
    return RouteTarget(canary_weight=0, header=False)


# --------------------------------------------------------------------------- the route itself


def _backend_name(ref: dict[str, Any]) -> str | None:
    if ref.get("group", "") not in ("", "core") or ref.get("kind", "Service") != "Service":
        return None
    name = ref.get("name")
    return str(name) if name is not None else None


def _is_header_rule(rule: dict[str, Any], canary: str) -> bool:
    refs = rule.get("backendRefs") or []
    return bool(refs) and all(_backend_name(r) == canary for r in refs) and bool(rule.get("matches"))


def target_rule_index(route: Manifest, routing: TrafficRouting, policy: str) -> int:
    rules = (route.get("spec") or {}).get("rules") or []
    if not rules:
        raise RouteError(f"HTTPRoute {routing.gateway_api.http_route} has no rules to weigh")
    wanted = routing.gateway_api.rule
    canary = track_service_name(policy, "canary")
    for i, rule in enumerate(rules):
        if wanted is not None and rule.get("name") == wanted:
            return i
        if wanted is None and not _is_header_rule(rule, canary):
            return i
    raise RouteError(
        f"HTTPRoute {routing.gateway_api.http_route} has no rule named {wanted!r}: "
        "name one of its rules in spec.rollout.trafficRouting.gatewayAPI.rule"
    )


def observe_route(route: Manifest | None, routing: TrafficRouting, policy: str) -> RouteObserved | None:
    if route is None:
        return None
    try:
        index = target_rule_index(route, routing, policy)
    except RouteError:
        return None
    rules = route["spec"]["rules"]
    stable, canary = track_service_name(policy, "stable"), track_service_name(policy, "canary")
    weights = {"stable": 0, "canary": 0}
    for ref in rules[index].get("backendRefs") or []:
        name = _backend_name(ref)
        weight = int(ref.get("weight", 1))
        if name == stable:
            weights["stable"] += weight
        elif name == canary:
            weights["canary"] += weight
    total = weights["stable"] + weights["canary"]
    percent = 0 if total == 0 else round(100 * weights["canary"] / total)
    header = any(_is_header_rule(r, canary) for r in rules)
    return RouteObserved(stable_weight=100 - percent, canary_weight=percent, header_rule=header)


def backend_refs(policy: str, target: RouteTarget, ports: Mapping[str, int]) -> list[dict[str, Any]]:
    # group and kind as the apiserver defaults them, so an unchanged route compares equal
    return [
        {
            "group": "",
            "kind": "Service",
            "name": track_service_name(policy, "stable"),
            "port": ports["stable"],
            "weight": target.stable_weight,
        },
        {
            "group": "",
            "kind": "Service",
            "name": track_service_name(policy, "canary"),
            "port": ports["canary"],
            "weight": target.canary_weight,
        },
    ]


def _header_matches(rule: dict[str, Any], routing: TrafficRouting) -> list[dict[str, Any]]:
    assert routing.header is not None
    header = {"type": "Exact", "name": routing.header.name, "value": routing.header.value}
    matches = copy.deepcopy(rule.get("matches") or [{"path": {"type": "PathPrefix", "value": "/"}}])
    for match in matches:
        match["headers"] = [h for h in match.get("headers") or [] if h.get("name") != header["name"]] + [header]
    return matches


def route_rules(
    route: Manifest, routing: TrafficRouting, policy: str, target: RouteTarget, ports: Mapping[str, int]
) -> list[dict[str, Any]]:
    """The route's rules with the target rule weighted and our header rule present or not."""
    rules: list[dict[str, Any]] = copy.deepcopy((route.get("spec") or {}).get("rules") or [])
    index = target_rule_index(route, routing, policy)
    rules[index]["backendRefs"] = backend_refs(policy, target, ports)
    canary = track_service_name(policy, "canary")
    target_rule = rules[index]
    others = [r for i, r in enumerate(rules) if i == index or not _is_header_rule(r, canary)]
    if target.header and routing.header is not None:
        header_rule: dict[str, Any] = {
            "matches": _header_matches(target_rule, routing),
            "backendRefs": [{"group": "", "kind": "Service", "name": canary, "port": ports["canary"], "weight": 1}],
        }
        if "filters" in target_rule:
            header_rule["filters"] = copy.deepcopy(target_rule["filters"])
        position = others.index(target_rule)
        others.insert(position, header_rule)
    return others


def route_apply_body(route: Manifest, rules: list[dict[str, Any]]) -> Manifest:
    """The server-side apply body: only ``spec.rules``, guarded by the route's resourceVersion."""
    meta = route["metadata"]
    return {
        "apiVersion": route.get("apiVersion", GATEWAY_API_VERSION),
        "kind": HTTPROUTE_KIND,
        "metadata": {"name": meta["name"], "namespace": meta["namespace"], "resourceVersion": meta["resourceVersion"]},
        "spec": {"rules": rules},
    }


def routing_of(spec: PolicySpec) -> TrafficRouting | None:
    return spec.rollout.traffic_routing
