"""The order of operations under spec.rollout.trafficRouting (pure: planner + traffic).

A small world applies each decision: the route takes the decision's weights at once, a
Deployment's new pods become ready one tick after it was asked for them (so every ordering
question is visible). Invariants checked at every decision of whole rollouts:

* no weight moves to a canary whose pods (of that revision) are not ready;
* a canary Deployment is scaled away only while the route is already seen at weight 0;
* 100% goes back to the stable after a promotion only once every stable pod runs the new
  revision and is ready.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import pytest

import bp_plan
from batchpilot_operator.analysis import AnalysisResult, Measurement, format_share
from batchpilot_operator.fairness import (
    comparable_step_after,
    downgrade,
    fed_alike,
    fed_weight,
    judge_load,
    per_pod_rate_query,
    planned_load_ratio,
    underfed,
    unlike_load,
)
from batchpilot_operator.rollout import (
    ROUTE_DRAIN_SECONDS,
    Decision,
    Observed,
    PlanInputs,
    TrackObserved,
    analysis_due,
    plan,
)
from batchpilot_operator.spec import PolicySpec, TrafficRouting
from batchpilot_operator.status import Phase, Status
from batchpilot_operator.traffic import (
    RouteError,
    RouteObserved,
    RouteTarget,
    observe_route,
    route_apply_body,
    route_rules,
    split_for_routing,
)
from bp_plan import T0, at

PORTS = {"stable": 80, "canary": 80}


def measured(
    s: PolicySpec, status: Status, now: datetime, *, p99: float = 0.05, samples: float = 500
) -> AnalysisResult:
    """An analysis judged by the real verdict code: the stable at 50 ms, the canary at ``p99``
    (half its requests over the objective when that breaches), queue age 5 ms on both."""
    return bp_plan.measured(s, status, now, p99=p99, queue_age=0.005, samples=samples)


def spec(lane_window: str = "5ms", **routing: Any) -> PolicySpec:
    return PolicySpec.model_validate(
        {
            "model": {"name": "m", "image": "img:1", "source": "builtin:mlp"},
            "replicas": 2,
            "lanes": [
                {
                    "name": "interactive",
                    "maxBatchSize": 8,
                    "maxQueueDelay": lane_window,
                    "maxQueueLength": 100,
                    "requestTimeout": "1s",
                }
            ],
            "slo": {"p99Latency": "200ms", "maxQueueAge": "50ms"},
            "rollout": {
                "steps": [
                    {"weight": 10, "pause": "60s"},
                    {"weight": 25, "pause": "60s"},
                    {"weight": 50, "pause": "60s"},
                ],
                "analysisInterval": "30s",
                "failureLimit": 2,
                "minSamples": 50,
                "trafficRouting": {"gatewayAPI": {"httpRoute": "chat"}, **routing},
            },
        }
    )


@dataclass
class Track:
    revision: str | None = None
    replicas: int = 0
    ready: int = 0
    lagging: bool = False
    """Its Deployment was scaled and its controller has not observed that generation yet: the
    operator reads no ready pods (``observedGeneration`` behind) for one tick."""


class World:
    """Deployments whose pods get ready one tick after they are asked for (a scaled one reads
    as not ready for that tick: its status is of the previous generation); a route that takes
    the decision's weights at once (as the operator writes it before any scale-down)."""

    def __init__(self, s: PolicySpec, rate: float | None = None) -> None:
        self.spec = s
        self.rate = rate
        """Requests/s the route splits by its weights (None: no per-pod load check)."""
        self.events: list[tuple[str, str, str]] = []
        self.status = Status()
        self.stable = Track()
        self.canary = Track()
        self.route: RouteObserved | None = RouteObserved(100, 0, False)
        self.t = 0.0
        self.decisions: list[tuple[Observed, Decision]] = []
        self.route_idle_since: float | None = None
        """When the route was first read sending the canary nothing (weight 0, no header rule)."""

    def observed(self) -> Observed:
        def obs(t: Track) -> TrackObserved | None:
            return (
                None
                if t.revision is None
                else TrackObserved(t.revision, t.replicas, 0 if t.lagging else t.ready, settled=not t.lagging)
            )

        return Observed(stable=obs(self.stable), canary=obs(self.canary), route=self.route)

    def tick(self, dt: float = 5.0, **analysis: Any) -> Decision:
        self.t += dt
        now = at(self.t)
        result: AnalysisResult | None = None
        if analysis_due(self.spec, self.status, now):
            result = measured(self.spec, self.status, now, **analysis)
            routing = self.spec.rollout.traffic_routing
            if self.rate is not None and routing is not None and self.status.rollout is not None:
                result = judge_load(
                    SplitLoad(self),
                    result,
                    routing,
                    policy="chat",
                    namespace="ml",
                    spec=self.spec,
                    step_index=self.status.rollout.step_index,
                    now=now,
                    emit=lambda *e: self.events.append(e),
                )
        observed = self.observed()
        d = plan(
            PlanInputs(spec=self.spec, generation=1, status=self.status, observed=observed, now=now, analysis=result)
        )
        self.decisions.append((observed, d))
        check_invariants(observed, d, self.spec)
        if observed.route is not None and (observed.route.canary_weight > 0 or observed.route.header_rule):
            self.route_idle_since = None
        elif self.route_idle_since is None:
            self.route_idle_since = self.t
        oc = observed.canary
        if oc is not None and oc.replicas > 0 and d.canary_replicas == 0:
            idle = self.t - self.route_idle_since
            assert idle >= ROUTE_DRAIN_SECONDS, f"canary scaled away {idle}s after the route left it"
        self.status = d.status
        # pods asked for last tick are ready now; this decision's changes land
        for track, rev, n in (
            (self.stable, d.stable_revision, d.stable_replicas),
            (self.canary, d.canary_revision, d.canary_replicas),
        ):
            if rev is None or n == 0:
                track.revision, track.replicas, track.ready = None, 0, 0
                continue
            if track.revision != rev:
                track.revision, track.replicas, track.ready = rev, n, 0
            else:
                track.ready = track.replicas
                track.lagging = n != track.replicas
                track.replicas = n
                track.ready = min(track.ready, n)
        assert d.route is not None
        self.route = RouteObserved(d.route.stable_weight, d.route.canary_weight, d.route.header)
        return d

    def run_until(self, predicate: Any, limit: int = 200, **analysis: Any) -> Decision:
        for _ in range(limit):
            d = self.tick(**analysis)
            if predicate(d):
                return d
        raise AssertionError(f"not reached; status {self.status.phase} {self.status.message}")


class SplitLoad:
    """The per-pod rate queries of the fairness check, answered from the world's route: its
    weights split ``world.rate`` over the ready pods of each track."""

    def __init__(self, world: World) -> None:
        self.world = world

    def measure(self, queries: Sequence[str], at: float | None = None) -> dict[str, Measurement]:
        w, route = self.world, self.world.route
        assert w.rate is not None and route is not None
        out = {}
        for q in queries:
            track, weight = (
                (w.canary, route.canary_weight) if 'track="canary"' in q else (w.stable, route.stable_weight)
            )
            rate = w.rate * weight / 100 / track.ready if track.ready else None
            out[q] = Measurement(q, value=rate)
        return out


def check_invariants(observed: Observed, d: Decision, s: PolicySpec) -> None:
    assert d.route is not None
    oc = observed.canary
    if d.route.canary_weight > (observed.route.canary_weight if observed.route else 0):
        # weight moves toward the canary only onto ready canary pods
        assert oc is not None and oc.ready_replicas >= 1, (observed, d.route)
        assert d.status.rollout is not None and oc.revision == d.status.rollout.revision
    if oc is not None and oc.replicas > 0 and d.canary_replicas == 0:
        assert observed.route is not None and observed.route.canary_weight == 0, (
            "canary scaled away under weight",
            observed,
        )
    os = observed.stable
    routing = s.rollout.traffic_routing
    if routing is not None and routing.dynamic_stable_scale and observed.route is not None:
        seen, new = observed.route.canary_weight, d.route.canary_weight
        # dynamicStableScale: the stable keeps the pods for its share of the route, as read and
        # as written (no pod carries more than a promoted pod's share while the data plane follows) ...
        assert d.stable_replicas * 100 >= s.replicas * (100 - min(seen, new)), ("stable scaled ahead", observed, d)
        if new < seen and os is not None and os.revision == d.stable_revision:
            # ... and weight leaves the canary only onto ready stable pods
            assert os.ready_replicas * 100 >= s.replicas * (100 - new), ("weight back before the stable", observed, d)
    promoted = d.status.rollout is None and d.status.history and d.status.history[-1].outcome == "Promoted"
    if promoted and d.route.canary_weight == 0 and observed.route is not None and observed.route.canary_weight > 0:
        assert os is not None and os.revision == d.stable_revision and os.ready_replicas >= s.replicas


def test_split_for_routing() -> None:
    # a canary pod's share w/c as close as whole pods allow to a stable pod's (100-w)/N
    assert split_for_routing(2, 10) == (2, 1)
    assert split_for_routing(2, 25) == (2, 1)
    assert split_for_routing(2, 50) == (2, 2)
    assert split_for_routing(4, 25) == (4, 1)
    assert split_for_routing(4, 40) == (4, 3)
    assert split_for_routing(10, 25) == (10, 3)
    assert split_for_routing(10, 75) == (10, 10)
    assert split_for_routing(3, 100) == (3, 3)
    assert split_for_routing(1, 1) == (1, 1)
    assert split_for_routing(5, 0) == (5, 0)
    with pytest.raises(ValueError):
        split_for_routing(0, 10)


def test_dynamic_stable_scale_gives_every_pod_a_promoted_pods_load() -> None:
    # ceil(N (100 - w) / 100) stable pods and the canary's beside them at a stable pod's rate
    assert split_for_routing(2, 10, dynamic_stable=True) == (2, 1)
    assert split_for_routing(2, 25, dynamic_stable=True) == (2, 1)
    assert split_for_routing(2, 50, dynamic_stable=True) == (1, 1)  # without it 2 + 2 at 25% each
    assert split_for_routing(4, 50, dynamic_stable=True) == (2, 2)
    assert split_for_routing(4, 25, dynamic_stable=True) == (3, 1)
    assert split_for_routing(10, 25, dynamic_stable=True) == (8, 3)
    assert split_for_routing(3, 90, dynamic_stable=True) == (1, 3)
    assert split_for_routing(5, 0, dynamic_stable=True) == (5, 0)
    for replicas in (1, 2, 3, 4, 10):
        for weight in range(1, 100):
            stable, canary = split_for_routing(replicas, weight, dynamic_stable=True)
            assert 1 <= stable <= replicas and 1 <= canary <= replicas
            assert stable * 100 >= replicas * (100 - weight), "no stable pod over a promoted pod's share"
    assert planned_load_ratio(2, 50, dynamic_stable=True) == 1.0


def dynamic_spec(lane_window: str = "5ms") -> PolicySpec:
    return spec(lane_window=lane_window, dynamicStableScale=True)


def test_dynamic_stable_scale_scales_the_stable_only_behind_the_route() -> None:
    # 2 replicas, 10 / 25 / 50: the 50% step runs 1 stable + 1 canary pod, each at 50% of the
    # traffic as a promoted pod would be; the stable gives up its pod only once the route is
    # seen at 50% (check_invariants asserts it at every decision), and the promotion brings it
    # back to 2 pods of the new revision before the weight leaves the canary.
    w = healthy_world(dynamic_spec())
    w.spec = dynamic_spec(lane_window="6ms")
    pods: list[tuple[int, int, int]] = []
    for _ in range(400):
        d = w.tick()
        assert d.route is not None
        if not pods or pods[-1] != (d.route.canary_weight, d.stable_replicas, d.canary_replicas):
            pods.append((d.route.canary_weight, d.stable_replicas, d.canary_replicas))
        if d.status.phase is Phase.HEALTHY and w.canary.revision is None:
            break
    assert (50, 1, 1) in pods, pods
    at_50 = pods.index((50, 1, 1))
    assert pods[at_50 - 1][:2] == (50, 2), "the route moves first, then the stable follows"
    assert pods[-1] == (0, 2, 0) and d.status.history[-1].outcome == "Promoted"
    # a stable scaled for its share is not a stable short of pods, even while its Deployment's
    # status lags the scale (the world's `lagging` tick)
    degraded = [c for _, dec in w.decisions if (c := dec.status.condition("Degraded")) and c.status == "True"]
    assert not degraded, degraded[0]


def test_dynamic_stable_scale_keeps_weight_on_the_canary_until_the_stable_is_back() -> None:
    w = healthy_world(dynamic_spec())
    w.spec = dynamic_spec(lane_window="6ms")
    w.run_until(lambda d: d.route is not None and d.route.canary_weight == 50 and d.stable_replicas == 1)
    w.tick()  # the stable's second pod is gone
    assert w.stable.replicas == 1
    rolled = w.run_until(lambda d: d.status.phase is Phase.ROLLED_BACK, p99=1.0)
    # the rollback asks for the stable's pods back at once, and the canary keeps its weight:
    # one stable pod cannot take 100% at a promoted pod's load
    assert rolled.stable_replicas == 2 and rolled.route is not None and rolled.route.canary_weight == 50
    back = w.run_until(lambda d: d.route is not None and d.route.canary_weight == 0)
    assert w.stable.ready == 2 and back.status.phase is Phase.ROLLED_BACK
    gone = w.run_until(lambda d: d.canary_replicas == 0, limit=int(ROUTE_DRAIN_SECONDS / 5) + 2)
    assert gone.stable_replicas == 2


def test_dynamic_stable_scale_superseded_at_50_percent_brings_the_stable_back_first() -> None:
    # A newer revision replaces the canary while the stable runs 1 of 2 pods: the weight stays
    # on the old canary's pods until the stable's are back (check_invariants at every decision),
    # then the new canary starts from its first step and is promoted.
    w = healthy_world(dynamic_spec())
    w.spec = dynamic_spec(lane_window="6ms")
    w.run_until(lambda d: d.route is not None and d.route.canary_weight == 50 and d.stable_replicas == 1)
    w.tick()
    w.spec = dynamic_spec(lane_window="7ms")
    newest = w.spec.revision()
    superseded = w.tick()
    assert superseded.stable_replicas == 2 and superseded.route is not None and superseded.route.canary_weight == 50
    d = w.run_until(lambda d: d.status.stable_revision == newest and w.canary.revision is None, limit=400)
    assert d.status.history[-1].outcome == "Promoted" and d.stable_replicas == 2


def healthy_world(s: PolicySpec) -> World:
    w = World(s)
    w.run_until(lambda d: d.status.phase is Phase.HEALTHY)
    return w


def test_weights_follow_steps_exactly_and_promotion_waits_for_the_stable() -> None:
    s = spec()
    w = healthy_world(s)
    w.spec = spec(lane_window="6ms")
    first = w.tick()
    assert first.canary_replicas == 1 and first.route is not None and first.route.canary_weight == 0
    seen: list[int] = []
    d = first
    for _ in range(400):
        d = w.tick()
        assert d.route is not None
        if not seen or seen[-1] != d.route.canary_weight:
            seen.append(d.route.canary_weight)
        if d.status.phase is Phase.HEALTHY and w.canary.revision is None:
            break
    assert seen == [0, 10, 25, 50, 0], seen
    # the status shows the route's weight, not the pod ratio
    assert d.status.canary_weight == 0 and d.stable_replicas == 2


def test_status_weight_is_the_route_weight() -> None:
    w = healthy_world(spec())
    w.spec = spec(lane_window="6ms")
    d = w.run_until(lambda d: d.route is not None and d.route.canary_weight == 10)
    assert d.status.canary_weight == 10 and d.status.step_weight == 10
    assert d.stable_replicas == 2 and d.canary_replicas == 1  # the stable keeps every pod


def test_rollback_sets_weight_zero_before_the_canary_goes() -> None:
    w = healthy_world(spec())
    w.spec = spec(lane_window="6ms")
    w.run_until(lambda d: d.route is not None and d.route.canary_weight == 10)
    rolled = w.run_until(lambda d: d.status.phase is Phase.ROLLED_BACK, p99=1.0)
    assert rolled.route == RouteTarget(canary_weight=0, header=False)
    assert rolled.canary_replicas == 1, "the canary keeps its pods in the decision that zeroes its weight"
    assert rolled.requeue_after is not None
    after = w.tick()
    assert after.canary_replicas == 1, "kept while the data plane follows the route (ROUTE_DRAIN_SECONDS)"
    gone = w.run_until(lambda d: d.canary_replicas == 0, limit=int(ROUTE_DRAIN_SECONDS / 5) + 2)
    assert gone.canary_revision is None and gone.status.canary_drained_at is None


def test_promotion_keeps_canary_weight_until_new_stable_ready() -> None:
    w = healthy_world(spec())
    w.spec = spec(lane_window="6ms")
    promoted = w.run_until(lambda d: any(e.reason == "Promoted" for e in d.events))
    assert promoted.route is not None and promoted.route.canary_weight == 50, "no weight moves at the promotion"
    assert promoted.canary_replicas == 2  # 50% of 2 replicas: 2 canary pods
    nxt = w.tick()  # stable asked for the new revision last tick: not ready yet in the world
    assert nxt.route is not None
    # the invariant checker asserted the stable was ready when the weight went back
    assert w.canary.revision is not None or nxt.route.canary_weight == 0


def test_new_canary_gets_no_weight_before_ready_and_header_rule_follows() -> None:
    s = spec(header={"name": "x-tenant", "value": "acme"})
    w = healthy_world(s)
    w.spec = spec(lane_window="6ms", header={"name": "x-tenant", "value": "acme"})
    before: list[RouteTarget | None] = []
    while True:
        d = w.tick()
        if w.canary.ready == 0 or not before:
            before.append(d.route)
        if d.route is not None and d.route.canary_weight:
            break
    assert set(before) == {RouteTarget(canary_weight=0, header=False)}, "nothing to a canary with no ready pod"
    assert d.route == RouteTarget(canary_weight=10, header=True)
    rolled = w.run_until(lambda d: d.status.phase is Phase.ROLLED_BACK, p99=1.0)
    assert rolled.route == RouteTarget(canary_weight=0, header=False)


def test_header_traffic_reaches_only_the_new_revision_until_the_stable_runs_it() -> None:
    """From the decision that adds the header rule until the rollout is done, a header-matched
    request reaches the new revision: the rule stays through every step and the promotion, and
    goes only in the write that moves 100% to a stable whose every pod runs the new revision."""
    header = {"name": "x-tenant", "value": "acme"}
    w = healthy_world(spec(header=header))
    old = w.stable.revision
    w.spec = spec(lane_window="6ms", header=header)
    d = w.run_until(lambda d: d.route is not None and d.route.header)
    new = d.status.rollout.revision if d.status.rollout is not None else None
    assert new is not None and new != old
    promoted = False
    for _ in range(400):
        observed_stable = (w.stable.revision, w.stable.ready)
        d = w.tick()
        assert d.route is not None
        promoted = promoted or any(e.reason == "Promoted" for e in d.events)
        if not d.route.header:
            assert promoted, "the header rule dropped while the canary was still in its steps"
            assert observed_stable == (new, 2), f"header traffic sent to a stable not yet running {new}"
            assert d.route.canary_weight == 0
            break
    else:
        raise AssertionError("the header rule never went")
    w.run_until(lambda d: d.canary_replicas == 0, limit=int(ROUTE_DRAIN_SECONDS / 5) + 2)


def test_header_only_traffic_also_drains_before_the_canary_goes() -> None:
    """A canary that takes only header traffic (weight 0, our header rule on the route) is
    scaled away only once the route is seen without the rule."""
    w = healthy_world(spec(header={"name": "x-tenant", "value": "acme"}))
    w.spec = spec(lane_window="6ms", header={"name": "x-tenant", "value": "acme"})
    w.run_until(lambda d: d.route is not None and d.route.canary_weight == 10)
    rolled = w.run_until(lambda d: d.status.phase is Phase.ROLLED_BACK, p99=1.0)
    assert rolled.canary_replicas == 1 and rolled.route == RouteTarget(0, False)
    w.route = RouteObserved(100, 0, True)  # the weight is 0 on the route, the header rule not yet gone
    assert w.tick().canary_replicas == 1, "header traffic still reaches the canary: keep it"
    assert w.route == RouteObserved(100, 0, False)
    w.run_until(lambda d: d.canary_replicas == 0, limit=int(ROUTE_DRAIN_SECONDS / 5) + 2)


# --------------------------------------------------------------------------- the route object

ROUTE: dict[str, Any] = {
    "apiVersion": "gateway.networking.k8s.io/v1",
    "kind": "HTTPRoute",
    "metadata": {"name": "chat", "namespace": "ml", "resourceVersion": "42"},
    "spec": {
        "parentRefs": [{"name": "gw"}],
        "rules": [
            {
                "name": "admin",
                "matches": [{"path": {"type": "PathPrefix", "value": "/admin"}}],
                "backendRefs": [{"name": "admin", "port": 80}],
            },
            {
                "name": "infer",
                "matches": [{"path": {"type": "PathPrefix", "value": "/v2"}}],
                "timeouts": {"request": "10s"},
                "backendRefs": [{"name": "chat-stable", "port": 80, "weight": 100}],
            },
        ],
    },
}


def routing(**kw: Any) -> TrafficRouting:
    return TrafficRouting.model_validate({"gatewayAPI": {"httpRoute": "chat", "rule": "infer"}, **kw})


def test_route_rules_change_only_the_target_backends() -> None:
    rules = route_rules(ROUTE, routing(), "chat", RouteTarget(25, False), PORTS)
    assert rules[0] == ROUTE["spec"]["rules"][0]
    assert rules[1]["timeouts"] == {"request": "10s"} and rules[1]["matches"] == ROUTE["spec"]["rules"][1]["matches"]
    assert rules[1]["backendRefs"] == [
        {"group": "", "kind": "Service", "name": "chat-stable", "port": 80, "weight": 75},
        {"group": "", "kind": "Service", "name": "chat-canary", "port": 80, "weight": 25},
    ]
    body = route_apply_body(ROUTE, rules)
    assert body["metadata"]["resourceVersion"] == "42" and set(body["spec"]) == {"rules"}


def test_header_rule_added_before_target_and_removed() -> None:
    r = routing(header={"name": "x-tenant", "value": "acme"})
    rules = route_rules(ROUTE, r, "chat", RouteTarget(10, True), PORTS)
    assert [x.get("name") for x in rules] == ["admin", None, "infer"]
    header = rules[1]
    assert header["backendRefs"] == [{"group": "", "kind": "Service", "name": "chat-canary", "port": 80, "weight": 1}]
    assert header["matches"] == [
        {
            "path": {"type": "PathPrefix", "value": "/v2"},
            "headers": [{"type": "Exact", "name": "x-tenant", "value": "acme"}],
        }
    ]
    live = copy.deepcopy(ROUTE)
    live["spec"]["rules"] = rules
    assert observe_route(live, r, "chat") == RouteObserved(90, 10, True)
    again = route_rules(live, r, "chat", RouteTarget(10, True), PORTS)
    assert again == rules, "idempotent: one header rule, not two"
    gone = route_rules(live, r, "chat", RouteTarget(0, False), PORTS)
    assert [x.get("name") for x in gone] == ["admin", "infer"]


def test_first_rule_by_default_and_missing_rule_is_an_error() -> None:
    r = TrafficRouting.model_validate({"gatewayAPI": {"httpRoute": "chat"}})
    rules = route_rules(ROUTE, r, "chat", RouteTarget(10, False), PORTS)
    assert rules[0]["backendRefs"][1] == {
        "group": "",
        "kind": "Service",
        "name": "chat-canary",
        "port": 80,
        "weight": 10,
    }
    with pytest.raises(RouteError, match="no rule named 'nope'"):
        route_rules(
            ROUTE,
            routing().model_copy(update={"gateway_api": routing().gateway_api.model_copy(update={"rule": "nope"})}),
            "chat",
            RouteTarget(10, False),
            PORTS,
        )


def test_spec_rejects_bad_routing() -> None:
    with pytest.raises(ValueError, match="httpRoute"):
        spec(gatewayAPI={"httpRoute": "Bad_Name"})
    with pytest.raises(ValueError, match="name"):
        spec(header={"name": "bad header", "value": "x"})
    with pytest.raises(ValueError, match="minCanaryLoadRatio"):
        spec(minCanaryLoadRatio=2)


# --------------------------------------------------------------------------- fairness


def test_underfed_canary_cannot_pass_but_failed_stands() -> None:
    assert underfed(1.0, 9.0, 0.5) and not underfed(5.0, 9.0, 0.5) and not underfed(1.0, 9.0, 0.0)
    assert not underfed(None, None, 0.5)
    s = spec()
    w = healthy_world(s)
    w.spec = spec(lane_window="6ms")
    w.run_until(lambda d: d.route is not None and d.route.canary_weight == 10)
    now = at(w.t + 60)
    status = w.status
    good = measured(w.spec, status, now)
    assert all(lane.passes_step for lane in good.lanes)
    fair = downgrade(good)
    assert not any(lane.passes_step for lane in fair.lanes) and not any(lane.holds_step for lane in fair.lanes)
    assert fair.outcome.value == "Inconclusive"
    bad = measured(w.spec, status, now, p99=1.0)
    assert downgrade(bad).outcome.value == "Failed"
    q = per_pod_rate_query(namespace="ml", policy="chat", track="canary", revision="abc", window=30)
    assert 'track="canary"' in q and "by (pod)" in q and "[30s]" in q


def test_planned_load_ratio_and_the_weight_that_feeds() -> None:
    # a canary pod's share over a stable pod's, with split_for_routing's pods
    for replicas in (1, 2, 3, 4, 10):
        for weight in range(1, 100):
            stable, canary = split_for_routing(replicas, weight)
            assert planned_load_ratio(replicas, weight) == pytest.approx((weight / canary) / ((100 - weight) / stable))
        for min_ratio in (0.25, 0.5, 0.8, 1.0):
            w = fed_weight(replicas, min_ratio)
            assert w == 100 or planned_load_ratio(replicas, w) >= min_ratio
            assert all(planned_load_ratio(replicas, v) < min_ratio for v in range(1, w))
    assert planned_load_ratio(2, 10) == pytest.approx(10 / 45)  # the shipped gateway example's first step
    s = spec()  # 2 replicas, 10 / 25 / 50
    assert [comparable_step_after(s, i, 0.5) for i in range(3)] == [1, 2, None]
    assert comparable_step_after(s, 0, 0.7) == 2


def test_an_underfed_first_step_is_a_smoke_test_and_a_later_fed_step_gates() -> None:
    # The shipped gateway example's shape: 2 replicas, 10 / 25 / 50, minCanaryLoadRatio 0.5 by
    # default. At 10% a canary pod gets 10 / 45 of a stable pod's rate: underfed, but the 25%
    # and 50% steps feed it, so the 10% step passes on the canary's own verdict (Event), and
    # the rollout is promoted without a stall.
    s = spec()
    w = World(s, rate=100.0)
    w.run_until(lambda d: d.status.phase is Phase.HEALTHY)
    first = w.status.stable_revision
    w.spec = spec(lane_window="6ms")
    d = w.run_until(lambda d: d.status.stable_revision not in (None, first) and d.status.rollout is None, limit=400)
    assert d.status.history[-1].outcome == "Promoted"
    assert not any(c.type == "Stalled" and c.status == "True" for c in d.status.conditions)
    smoke = [e for e in w.events if e[1] == "CanaryUnderfed"]
    assert smoke and all("step 1 (10%)" in e[2] and "smoke test" in e[2] and "step 2 (25%)" in e[2] for e in smoke)


def test_the_tally_does_not_carry_across_unlike_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    # 2 replicas, 10 / 25 / 50 on a route: a canary pod gets 0.22, 0.67 and 1.0 of a stable
    # pod's rate, so each step starts a fresh tally (evidence gathered lighter would dilute the
    # like-for-like 50% step). With the replica ratio every step feeds every pod alike.
    s = spec()
    assert fed_alike(s, 50, 50) and not fed_alike(s, 25, 50) and not fed_alike(s, 10, 25)
    four = PolicySpec.model_validate({**s.model_dump(by_alias=True, mode="json"), "replicas": 4})
    assert not fed_alike(four, 25, 50)  # 1 canary pod at 25% of 4: 1.33 of a stable pod; 4 at 50%: 1.0
    raw = s.model_dump(by_alias=True, mode="json")
    raw["rollout"]["trafficRouting"] = None
    assert all(fed_alike(PolicySpec.model_validate(raw), a, b) for a in (10, 25, 50) for b in (10, 25, 50))

    plain_measured = measured

    def with_tally(*args: Any, **kwargs: Any) -> AnalysisResult:
        result = plain_measured(*args, **kwargs)
        return dataclasses.replace(result, tally={"interactive/p99Latency/canary": [[0.0, 100.0]]})

    monkeypatch.setitem(globals(), "measured", with_tally)
    w = World(s, rate=100.0)
    w.run_until(lambda d: d.status.phase is Phase.HEALTHY)
    w.spec = s.model_copy(update={"model": s.model.model_copy(update={"image": "img:2"})})
    entered: list[int] = []
    d = w.tick()
    while d.status.rollout is not None or not entered:
        r = d.status.rollout
        if r is not None and (not entered or entered[-1] != r.step_index):
            entered.append(r.step_index)
            assert r.step_index == 0 or r.evidence == {}, (r.step_index, r.evidence)
        elif r is not None and r.last_analysis_at is not None and r.last_analysis_at > r.step_entered_at:
            assert r.evidence  # within a step the tally goes on
        d = w.tick()
    assert entered == [0, 1, 2] and d.status.history[-1].outcome == "Promoted"


def test_the_stables_p99_is_compared_only_at_steps_that_feed_the_canary_alike() -> None:
    # maxP99Increase compares the canary's p99 with the stable's, and a batching server's p99
    # moves with its load: on a route, only the steps whose canary pods are fed within 1.25x of
    # a stable pod's load compare (the 50% step with 2 or 4 replicas); the others say which one
    # will. Without maxP99Increase, or without a route, there is nothing to say.
    raw = spec().model_dump(by_alias=True, mode="json")
    raw["rollout"]["maxP99Increase"] = 0.25
    for replicas in (2, 4):
        s = PolicySpec.model_validate({**raw, "replicas": replicas})
        assert [s.rollout.steps[i].weight for i in range(3) if unlike_load(s, i) is None] == [50]
        for i in (0, 1):
            why = unlike_load(s, i)
            assert why is not None and f"step {i + 1}" in why and "step 3 (50%) compares like with like" in why
    only_ten = {**raw, "rollout": {**raw["rollout"], "steps": [{"weight": 10, "pause": "60s"}]}}
    why = unlike_load(PolicySpec.model_validate(only_ten), 0)
    assert why is not None and "judged at none" in why
    assert unlike_load(spec(), 0) is None  # no relative objective
    plain = {**raw, "rollout": {**raw["rollout"], "trafficRouting": None}}
    assert all(unlike_load(PolicySpec.model_validate(plain), i) is None for i in range(3))


def test_underfed_with_no_fed_step_after_stalls_saying_what_to_change() -> None:
    # Only a 10% step: nothing later can make the comparison, so its analyses cannot pass the
    # step and the rollout stalls as CanaryUnderfed with the weight that would feed the canary
    # (20% with 2 replicas at ratio 0.5): a reason and a remedy, never a silent wait.
    def only_ten(window: str = "5ms") -> PolicySpec:
        base = spec(lane_window=window).model_dump(by_alias=True, mode="json")
        base["rollout"]["steps"] = [{"weight": 10, "pause": "60s"}]
        base["rollout"]["maxInconclusive"] = 3
        return PolicySpec.model_validate(base)

    w = World(only_ten(), rate=100.0)
    w.run_until(lambda d: d.status.phase is Phase.HEALTHY)
    w.spec = only_ten("6ms")
    d = w.run_until(
        lambda d: d.status.condition("Stalled") is not None and d.status.condition("Stalled").status == "True"
    )
    stalled = d.status.condition("Stalled")
    assert stalled is not None and stalled.reason == "CanaryUnderfed", stalled
    assert "weight of at least 20%" in stalled.message and "minCanaryLoadRatio 0.5" in stalled.message
    assert d.status.rollout is not None and d.status.rollout.underfed is not None
    assert d.status.rollout.step_index == 0 and d.status.rollout.revision != d.status.stable_revision
    # a canary that breaches underfed still fails: the downgrade leaves Failed alone
    assert all(e[1] == "CanaryUnderfed" and "no later step feeds it" in e[2] for e in w.events)
    bad = w.tick(p99=1.0)
    for _ in range(40):
        if bad.status.rollout is None:
            break
        bad = w.tick(p99=1.0)
    assert bad.status.history and bad.status.history[-1].outcome == "RolledBack"


def test_no_routing_keeps_replica_ratio() -> None:
    s = spec()
    plain = PolicySpec.model_validate(
        {
            **s.model_dump(by_alias=True, mode="json"),
            "rollout": {**s.model_dump(by_alias=True, mode="json")["rollout"], "trafficRouting": None},
        }
    )
    assert plain.rollout.traffic_routing is None
    d = plan(PlanInputs(spec=plain, generation=1, status=Status(), observed=Observed(), now=T0))
    assert d.route is None


def test_status_says_what_the_gate_can_see() -> None:
    # Every analysis records, per lane, the smallest p99 regression the tally would detect at
    # this window's traffic (power.py), and `kubectl batchpilot status` prints it.
    from rich.console import Console

    from batchpilot_operator.oncall import render

    s = spec()
    w = healthy_world(s)
    w.spec = spec(lane_window="6ms")
    d = w.run_until(lambda d: d.status.last_analysis is not None)
    assert d.status.last_analysis is not None
    lane = d.status.last_analysis.lanes[0]
    assert lane.detectable_p99_regression is not None and 0 < lane.detectable_p99_regression < 9
    # ... and the smallest error rate (shed, timed out, failed) against the lane's budget
    assert lane.detectable_error_rate is not None and lane.max_error_rate is not None
    assert lane.max_error_rate < lane.detectable_error_rate <= 1
    assert lane.detects == (
        f"a p99 regression of {lane.detectable_p99_regression:.0%} or more and an error rate of "
        f"{format_share(lane.detectable_error_rate)} or more (budget {format_share(lane.max_error_rate)}) "
        "at the current traffic"
    )
    obj = {"metadata": {"name": "chat", "namespace": "ml", "generation": 1}, "spec": {}, "status": d.status.to_dict()}
    console = Console(width=160, record=True)
    console.print(render.status_view(render.summary(obj)))
    assert f"lane interactive: this rollout detects {lane.detects}" in console.export_text()
