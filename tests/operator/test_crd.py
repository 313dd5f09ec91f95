"""The CRD's admission rules (OpenAPI schema + CEL), checked by the real kube-apiserver, and
the pydantic twin (batchpilot_operator.spec) judging the same table the same way."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from batchpilot_operator.spec import parse_spec
from bptest import Kube

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted(p for p in (REPO / "manifests" / "examples").glob("*.yaml") if p.name != "kustomization.yaml")
DEMO = sorted((REPO / "manifests" / "demo").glob("*.yaml"))
"""The demo's revisions (namespaced to ``demo``; `make demo` applies them)."""

BASE: dict[str, Any] = {
    "apiVersion": "batchpilot.dev/v1alpha1",
    "kind": "BatchingPolicy",
    "metadata": {"name": "p"},
    "spec": {
        "model": {"name": "mlp", "image": "runtime:dev", "source": "builtin:mlp"},
        "replicas": 2,
        "lanes": [
            {
                "name": "interactive",
                "maxBatchSize": 8,
                "maxQueueDelay": "2ms",
                "maxQueueLength": 64,
                "requestTimeout": "100ms",
                "priority": 10,
            },
            {
                "name": "background",
                "maxBatchSize": 64,
                "maxQueueDelay": "20ms",
                "maxQueueLength": 1024,
                "requestTimeout": "5s",
                "slo": {"p99Latency": "2s", "maxQueueAge": "1s"},
            },
        ],
        "slo": {"p99Latency": "50ms", "maxQueueAge": "10ms"},
        "rollout": {"steps": [{"weight": 10, "pause": "30s"}, {"weight": 50, "pause": "1m"}]},
    },
}


_NULL = object()  # with _set: write an explicit null (None deletes the key)


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """A mutation setting spec.<path> (dots; integers index lists); value None deletes, _NULL writes null."""

    def mutate(spec: dict[str, Any]) -> None:
        keys: list[str | int] = [int(k) if k.isdigit() else k for k in path.split(".")]
        target: Any = spec
        for key in keys[:-1]:
            target = target[key]
        if value is None:
            del target[keys[-1]]
        else:
            target[keys[-1]] = None if value is _NULL else value

    return mutate


# (case id, mutation of spec, text the apiserver's and pydantic's errors must both contain)
INVALID: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("missing-model", _set("model", None), "model"),
    ("no-lanes", _set("lanes", []), "lanes"),
    ("batch-zero", _set("lanes.0.maxBatchSize", 0), "maxBatchSize"),
    ("batch-too-big", _set("lanes.0.maxBatchSize", 5000), "maxBatchSize"),
    ("window-not-a-duration", _set("lanes.0.maxQueueDelay", "5 ms"), "maxQueueDelay"),
    ("window-negative", _set("lanes.0.maxQueueDelay", "-5ms"), "maxQueueDelay"),
    (
        "window-over-policy-slo",
        _set("lanes.0.maxQueueDelay", "50ms"),
        "maxQueueDelay must be shorter than spec.slo",
    ),
    ("window-over-lane-slo", _set("lanes.1.maxQueueDelay", "3s"), "lanes[background].maxQueueDelay"),
    ("timeout-below-window", _set("lanes.0.requestTimeout", "1ms"), "requestTimeout must be longer"),
    ("duplicate-lanes", _set("lanes.1.name", "interactive"), "lane names must be unique"),
    ("weights-decreasing", _set("rollout.steps", [{"weight": 50}, {"weight": 10}]), "weights must increase"),
    ("weights-repeated", _set("rollout.steps", [{"weight": 20}, {"weight": 20}]), "weights must increase"),
    ("weight-zero", _set("rollout.steps", [{"weight": 0}]), "weight"),
    ("weight-over-100", _set("rollout.steps", [{"weight": 101}]), "weight"),
    ("default-lane-unknown", _set("defaultLane", "batch"), "defaultLane"),
    ("lane-name-invalid", _set("lanes.0.name", "Interactive_1"), "name"),
    ("device-unknown", _set("model.device", "tpu"), "device"),
    ("dtype-unknown", _set("model.dtype", "int8"), "dtype"),
    ("replicas-zero", _set("replicas", 0), "replicas"),
    ("source-unknown", _set("model.source", "http://models/x.pt"), "source"),
    ("queue-length-zero", _set("lanes.0.maxQueueLength", 0), "maxQueueLength"),
    ("gpus-negative", _set("resources", {"gpus": -1}), "gpus"),
    ("priority-over-100", _set("lanes.0.priority", 101), "priority"),
    ("warmup-over-an-hour", _set("rollout.warmup", "2h"), "warmup"),
    ("warmup-not-a-duration", _set("rollout.warmup", "soon"), "warmup"),
    ("metrics-action-unknown", _set("rollout.onMetricsUnavailable", {"action": "Ignore"}), "action"),
    ("p99-increase-zero", _set("rollout.maxP99Increase", 0), "maxP99Increase"),
    ("p99-increase-over-ten-fold", _set("rollout.maxP99Increase", 9.5), "maxP99Increase"),
    ("slo-zero", _set("slo.p99Latency", "0s"), "p99Latency"),
    ("missing-slo", _set("slo", None), "slo"),
    ("error-rate-over-one", _set("slo.maxErrorRate", 1.5), "maxErrorRate"),
    ("error-rate-negative", _set("lanes.1.slo.maxErrorRate", -0.1), "maxErrorRate"),
    ("error-rate-not-a-number", _set("slo.maxErrorRate", "1%"), "maxErrorRate"),
    ("error-rate-quoted", _set("slo.maxErrorRate", "0.05"), "maxErrorRate"),
    # issue 12: the tenant list is bounded (the runtime's tenant label takes at most 10 values)
    ("tenants-too-many", _set("tenants", {"names": [f"t{i}" for i in range(9)]}), "names"),
    ("tenants-empty", _set("tenants", {"names": []}), "names"),
    ("tenants-duplicate", _set("tenants", {"names": ["a", "a"]}), "must be unique"),
    ("tenants-reserved", _set("tenants", {"names": ["a", "other"]}), "reserved"),
    ("tenants-name-invalid", _set("tenants", {"names": ["Team_A"]}), "names"),
    ("tenants-header-invalid", _set("tenants", {"names": ["a"], "header": "X Tenant"}), "header"),
    # spec.rollout.trafficRouting (issue 13)
    ("routing-route-name", _set("rollout.trafficRouting", {"gatewayAPI": {"httpRoute": "Bad_Route"}}), "httpRoute"),
    ("routing-no-gateway-api", _set("rollout.trafficRouting", {"minCanaryLoadRatio": 0.5}), "gatewayAPI"),
    (
        "routing-header-name",
        _set("rollout.trafficRouting", {"gatewayAPI": {"httpRoute": "r"}, "header": {"name": "x t", "value": "v"}}),
        "header.name",
    ),
    (
        "routing-load-ratio-over-one",
        _set("rollout.trafficRouting", {"gatewayAPI": {"httpRoute": "r"}, "minCanaryLoadRatio": 2}),
        "minCanaryLoadRatio",
    ),
]

# Types: the CRD's OpenAPI types are strict (no "8" for an integer, no 5 for a duration string);
# `batchpilot validate` must never pass what admission rejects, so the models are strict too.
INVALID_TYPES: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("type-batch-quoted", _set("lanes.0.maxBatchSize", "8"), "maxBatchSize"),
    ("type-batch-fraction", _set("lanes.0.maxBatchSize", 8.5), "maxBatchSize"),
    ("type-batch-bool", _set("lanes.0.maxBatchSize", True), "maxBatchSize"),
    ("type-queue-length-quoted", _set("lanes.0.maxQueueLength", "64"), "maxQueueLength"),
    ("type-priority-quoted", _set("lanes.0.priority", "10"), "priority"),
    ("type-replicas-quoted", _set("replicas", "2"), "replicas"),
    ("type-threads-quoted", _set("model.threads", "4"), "threads"),
    ("type-gpus-quoted", _set("resources", {"gpus": "1"}), "gpus"),
    ("type-weight-quoted", _set("rollout.steps", [{"weight": "10"}]), "weight"),
    ("type-failure-limit-quoted", _set("rollout.failureLimit", "2"), "failureLimit"),
    ("type-min-samples-fraction", _set("rollout.minSamples", 100.5), "minSamples"),
    ("type-max-inconclusive-quoted", _set("rollout.maxInconclusive", "3"), "maxInconclusive"),
    ("type-history-limit-bool", _set("rollout.historyLimit", False), "historyLimit"),
    ("type-p99-increase-quoted", _set("rollout.maxP99Increase", "0.25"), "maxP99Increase"),
    (
        "type-dynamic-stable-scale-quoted",
        _set("rollout.trafficRouting", {"gatewayAPI": {"httpRoute": "r"}, "dynamicStableScale": "true"}),
        "dynamicStableScale",
    ),
    (
        "type-toleration-seconds-quoted",
        _set("tolerations", [{"key": "k", "tolerationSeconds": "5"}]),
        "tolerationSeconds",
    ),
    ("type-window-number", _set("lanes.0.maxQueueDelay", 0.002), "maxQueueDelay"),
    ("type-timeout-number", _set("lanes.0.requestTimeout", 1), "requestTimeout"),
    ("type-slo-p99-number", _set("slo.p99Latency", 0.05), "p99Latency"),
    ("type-lane-slo-age-number", _set("lanes.1.slo.maxQueueAge", 1), "maxQueueAge"),
    ("type-pause-number", _set("rollout.steps", [{"weight": 10, "pause": 30}]), "pause"),
    ("type-interval-number", _set("rollout.analysisInterval", 30), "analysisInterval"),
    ("type-deadline-number", _set("rollout.onMetricsUnavailable", {"action": "Rollback", "deadline": 60}), "deadline"),
    ("type-error-rate-bool", _set("slo.maxErrorRate", True), "maxErrorRate"),
    ("type-expected-rate-quoted", _set("lanes.0.expectedRate", "100"), "expectedRate"),
    ("type-lane-name-number", _set("lanes.0.name", 7), "name"),
    ("type-model-name-number", _set("model.name", 5), "name"),
    ("type-image-number", _set("model.image", 1), "image"),
    ("type-default-lane-number", _set("defaultLane", 1), "defaultLane"),
    ("type-device-bool", _set("model.device", True), "device"),
    ("type-node-selector-int", _set("nodeSelector", {"gpu": 1}), "nodeSelector"),
    ("type-lanes-object", _set("lanes", {"name": "interactive"}), "lanes"),
    ("type-slo-string", _set("slo", "50ms"), "slo"),
    ("type-steps-object", _set("rollout.steps", {"weight": 10}), "steps"),
    ("type-required-null", _set("lanes.0.maxBatchSize", _NULL), "maxBatchSize"),
]

# ... and where the CRD's types allow something, the models allow it too.
VALID_TYPES: list[tuple[str, Callable[[dict[str, Any]], None]]] = [
    ("integer-for-number", _set("slo.maxErrorRate", 1)),
    ("integer-p99-increase", _set("rollout.maxP99Increase", 1)),
    ("whole-float-for-integer", _set("lanes.0.maxBatchSize", 8.0)),  # JSON has one number type
    ("whole-float-replicas", _set("replicas", 3.0)),
    ("integer-expected-rate", _set("lanes.0.expectedRate", 100)),
    ("fraction-expected-rate", _set("lanes.0.expectedRate", 12.5)),
    ("null-optional-defaults", _set("replicas", _NULL)),
    ("null-priority", _set("lanes.0.priority", _NULL)),
]


def policy_with(mutation: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    policy = copy.deepcopy(BASE)
    if mutation:
        mutation(policy["spec"])
    return policy


def pydantic_error(spec: dict[str, Any]) -> str | None:
    try:
        parse_spec(spec)
    except ValidationError as exc:
        return "\n".join(".".join(str(p) for p in err["loc"]) + ": " + err["msg"] for err in exc.errors())
    return None


# ---- pure: the pydantic models --------------------------------------------------------


@pytest.mark.parametrize(("case", "mutation", "expected"), INVALID, ids=[c[0] for c in INVALID])
def test_models_reject_invalid_policy_naming_the_field(case: str, mutation: Any, expected: str) -> None:
    error = pydantic_error(policy_with(mutation)["spec"])
    assert error is not None, f"{case}: the models accepted an invalid policy"
    assert expected in error, f"{case}: error does not name {expected!r}:\n{error}"


@pytest.mark.parametrize(("case", "mutation", "expected"), INVALID_TYPES, ids=[c[0] for c in INVALID_TYPES])
def test_models_reject_wrong_types_as_the_crd_does(case: str, mutation: Any, expected: str) -> None:
    error = pydantic_error(policy_with(mutation)["spec"])
    assert error is not None, f"{case}: the models coerced a value that admission rejects"
    assert expected in error, f"{case}: error does not name {expected!r}:\n{error}"


@pytest.mark.parametrize(("case", "mutation"), VALID_TYPES, ids=[c[0] for c in VALID_TYPES])
def test_models_accept_what_the_crd_types_allow(case: str, mutation: Any) -> None:
    assert pydantic_error(policy_with(mutation)["spec"]) is None


def test_python_callers_may_still_pass_float_seconds() -> None:
    from batchpilot_operator.spec import CanaryStep

    assert CanaryStep(weight=10, pause=30.0).pause == 30.0  # only manifests must spell durations


@pytest.mark.parametrize("path", EXAMPLES + DEMO, ids=[p.stem for p in EXAMPLES + DEMO])
def test_models_accept_examples(path: Path) -> None:
    doc = yaml.safe_load(path.read_text())
    assert pydantic_error(doc["spec"]) is None


def test_revision_ignores_operator_only_fields() -> None:
    spec = parse_spec(policy_with()["spec"])
    scaled = parse_spec(policy_with(_set("replicas", 7))["spec"])
    relaxed = parse_spec(policy_with(_set("slo.p99Latency", "80ms"))["spec"])
    error_budget = parse_spec(policy_with(_set("slo.maxErrorRate", 0.05))["spec"])
    rewindowed = parse_spec(policy_with(_set("lanes.0.maxQueueDelay", "3ms"))["spec"])
    assert spec.revision() == scaled.revision() == relaxed.revision() == error_budget.revision()
    assert (spec.slo.max_error_rate, error_budget.slo.max_error_rate) == (0.01, 0.05)  # default 1%
    assert spec.revision() != rewindowed.revision()
    # Equivalent spellings of one duration are one revision.
    respelled = parse_spec(policy_with(_set("lanes.0.maxQueueDelay", "2000us"))["spec"])
    assert respelled.revision() == spec.revision()


# ---- the real apiserver -------------------------------------------------------------------


@pytest.mark.cluster
def test_crd_is_established(kube: Kube) -> None:
    crd = kube.get("crd", "batchingpolicies.batchpilot.dev")
    assert crd is not None
    conditions = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
    assert conditions["Established"] == "True"
    assert conditions["NamesAccepted"] == "True"
    out = kube.kubectl("api-resources", "--api-group=batchpilot.dev", "-o", "name").stdout
    assert "batchingpolicies.batchpilot.dev" in out


@pytest.mark.cluster
def test_apiserver_rejects_each_invalid_policy_naming_the_field(kube: Kube, namespace: str) -> None:
    failures = []
    for case, mutation, expected in INVALID:
        policy = policy_with(mutation)
        policy["metadata"]["name"] = case
        result = kube.apply(policy, "-n", namespace, "--dry-run=server", check=False)
        if result.returncode == 0:
            failures.append(f"{case}: accepted by the apiserver")
        elif expected not in result.stderr:
            failures.append(f"{case}: message does not name {expected!r}: {result.stderr.strip()}")
    assert not failures, "\n".join(failures)


@pytest.mark.cluster
def test_apiserver_rejects_each_wrong_type_naming_the_field(kube: Kube, namespace: str) -> None:
    failures = []
    for case, mutation, expected in INVALID_TYPES:
        policy = policy_with(mutation)
        policy["metadata"]["name"] = case
        result = kube.apply(policy, "-n", namespace, "--dry-run=server", check=False)
        if result.returncode == 0:
            failures.append(f"{case}: accepted by the apiserver")
        elif expected not in result.stderr:
            failures.append(f"{case}: message does not name {expected!r}: {result.stderr.strip()}")
    assert not failures, "\n".join(failures)


@pytest.mark.cluster
def test_apiserver_accepts_what_the_models_accept_on_types(kube: Kube, namespace: str) -> None:
    failures = []
    for case, mutation in VALID_TYPES:
        policy = policy_with(mutation)
        policy["metadata"]["name"] = case
        result = kube.apply(policy, "-n", namespace, "--dry-run=server", check=False)
        if result.returncode != 0:
            failures.append(f"{case}: rejected by the apiserver: {result.stderr.strip()}")
    assert not failures, "\n".join(failures)


@pytest.mark.cluster
def test_apiserver_and_models_agree_on_valid_policies(kube: Kube, namespace: str) -> None:
    for path in EXAMPLES:
        result = kube.kubectl("apply", "-n", namespace, "--dry-run=server", "-f", str(path), check=False)
        assert result.returncode == 0, f"{path.name}: {result.stderr}"
    base = policy_with()
    assert kube.apply(base, "-n", namespace, "--dry-run=server", check=False).returncode == 0
    assert pydantic_error(base["spec"]) is None


@pytest.mark.cluster
def test_printer_columns(kube: Kube, namespace: str) -> None:
    kube.apply(policy_with(), "-n", namespace)
    header = kube.kubectl("get", "bp", "-n", namespace).stdout.splitlines()[0].split()
    assert header == ["NAME", "PHASE", "STABLE", "CANARY", "WEIGHT", "AGE"]
