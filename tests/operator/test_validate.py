"""`batchpilot validate` as CI runs it (a real subprocess), and the feasibility bounds (pure)."""

from __future__ import annotations

import copy
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from batchpilot_operator.feasibility import check_policy
from batchpilot_operator.spec import parse_spec
from batchpilot_operator.tune.profile import LatencyProfile, ProfiledModel, ProfilePoint, load_profile
from bptest import REPO

EXAMPLES = REPO / "manifests" / "examples"
MLP_PROFILE = REPO / "manifests" / "profiles" / "mlp-cpu.yaml"

POLICY: dict[str, Any] = {
    "apiVersion": "batchpilot.dev/v1alpha1",
    "kind": "BatchingPolicy",
    "metadata": {"name": "ranker"},
    "spec": {
        "model": {"name": "m", "image": "runtime:dev", "source": "builtin:mlp", "device": "cpu", "dtype": "float32"},
        "replicas": 2,
        "lanes": [
            {
                "name": "interactive",
                "maxBatchSize": 16,
                "maxQueueDelay": "5ms",
                "maxQueueLength": 64,
                "requestTimeout": "1s",
            }
        ],
        "slo": {"p99Latency": "100ms", "maxQueueAge": "20ms"},
    },
}


def fake_profile(points: dict[int, float], overhead: float = 0.0, source: str = "builtin:mlp") -> LatencyProfile:
    """A profile whose every quantile column is the given time (seconds) per batch size."""
    return LatencyProfile(
        model=ProfiledModel(name="m", source=source, device="cpu", dtype="float32"),
        request_overhead=overhead,
        points=[ProfilePoint(batch_size=b, p50=t, p90=t, p99=t) for b, t in points.items()],
    )


def write_profile(tmp_path: Path, points: dict[int, float], overhead: float = 0.0) -> Path:
    path = tmp_path / "profile.yaml"
    path.write_text(fake_profile(points, overhead).to_yaml())
    return path


def validate(*args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "batchpilot_operator.cli", "validate", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def policy_file(tmp_path: Path, *policies: dict[str, Any], name: str = "policy.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump_all(policies, sort_keys=False))
    return path


def line_of(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


# --------------------------------------------------------------------------- feasibility (pure)


def lane(**changes: Any) -> dict[str, Any]:
    policy = copy.deepcopy(POLICY)
    policy["spec"]["lanes"][0].update(changes)
    return policy


def test_window_plus_full_batch_over_the_slo_is_an_error() -> None:
    # 5 ms + 96 ms = 101 ms > 100 ms: an error, naming the window to aim for.
    spec = parse_spec(lane()["spec"])
    findings = check_policy(spec, fake_profile({1: 0.010, 16: 0.096}))
    errors = [f for f in findings if f.severity == "error"]
    assert [f.check for f in errors] == ["latency"]
    assert errors[0].lane == "interactive" and errors[0].field == "spec.lanes[0].maxQueueDelay"
    assert "101ms exceeds the p99 SLO 100ms" in errors[0].message
    assert "below 4ms" in errors[0].message


def test_a_full_batch_too_slow_by_itself_suggests_a_smaller_batch() -> None:
    # 5 ms + E(16) = 5 + 160 ms; E(b) = 10 ms per row: batches of 9 fit (5 + 90 <= 100)
    spec = parse_spec(lane()["spec"])
    findings = check_policy(spec, fake_profile({1: 0.010, 16: 0.160}))
    (err,) = [f for f in findings if f.severity == "error"]
    assert "lower maxBatchSize to 9 or less" in err.message


def test_request_overhead_counts() -> None:
    spec = parse_spec(lane()["spec"])
    assert not [f for f in check_policy(spec, fake_profile({1: 0.01, 16: 0.094})) if f.severity == "error"]
    with_overhead = check_policy(spec, fake_profile({1: 0.01, 16: 0.094}, overhead=0.002))
    assert [f.check for f in with_overhead if f.severity == "error"] == ["latency"]


def test_contended_bound_is_only_a_warning() -> None:
    # 5 + 50 = 55 ms fits; 5 + 2*50 = 105 ms (behind a running full batch) does not.
    spec = parse_spec(lane()["spec"])
    findings = check_policy(spec, fake_profile({1: 0.01, 16: 0.05}))
    assert [(f.severity, f.check) for f in findings] == [("warning", "latency-contended")]
    assert not check_policy(spec, fake_profile({1: 0.01, 16: 0.04}))


def test_lane_slo_overrides_policy_slo() -> None:
    policy = lane(slo={"p99Latency": "30ms", "maxQueueAge": "5ms"})
    findings = check_policy(parse_spec(policy["spec"]), fake_profile({1: 0.01, 16: 0.03}))
    err = next(f for f in findings if f.severity == "error")
    assert "spec.lanes[0].slo.p99Latency" in err.message


def test_capacity_below_expected_rate() -> None:
    # 2 replicas x 16 rows / 40 ms = 800 rows/s.
    ok = parse_spec(lane(expectedRate=700)["spec"])
    assert not [f for f in check_policy(ok, fake_profile({1: 0.01, 16: 0.04})) if f.severity == "error"]
    short = parse_spec(lane(expectedRate=900)["spec"])
    err = [f for f in check_policy(short, fake_profile({1: 0.01, 16: 0.04})) if f.severity == "error"]
    assert [f.check for f in err] == ["capacity"]
    assert "800/s" in err[0].message and err[0].field == "spec.lanes[0].expectedRate"


def test_lanes_share_the_executor() -> None:
    policy = lane(expectedRate=500)
    second = dict(policy["spec"]["lanes"][0], name="background", expectedRate=500, priority=0)
    policy["spec"]["lanes"].append(second)
    # each lane alone fits (500 < 800/s), together they need 125% of the executor
    findings = check_policy(parse_spec(policy["spec"]), fake_profile({1: 0.01, 16: 0.04}))
    assert [f.check for f in findings if f.severity == "error"] == ["utilisation"]


def test_the_pods_http_loops_bound_the_rate_whatever_the_batching() -> None:
    # The model serves 2 x 16 / 40 ms = 800 rows/s; 2 loops at 4 ms per request answer 500/s.
    profile = fake_profile({1: 0.01, 16: 0.04}).model_copy(update={"front_end_cost": 0.004})
    ok = check_policy(parse_spec(lane(expectedRate=450)["spec"]), profile)
    assert not [f for f in ok if f.severity == "error"]
    err = [f for f in check_policy(parse_spec(lane(expectedRate=600)["spec"]), profile) if f.severity == "error"]
    assert [f.check for f in err] == ["front-end"]
    assert "500/s" in err[0].message and "frontEndCost" in err[0].message and err[0].field == "spec.replicas"


def test_extrapolated_batch_size_is_flagged() -> None:
    findings = check_policy(parse_spec(lane(maxBatchSize=64)["spec"]), fake_profile({1: 0.001, 16: 0.004}))
    assert any(f.check == "profile" and "extrapolated" in f.message for f in findings)


# --------------------------------------------------------------------------- the command


def test_examples_pass_with_the_mlp_profile() -> None:
    assert load_profile(MLP_PROFILE).model.source == "builtin:mlp"
    result = validate(EXAMPLES, "--profile", MLP_PROFILE, "-o", "json")
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(result.stdout)
    assert report["ok"] is True and report["policies"] == 4 and report["errors"] == 0
    checked = {f["policy"] for f in report["findings"] if f["check"] != "profile"}
    # the two MLP policies were checked against the profile; the transformer one says it was not
    unchecked = [f for f in report["findings"] if "no latency profile" in f["message"]]
    assert [f["policy"] for f in unchecked] == ["search-ranker"]
    assert checked <= {"chat-embedder", "chat-ranker", "nightly-scorer"}


def test_examples_pass_schema_only() -> None:
    result = validate(*sorted(EXAMPLES.glob("*.yaml")))
    assert result.returncode == 0, result.stdout
    assert re.search(r"OK: 4 policies in \d+ file\(s\), 0 error\(s\), 0 warning\(s\)$", result.stdout.strip())


def test_infeasible_policy_fails_with_a_clear_message(tmp_path: Path) -> None:
    profile = write_profile(tmp_path, {1: 0.010, 16: 0.096})
    path = policy_file(tmp_path, POLICY)
    result = validate(path, "--profile", profile)
    assert result.returncode == 1
    line = result.stdout.splitlines()[0]
    # file:line of the field at fault, policy/lane, the arithmetic
    assert line.startswith(
        f"{path}:{line_of(path, 'maxQueueDelay:')}: error: ranker/interactive: window 5ms + execution of a full batch of 16"
    )
    assert "exceeds the p99 SLO 100ms" in line
    assert result.stdout.rstrip().endswith("FAILED: 1 policy in 1 file(s), 1 error(s), 0 warning(s)")


def test_capacity_error_names_the_expected_rate(tmp_path: Path) -> None:
    profile = write_profile(tmp_path, {1: 0.01, 16: 0.04})
    result = validate(policy_file(tmp_path, lane(expectedRate=5000)), "--profile", profile, "-o", "json")
    assert result.returncode == 1
    (err,) = [f for f in json.loads(result.stdout)["findings"] if f["severity"] == "error"]
    assert err["check"] == "capacity" and err["field"] == "spec.lanes[0].expectedRate" and err["lane"] == "interactive"


def test_schema_errors_name_the_field(tmp_path: Path) -> None:
    bad_type = lane(maxBatchSize=0)
    unknown = lane(maxBatch=8)
    unknown["metadata"]["name"] = "typo"
    cel = lane(requestTimeout="1ms")
    cel["metadata"]["name"] = "short-timeout"
    other = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}}
    path = policy_file(tmp_path, bad_type, other, unknown, cel)
    result = validate(path, "-o", "json")
    assert result.returncode == 1
    report = json.loads(result.stdout)
    assert report["policies"] == 3, "the ConfigMap is skipped"
    by_policy = {f["policy"]: f for f in report["findings"]}
    assert by_policy["ranker"]["field"] == "spec.lanes[0].maxBatchSize"
    assert "greater than or equal to 1" in by_policy["ranker"]["message"]
    assert by_policy["typo"]["field"] == "spec.lanes[0].maxBatch"
    assert "Extra inputs are not permitted" in by_policy["typo"]["message"]
    # the same message as the CRD's CEL rule
    assert by_policy["short-timeout"]["message"].startswith(
        "spec.lanes[interactive].requestTimeout must be longer than maxQueueDelay"
    )
    # lines point into the right document
    text = path.read_text().splitlines()
    assert "maxBatchSize: 0" in text[by_policy["ranker"]["line"] - 1]
    assert "maxBatch: 8" in text[by_policy["typo"]["line"] - 1]


def test_wrong_types_the_apiserver_rejects_fail_validation(tmp_path: Path) -> None:
    # Written as a person would: a quoted number and a bare number for a duration. The
    # apiserver rejects both (tests/operator/test_crd.py runs the same cases through it).
    path = tmp_path / "typed.yaml"
    path.write_text(
        yaml.safe_dump(POLICY, sort_keys=False)
        .replace("maxBatchSize: 16", 'maxBatchSize: "16"')
        .replace("maxQueueDelay: 5ms", "maxQueueDelay: 5")
    )
    result = validate(path, "-o", "json")
    assert result.returncode == 1, result.stdout
    findings = {f["field"]: f for f in json.loads(result.stdout)["findings"]}
    assert "valid integer" in findings["spec.lanes[0].maxBatchSize"]["message"]
    assert "duration string" in findings["spec.lanes[0].maxQueueDelay"]["message"]
    text = path.read_text().splitlines()
    assert 'maxBatchSize: "16"' in text[findings["spec.lanes[0].maxBatchSize"]["line"] - 1]


def test_github_annotations(tmp_path: Path) -> None:
    profile = write_profile(tmp_path, {1: 0.010, 16: 0.096})
    path = policy_file(tmp_path, POLICY)
    result = validate(path, "--profile", profile, "-o", "github")
    assert result.returncode == 1
    first = result.stdout.splitlines()[0]
    assert first.startswith(
        f"::error file={path},line={line_of(path, 'maxQueueDelay:')},title=batchpilot validate%3A ranker/interactive::window 5ms"
    )
    assert "\n" not in first


def test_unreadable_inputs_are_errors(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("kind: BatchingPolicy\nspec: [unclosed\n")
    result = validate(broken, tmp_path / "missing.yaml", "-o", "json")
    assert result.returncode == 1
    messages = [f["message"] for f in json.loads(result.stdout)["findings"]]
    assert any(m.startswith("not valid YAML") for m in messages)
    assert any(m.startswith("cannot read") for m in messages)


@pytest.mark.parametrize("field", ["apiVersion", "metadata"])
def test_envelope_errors(tmp_path: Path, field: str) -> None:
    policy = copy.deepcopy(POLICY)
    if field == "apiVersion":
        policy["apiVersion"] = "batchpilot.dev/v1"
    else:
        policy["metadata"] = {"name": "Not_A_Name"}
    result = validate(policy_file(tmp_path, policy), "-o", "json")
    assert result.returncode == 1
    assert json.loads(result.stdout)["findings"][0]["field"].startswith(field)


def test_too_few_samples_for_a_p99_is_a_warning(tmp_path: Path) -> None:
    policy = copy.deepcopy(POLICY)
    policy["spec"].setdefault("rollout", {})["minSamples"] = 20
    path = policy_file(tmp_path, policy)
    result = validate(path)
    assert result.returncode == 0, result.stdout
    assert f"{path}:{line_of(path, 'minSamples:')}: warning: ranker: spec.rollout.minSamples is 20" in result.stdout
    policy["spec"]["rollout"]["minSamples"] = 100
    assert "minSamples" not in validate(policy_file(tmp_path, policy)).stdout


def live_policy(tmp_path: Path, ratio: float, name: str = "ranker") -> Path:
    """The policy as ``kubectl get -o yaml`` shows it after three live checks that found the pods
    ``ratio`` x slower than the model."""
    live = copy.deepcopy(POLICY)
    live["metadata"]["name"] = name
    checks = [
        {"time": 1000.0 + k, "requests": 900, "predictedP99": 10.0, "observedP99": 10.0 * ratio, "correction": 1.0}
        for k in range(3)
    ]
    live["status"] = {"recommendation": {"calibration": {"interactive": {"checks": checks}}}}
    return policy_file(tmp_path, live, name=f"live-{name}.yaml")


def test_the_measured_model_error_is_stated_and_its_correction_checked(tmp_path: Path) -> None:
    # window 5ms + full batch 40ms = 45ms: within the 100ms SLO by the profile (85ms behind another
    # full batch), not with the pods measured 2.5x as slow as the model.
    profile = write_profile(tmp_path, {1: 0.010, 16: 0.040})
    path = policy_file(tmp_path, POLICY)
    plain = json.loads(validate(path, "--profile", profile, "-o", "json").stdout)
    assert [f["check"] for f in plain["findings"]] == ["calibration"]
    assert plain["findings"][0]["severity"] == "info" and "not measured" in plain["findings"][0]["message"]
    result = validate(path, "--profile", profile, "--calibration", live_policy(tmp_path, 2.5), "-o", "json")
    assert result.returncode == 0, result.stdout  # warnings: the live figures inform, the bounds decide
    found = [f for f in json.loads(result.stdout)["findings"] if f["check"] == "calibration"]
    (info,) = [f for f in found if f["severity"] == "info"]
    assert info["lane"] == "interactive" and "model error last window -60%" in info["message"]
    warnings = [f for f in found if f["severity"] == "warning"]
    assert len(warnings) == 2
    assert any("more than 25%" in w["message"] for w in warnings)
    over = next(w for w in warnings if "correction" in w["message"])
    assert over["field"] == "spec.lanes[0].maxQueueDelay" and "45ms is 112ms" in over["message"]
    # Another policy's checks do not apply; a model within tolerance gives the notice alone.
    other = json.loads(validate(path, "--profile", profile, "--calibration", live_policy(tmp_path, 2.0, "other"),
                                "-o", "json").stdout)  # fmt: skip
    assert "not measured" in other["findings"][0]["message"]
    text = validate(path, "--profile", profile, "--calibration", live_policy(tmp_path, 1.1), "-o", "github").stdout
    assert text.startswith("::notice ") and "::warning" not in text and "model error last window -9%" in text
