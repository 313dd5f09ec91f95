"""One lane contract: a lane's fields are declared once (batchpilot_runtime.config.LaneConfig),
the operator's LaneSpec is that plus its own fields, the CRD's lane schema is written from it by
hack/gen_crd.py, and the tuner's LaneSettings are its batching fields. Each test here fails when
one of them drifts from the others. (test_crd.py holds the models and the real apiserver to the
same table of policies; this file holds the declarations themselves.)"""

from __future__ import annotations

import copy
import importlib.util
import math
import re
from dataclasses import fields
from pathlib import Path
from types import ModuleType
from typing import Any

import annotated_types
import pytest
import yaml
from pydantic import BaseModel, Field, ValidationError

from batchpilot_operator.spec import RUNTIME_LANE_KEYS, SLO, LaneSpec, parse_spec
from batchpilot_operator.tune.simulator import LaneSettings
from batchpilot_runtime.config import LaneConfig, RuntimeConfig, is_duration
from bptest import INTERACTIVE_LANE

REPO = Path(__file__).resolve().parents[2]
CRD_PATH = REPO / "crds" / "batchingpolicy.yaml"


def _load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gen_crd", REPO / "hack" / "gen_crd.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen = _load_generator()


def _spec_schema() -> dict[str, Any]:
    crd = yaml.safe_load(CRD_PATH.read_text())
    schema: dict[str, Any] = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return schema


def _lane_schema() -> dict[str, Any]:
    items: dict[str, Any] = _spec_schema()["properties"]["lanes"]["items"]
    return items


def _keys(model: type[BaseModel]) -> dict[str, str]:
    """The model's field names by the manifest's keys."""
    return {field.alias or name: name for name, field in model.model_fields.items()}


def _required(model: type[BaseModel]) -> list[str]:
    return [field.alias or name for name, field in model.model_fields.items() if field.is_required()]


# ---- the CRD's lane schema is the models' ---------------------------------------------------


def test_crd_lane_fields_are_the_models() -> None:
    wanted = gen.lane_schema()
    lane = _lane_schema()
    differ = [
        f"{key}: CRD {lane['properties'].get(key)} != models {schema}"
        for key, schema in wanted["properties"].items()
        if lane["properties"].get(key) != schema
    ]
    assert not differ, "run .venv/bin/python hack/gen_crd.py:\n" + "\n".join(differ)
    assert lane["required"] == wanted["required"] == _required(LaneSpec)


def test_crd_file_is_as_the_generator_writes_it() -> None:
    text = CRD_PATH.read_text()
    assert gen.generate(text) == text, "crds/batchingpolicy.yaml is stale: run .venv/bin/python hack/gen_crd.py"
    assert gen.main(["--check"]) == 0


def test_crd_lane_has_no_property_the_models_lack() -> None:
    # The generated block holds the scalar fields; nested objects (slo) are written by hand
    # around it, and must still be fields of the model.
    assert set(_lane_schema()["properties"]) == set(_keys(LaneSpec))


@pytest.mark.parametrize("where", ["spec.slo", "spec.lanes[].slo"])
def test_crd_slo_objects_have_the_slo_models_fields(where: str) -> None:
    spec = _spec_schema()
    slo = spec["properties"]["slo"] if where == "spec.slo" else _lane_schema()["properties"]["slo"]
    assert set(slo["properties"]) == set(_keys(SLO))
    assert slo["required"] == _required(SLO)


def test_crd_lane_cel_rules_name_lane_fields() -> None:
    lane = _lane_schema()
    for rule in lane["x-kubernetes-validations"]:
        text = " ".join(str(rule.get(k, "")) for k in ("rule", "messageExpression"))
        named = set(re.findall(r"\bself\.(\w+)", text))
        if "fieldPath" in rule:
            named.add(rule["fieldPath"].lstrip("."))
        assert named <= set(lane["properties"]), f"{rule['rule']}: names {sorted(named - set(lane['properties']))}"


def test_a_drifted_crd_fails_the_check() -> None:
    text = CRD_PATH.read_text()
    drifted = text.replace("maximum: 4096", "maximum: 2048", 1)
    assert drifted != text
    assert gen.generate(drifted) == text  # the generator writes the models' bound back


def test_generator_refuses_what_it_cannot_state() -> None:
    class Odd(BaseModel):
        step: int = Field(multiple_of=2)

    with pytest.raises(TypeError, match="no CRD keyword"):
        gen.lane_schema(Odd)


# ---- LaneSpec is the runtime's lane plus the operator's own fields --------------------------


def test_lane_spec_declares_no_runtime_field_again() -> None:
    for name, field in LaneConfig.model_fields.items():
        mine = LaneSpec.model_fields[name]
        assert (mine.alias, mine.annotation, mine.metadata, mine.default, mine.description) == (
            field.alias,
            field.annotation,
            field.metadata,
            field.default,
            field.description,
        ), name
    assert set(LaneSpec.model_fields) - set(LaneConfig.model_fields) == {"slo", "expected_rate"}
    assert set(_keys(LaneConfig)) == RUNTIME_LANE_KEYS


LANE: dict[str, Any] = {
    **INTERACTIVE_LANE,
    "priority": 10,
    "expectedRate": 50,
    "slo": {"p99Latency": "80ms", "maxQueueAge": "10ms"},
}
SPEC: dict[str, Any] = {
    "model": {"name": "mlp", "image": "runtime:dev", "source": "builtin:mlp"},
    "lanes": [LANE],
    "slo": {"p99Latency": "50ms", "maxQueueAge": "10ms"},
}


def test_the_pods_get_every_runtime_field_and_none_of_the_operators() -> None:
    spec = parse_spec(copy.deepcopy(SPEC))
    lane = spec.lanes[0].runtime_lane()
    assert type(lane) is LaneConfig
    assert lane.model_dump() == {name: getattr(spec.lanes[0], name) for name in LaneConfig.model_fields}
    config = spec.runtime_config("p", spec.revision())
    # The ConfigMap's JSON reads back, strictly, as the runtime reads it.
    assert RuntimeConfig.model_validate_json(config.to_json(), strict=True).lanes[0] == lane
    assert set(spec.revision_relevant()["lanes"][0]) == RUNTIME_LANE_KEYS


_INTEGERS = [name for name, f in LaneConfig.model_fields.items() if f.annotation is int]
_DURATIONS = [name for name, f in LaneConfig.model_fields.items() if is_duration(f)]


@pytest.mark.parametrize("name", _INTEGERS)
def test_spec_takes_a_whole_float_for_every_integer_field_as_the_crd_does(name: str) -> None:
    key = LaneConfig.model_fields[name].alias or name
    spec = copy.deepcopy(SPEC)
    spec["lanes"][0][key] = float(LANE[key])
    assert getattr(parse_spec(spec).lanes[0], name) == LANE[key]
    runtime_lane = {k: v for k, v in LANE.items() if k in RUNTIME_LANE_KEYS} | {key: float(LANE[key])}
    with pytest.raises(ValidationError) as raised:  # the runtime's config file stays strict
        LaneConfig.model_validate(runtime_lane, strict=True)
    assert [e["loc"] for e in raised.value.errors()] == [(key,)]


@pytest.mark.parametrize("name", _DURATIONS)
def test_spec_takes_every_duration_field_only_as_a_string_as_the_crd_does(name: str) -> None:
    key = LaneConfig.model_fields[name].alias or name
    spec = copy.deepcopy(SPEC)
    spec["lanes"][0][key] = 0.05
    with pytest.raises(ValidationError, match=key):
        parse_spec(spec)


# ---- the tuner's LaneSettings are the runtime lane's batching fields ------------------------

NOT_SIMULATED = {"name", "priority"}
"""Lane fields the simulator has no use for: it runs one lane, and priority orders lanes."""


def test_lane_settings_fields_are_lane_config_fields() -> None:
    names = [f.name for f in fields(LaneSettings)]
    assert set(names) <= set(LaneConfig.model_fields)
    assert set(LaneConfig.model_fields) - set(names) == NOT_SIMULATED, (
        "a new lane field: give LaneSettings it if it shapes batches, else add it to NOT_SIMULATED"
    )


UNCHECKED = {"request_timeout"}
"""LaneSettings fields the simulator takes as they come (a timeout may be math.inf: none)."""


def test_lane_settings_have_the_models_lower_bounds_and_no_upper_ones() -> None:
    good = LaneSettings(max_batch_size=8, max_queue_delay=0.002, max_queue_length=64, request_timeout=1.0)
    for f in fields(LaneSettings):
        if f.name in UNCHECKED:
            continue
        model_field = LaneConfig.model_fields[f.name]
        lows = [m.ge for m in model_field.metadata if isinstance(m, annotated_types.Ge)]
        if is_duration(model_field):
            lows = [0.0]  # a duration is never negative
            below: float = -1e-9
        else:
            assert len(lows) == 1, f.name
            below = lows[0] - 1
        LaneSettings(**{**good.__dict__, f.name: lows[0]})
        with pytest.raises(ValueError, match=f.name):
            LaneSettings(**{**good.__dict__, f.name: below})
    # Above the CRD's bounds a simulation may go (the search explores; an infinite timeout is none).
    LaneSettings(max_batch_size=10_000, max_queue_delay=1.0, max_queue_length=10**9, request_timeout=math.inf)
