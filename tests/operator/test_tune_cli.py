"""`batchpilot tune` and `batchpilot profile` end to end, in-process, on small inputs."""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path
from typing import Any

import pytest
import yaml

from batchpilot_operator.cli import main
from batchpilot_operator.spec import LaneSpec, parse_spec
from batchpilot_operator.tune.profile import load_profile

PROFILE = """\
model: {name: transformer, source: "builtin:transformer", device: cpu}
points:
  - {batchSize: 1, p50: 2ms, p90: 2.2ms, p99: 3ms}
  - {batchSize: 4, p50: 3ms, p90: 3.3ms, p99: 4ms}
  - {batchSize: 16, p50: 6ms, p90: 6.6ms, p99: 8ms}
  - {batchSize: 64, p50: 18ms, p90: 20ms, p99: 24ms}
"""

POLICY = """\
apiVersion: batchpilot.dev/v1alpha1
kind: BatchingPolicy
metadata: {name: ranker}
spec:
  model: {name: transformer, image: "ghcr.io/batchpilot/runtime:0.1.0", source: "builtin:transformer"}
  replicas: 2
  defaultLane: interactive
  lanes:
    - {name: background, maxBatchSize: 64, maxQueueDelay: 20ms, maxQueueLength: 4096, requestTimeout: 10s}
    - name: interactive
      maxBatchSize: 8
      maxQueueDelay: 1ms
      maxQueueLength: 256
      requestTimeout: 100ms
      priority: 10
      slo: {p99Latency: 40ms, maxQueueAge: 10ms}
      expectedRate: 150
  slo: {p99Latency: 1s, maxQueueAge: 500ms}
"""


@pytest.fixture
def inputs(tmp_path: Path) -> dict[str, Path]:
    rng = random.Random(5)
    t = 1_700_000_000.0
    lines = []
    for _ in range(1500):
        t += rng.expovariate(2.0) if rng.random() > 0.05 else 0.0005
        lines.append(f"{t:.6f}")
    trace = tmp_path / "arrivals.txt"
    trace.write_text("\n".join(lines) + "\n")
    profile = tmp_path / "profile.yaml"
    profile.write_text(PROFILE)
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY)
    return {"trace": trace, "profile": profile, "policy": policy}


def apply_json_patch(doc: dict[str, Any], ops: list[dict[str, Any]]) -> dict[str, Any]:
    """Just enough RFC 6902 (test, replace, add on object members) to check our patches."""
    out = copy.deepcopy(doc)
    for op in ops:
        *parents, leaf = op["path"].strip("/").split("/")
        node: Any = out
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        key: Any = int(leaf) if isinstance(node, list) else leaf
        if op["op"] == "test":
            assert node[key] == op["value"], op
        else:
            assert op["op"] in ("replace", "add")
            assert (key in node) == (op["op"] == "replace")
            node[key] = op["value"]
    return out


def test_tune_against_a_policy_emits_a_valid_json_patch(
    inputs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    patch_file = tmp_path / "patch.yaml"
    code = main([
        "tune", "--trace", str(inputs["trace"]), "--profile", str(inputs["profile"]),
        "--policy", str(inputs["policy"]), "-o", "json", "--patch-out", str(patch_file),
    ])  # fmt: skip
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    # Lane, SLO, replicas and target rate came from the policy.
    assert out["lane"] == "interactive" and out["policy"] == "ranker"
    assert out["replicas"] == 2
    assert out["slo_s"] == {"p99_latency": pytest.approx(0.04), "queue_age": pytest.approx(0.01)}
    assert out["target_rate_rps"] == pytest.approx(150.0)
    pred = out["predicted_at_target"]
    assert pred["p99_latency_s"] <= 0.04 * 0.8 and pred["p99_queue_age_s"] <= 0.01 * 0.8
    assert out["capacity_rps"] >= 150.0 and out["meets_target"]
    assert 1.0 <= pred["mean_batch_size"] <= out["recommended"]["maxBatchSize"]
    # The patch touches only the interactive lane (index 1), guarded by a test of its name.
    ops = out["patch"]
    assert ops[0] == {"op": "test", "path": "/spec/lanes/1/name", "value": "interactive"}
    doc = yaml.safe_load(inputs["policy"].read_text())
    patched = apply_json_patch(doc, ops)
    spec = parse_spec(patched["spec"])
    lane = next(ln for ln in spec.lanes if ln.name == "interactive")
    assert lane.max_batch_size == out["recommended"]["maxBatchSize"]
    assert lane.max_queue_delay == pytest.approx(out["recommended"]["maxQueueDelay"])
    assert spec.lanes[0] == parse_spec(doc["spec"]).lanes[0]  # background untouched
    # The merge patch carries the whole lanes list (merge patches replace lists) and is valid.
    merged = dict(doc["spec"], **out["merge_patch"]["spec"])
    assert parse_spec(merged) == spec
    # The file written for Git is the same patch, with the prediction as comments.
    text = patch_file.read_text()
    assert text.startswith("# batchpilot tune: lane interactive")
    assert yaml.safe_load(text) == ops


def test_tune_with_flags_prints_a_lane_block(inputs: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    code = main([
        "tune", "--trace", str(inputs["trace"]), "--profile", str(inputs["profile"]),
        "--p99", "50ms", "--queue-age", "20ms", "--lane", "fast", "--rate", "40",
    ])  # fmt: skip
    assert code == 0
    text = capsys.readouterr().out
    assert "recommended: maxBatchSize" in text and "predicted capacity" in text
    block = yaml.safe_load(text[text.index("# batchpilot tune") :])
    lane = LaneSpec.model_validate(block["spec"]["lanes"][0])
    assert lane.name == "fast" and lane.request_timeout == pytest.approx(0.2)


def _policy_with_checks(inputs: dict[str, Path], ratio: float, name: str = "ranker") -> dict[str, Any]:
    """The policy as ``kubectl get -o yaml`` shows it after three checks that found the pods
    ``ratio`` x slower than the model."""
    doc = yaml.safe_load(inputs["policy"].read_text())
    doc["metadata"]["name"] = name
    checks = [
        {"time": 1000.0 + k, "requests": 900, "predictedP99": 10.0, "observedP99": 10.0 * ratio, "correction": 1.0}
        for k in range(3)
    ]
    doc["status"] = {"recommendation": {"calibration": {"interactive": {"checks": checks}}}}
    return doc


def test_tune_applies_and_prints_the_measured_error(
    inputs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = [
        "tune",
        "--trace",
        str(inputs["trace"]),
        "--profile",
        str(inputs["profile"]),
        "--policy",
        str(inputs["policy"]),
    ]
    assert main([*base, "-o", "json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert plain["model"]["measured"] is False and "not measured" in plain["model"]["summary"]
    live = tmp_path / "live.yaml"
    live.write_text(yaml.safe_dump(_policy_with_checks(inputs, 2.0)))
    assert main([*base, "--calibration", str(live), "-o", "json"]) == 0
    corrected = json.loads(capsys.readouterr().out)
    model = corrected["model"]
    assert model["measured"] is True and model["correction"] == pytest.approx(2.0)
    assert model["withinTolerance"] is False and "model error last window -50%" in model["summary"]
    # Pods twice as slow as the model: the search runs as it would under half the SLO, and states
    # the p99 it finds at twice the model's, against the real SLO less margin.
    assert main([*base, "--p99", "20ms", "-o", "json"]) == 0
    halved = json.loads(capsys.readouterr().out)
    assert corrected["recommended"] == halved["recommended"]
    assert corrected["capacity_rps"] == pytest.approx(halved["capacity_rps"])
    assert corrected["predicted_at_target"]["p99_latency_s"] == pytest.approx(
        2 * halved["predicted_at_target"]["p99_latency_s"]
    )
    assert corrected["targets_s"]["p99_latency"] == pytest.approx(0.04 * 0.8)
    # The text output says it next to the predictions; the status in the --policy file is used too.
    policy_with_status = tmp_path / "policy-live.yaml"
    policy_with_status.write_text(yaml.safe_dump(_policy_with_checks(inputs, 2.0)))
    assert main([*base[:-1], str(policy_with_status)]) == 0
    text = capsys.readouterr().out
    assert "model error last window -50%" in text and "correction now x2" in text
    # Another policy's checks are refused.
    other = tmp_path / "other.yaml"
    other.write_text(yaml.safe_dump(_policy_with_checks(inputs, 2.0, name="other")))
    assert main([*base, "--calibration", str(other)]) == 2
    assert "policy 'other'" in capsys.readouterr().err


def test_a_bucketed_trace_is_spread_over_its_buckets(
    inputs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 3 s buckets of 30 requests each: as one burst per bucket, or spread uniformly over it.
    bucketed = tmp_path / "buckets.csv"
    bucketed.write_text("t_seconds\n" + "".join(f"{3.0 * (k // 30)}\n" for k in range(900)))
    base = ["tune", "--trace", str(bucketed), "--profile", str(inputs["profile"]), "--p99", "40ms",
            "--queue-age", "10ms", "-o", "json"]  # fmt: skip
    assert main(base) == 0
    burst = json.loads(capsys.readouterr().out)
    assert main([*base, "--spread-buckets", "3s"]) == 0
    spread = json.loads(capsys.readouterr().out)
    assert burst["trace"]["gap_cv"] > 5 and spread["trace"]["gap_cv"] < 1.5
    assert spread["trace"]["requests"] == burst["trace"]["requests"] == 900


def test_tune_explains_an_impossible_slo(inputs: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    code = main([
        "tune", "--trace", str(inputs["trace"]), "--profile", str(inputs["profile"]),
        "--p99", "2ms", "--queue-age", "1ms",
    ])  # fmt: skip
    assert code == 2
    assert "no batch size fits" in capsys.readouterr().err


def test_profile_measures_the_runtime_model(tmp_path: Path) -> None:
    out = tmp_path / "profile.yaml"
    code = main([
        "profile", "--source", "builtin:tiny-mlp", "--device", "cpu", "--threads", "1",
        "--batch-sizes", "1,4,16", "--iterations", "5", "--warmup", "1", "-o", str(out),
    ])  # fmt: skip
    assert code == 0
    prof = load_profile(out)
    assert prof.batch_sizes == [1, 4, 16]
    assert prof.model.source == "builtin:tiny-mlp" and prof.model.threads == 1
    assert all(p.samples == 5 and 0 < p.p50 <= p.p99 for p in prof.points)
