"""The HTTPRoute weight writes against the real apiserver with the Gateway API CRDs (of the
pinned Contour release), beside Argo CD syncing the same route with its own field manager.

Gateway API types ``spec.rules`` as an atomic list: a server-side apply owns all of it. The
operator applies the live rules with only its weights (and its header rule) changed, under the
``batchpilot`` field manager, conditional on the resourceVersion it read. Argo CD, told to
ignore what ``batchpilot`` manages (``managedFieldsManagers``, with ``RespectIgnoreDifferences``),
applies the live rules back as they are: the weights stay. Without that setting it would apply
Git's weights (shown last, so the advice of manifests/argocd/README.md and docs/traffic-routing.md is backed by a test).
"""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from batchpilot_localdev.gateway import httproute, install_crds
from batchpilot_operator import kube as opkube
from batchpilot_operator.controller import write_route
from batchpilot_operator.rollout import Decision
from batchpilot_operator.spec import parse_spec
from batchpilot_operator.status import Status
from batchpilot_operator.traffic import GATEWAY_API_VERSION, HTTPROUTE_KIND, RouteObserved, RouteTarget, observe_route
from bptest import REPO, Kube, policy

pytestmark = [pytest.mark.cluster]

ARGO = "argocd-controller"
ROUTING = {
    "gatewayAPI": {"httpRoute": "shop", "rule": "infer"},
    "header": {"name": "x-tenant", "value": "canary-testers"},
}


@pytest.fixture(scope="module")
def gateway_crds(kube: Kube) -> None:
    install_crds([kube.kubectl_bin, f"--kubeconfig={kube.kubeconfig}"])


def argo_sync(kube: Kube, namespace: str, manifest: dict[str, Any]) -> None:
    """What Argo CD does on a sync with ServerSideApply=true: apply its manifest, forcing conflicts."""
    kube.kubectl(
        "apply",
        "--server-side",
        "--force-conflicts",
        f"--field-manager={ARGO}",
        "-n",
        namespace,
        "-f",
        "-",
        input=json.dumps(manifest),
    )


class Operator:
    """The operator's route write (``controller.write_route``) for one decision."""

    def __init__(self, kube: Kube, namespace: str) -> None:
        manifest = policy("shop", rollout={"steps": [{"weight": 25}], "trafficRouting": ROUTING})
        kube.apply(manifest, "-n", namespace)
        self.body = kube.get("batchingpolicy", "shop", namespace)
        assert self.body is not None
        self.spec = parse_spec(self.body["spec"])
        assert self.spec.rollout.traffic_routing is not None
        self.routing = self.spec.rollout.traffic_routing
        self.k = opkube.Kube.connect(str(kube.kubeconfig))
        self.namespace = namespace

    def read(self) -> dict[str, Any]:
        route = self.k.get(GATEWAY_API_VERSION, HTTPROUTE_KIND, self.namespace, "shop")
        assert route is not None
        return route

    def write(self, target: RouteTarget, route: dict[str, Any] | None = None) -> int:
        decision = Decision(
            status=Status(),
            stable_revision="a",
            stable_replicas=2,
            canary_revision="b",
            canary_replicas=1,
            keep_revisions=(),
            route=target,
        )
        return write_route(self.k, self.k, self.body, self.routing, decision, route or self.read())  # type: ignore[arg-type]

    def observed(self) -> RouteObserved | None:
        return observe_route(self.read(), self.routing, "shop")


def owners(route: dict[str, Any], field: str) -> set[str]:
    """Managers whose managedFields name ``field`` (e.g. 'f:rules') under spec."""
    return {
        m["manager"] for m in route["metadata"]["managedFields"] if field in (m.get("fieldsV1") or {}).get("f:spec", {})
    }


def test_weights_by_ssa_beside_argocd(kube: Kube, namespace: str, gateway_crds: None) -> None:
    git = httproute("shop", namespace, "gw", "shop", {"stable": 80, "canary": 80})
    argo_sync(kube, namespace, git)
    op = Operator(kube, namespace)

    # The operator's write: the weights and the header rule, nothing else.
    assert op.write(RouteTarget(25, True)) >= 1
    route = op.read()
    assert op.observed() == RouteObserved(75, 25, True)
    assert [p["name"] for p in route["spec"]["parentRefs"]] == ["gw"]
    assert "batchpilot" in owners(route, "f:rules")
    assert ARGO in owners(route, "f:parentRefs")
    # The track Services the route names exist (the operator made them: none were there).
    for track in ("stable", "canary"):
        svc = kube.get("service", f"shop-{track}", namespace)
        assert svc is not None and svc["spec"]["selector"]["batchpilot.dev/track"] == track
    # Nothing changed, nothing written.
    assert op.write(RouteTarget(25, True)) == 0

    # Argo CD syncs a Git change (a hostname) with ignoreDifferences on what batchpilot manages
    # (RespectIgnoreDifferences: the ignored fields are applied as they are live).
    synced = copy.deepcopy(git)
    synced["spec"]["hostnames"] = ["shop.example.com"]
    synced["spec"]["rules"] = op.read()["spec"]["rules"]
    argo_sync(kube, namespace, synced)
    assert op.observed() == RouteObserved(75, 25, True), "Argo CD's sync left the weights alone"
    assert op.read()["spec"]["hostnames"] == ["shop.example.com"]

    # The next step: the operator's write leaves Argo CD's hostname alone.
    op.write(RouteTarget(50, True))
    route = op.read()
    assert op.observed() == RouteObserved(50, 50, True)
    assert route["spec"]["hostnames"] == ["shop.example.com"] and ARGO in owners(route, "f:hostnames")

    # Concurrent: Argo CD changes the rule (a timeout, from Git) after the operator read the
    # route and before it writes. The write is conditional on what it read: it fails (to be
    # retried), and the retry keeps Argo CD's timeout.
    stale = op.read()
    changed = copy.deepcopy(synced)
    changed["spec"]["rules"] = copy.deepcopy(stale["spec"]["rules"])
    infer = next(r for r in changed["spec"]["rules"] if r.get("name") == "infer")
    infer["timeouts"] = {"request": "15s"}
    argo_sync(kube, namespace, changed)
    with pytest.raises(opkube.TransientKubeError):
        op.write(RouteTarget(10, True), route=stale)
    op.write(RouteTarget(10, True))
    route = op.read()
    assert op.observed() == RouteObserved(90, 10, True)
    assert next(r for r in route["spec"]["rules"] if r.get("name") == "infer")["timeouts"] == {"request": "15s"}

    # The canary done: weight 0 and the header rule gone.
    op.write(RouteTarget(0, False))
    assert op.observed() == RouteObserved(100, 0, False)
    assert len(op.read()["spec"]["rules"]) == 1


def test_without_ignore_differences_argocd_overwrites_the_weights(
    kube: Kube, namespace: str, gateway_crds: None
) -> None:
    """Why manifests/argocd/README.md asks for ignoreDifferences: a plain sync applies Git's weights (the
    operator sets them back on its next reconcile, but traffic flips meanwhile)."""
    git = httproute("shop", namespace, "gw", "shop", {"stable": 80, "canary": 80})
    argo_sync(kube, namespace, git)
    op = Operator(kube, namespace)
    op.write(RouteTarget(25, False))
    argo_sync(kube, namespace, git)
    assert op.observed() == RouteObserved(100, 0, False)
    op.write(RouteTarget(25, False))
    assert op.observed() == RouteObserved(75, 25, False)


def test_a_missing_route_or_rule_is_a_clear_error(kube: Kube, namespace: str, gateway_crds: None) -> None:
    op = Operator(kube, namespace)
    with pytest.raises(opkube.TransientKubeError, match=r"HTTPRoute .*/shop .*not found"):
        write_route(
            op.k, op.k, op.body, op.routing, Decision(Status(), "a", 2, "b", 1, (), route=RouteTarget(10, False)), None
        )  # type: ignore[arg-type]
    git = httproute("shop", namespace, "gw", "shop", {"stable": 80, "canary": 80})
    git["spec"]["rules"][0]["name"] = "other"
    argo_sync(kube, namespace, git)
    with pytest.raises(opkube.TransientKubeError, match="no rule named 'infer'"):
        op.write(RouteTarget(10, False))


def test_example_route_is_admitted(kube: Kube, namespace: str, gateway_crds: None) -> None:
    example = REPO / "manifests" / "examples" / "gateway" / "httproute.yaml"
    result = kube.kubectl("apply", "--dry-run=server", "-n", namespace, "-f", str(example), check=False)
    assert result.returncode == 0, result.stderr
