"""The model's check at each analysis (modelwatch): what it reads, when, and that a failure to
read the pods costs the reconcile nothing (pure: a fake gather, the real simulator)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from batchpilot_operator import modelwatch
from batchpilot_operator.analysis import AnalysisResult
from batchpilot_operator.spec import parse_spec
from batchpilot_operator.status import Recommendation, Status
from bp_captures import LANE_SETTINGS, profile_doc, revision_doc

NOW = datetime(2026, 12, 2, 20, 0, tzinfo=UTC)
BASE = {
    "model": {"name": "m", "image": "i", "source": "builtin:tiny-mlp"},
    "lanes": [{"name": "interactive", **LANE_SETTINGS}],
    "slo": {"p99Latency": "50ms", "maxQueueAge": "30ms"},
}
ANALYSIS = AnalysisResult(time=NOW, window="30s", canary_revision="new", stable_revision="old")


@dataclass
class Gathered:
    arrivals: list[dict[str, Any]]
    profiles: list[dict[str, Any]]
    errors: list[str] = field(default_factory=list)


def test_without_spec_tuning_the_pods_are_not_read() -> None:
    def gather(ns: str, policy: str, window: float) -> Any:
        raise AssertionError("read without spec.tuning")

    got = modelwatch.attach(None, parse_spec(BASE), Status(), ANALYSIS, policy="p", namespace="n", gather=gather)
    assert got is ANALYSIS


def test_each_revision_is_checked_over_the_analysis_window_with_the_lanes_correction() -> None:
    asked: list[tuple[str, str, float]] = []

    def gather(ns: str, policy: str, window: float) -> Any:
        asked.append((ns, policy, window))
        docs = [revision_doc("new", 2.0, seed=3), revision_doc("old", 2.0, seed=4)]
        return Gathered(docs, [profile_doc(1.0)] * 2, errors=["pod x: 503 Service Unavailable"])

    rec = Recommendation(
        time=NOW, nextAt=NOW, window="1h", growth=2.0, margin=0.2,
        calibration={"interactive": {"checks": [
            {"time": 1, "requests": 500, "predictedP99": 10.0, "observedP99": 20.0, "correction": 1.0}
        ]}},
    )  # fmt: skip
    spec = parse_spec({**BASE, "tuning": {"interval": "60s"}})
    got = modelwatch.attach(None, spec, Status(recommendation=rec), ANALYSIS, policy="p", namespace="n", gather=gather)
    assert asked == [("n", "p", 30.0)]
    checks = {m.track: m for m in got.model}
    assert set(checks) == {"canary", "stable"}
    for m in checks.values():
        assert m.check is not None
        assert m.check.correction == 2.0 and abs(m.check.error) < 0.02  # 2x slower, corrected by 2x


def test_a_failed_read_is_a_reason_not_a_failed_reconcile() -> None:
    def gather(ns: str, policy: str, window: float) -> Any:
        raise OSError("403 Forbidden: pods/proxy")

    spec = parse_spec({**BASE, "tuning": {}})
    got = modelwatch.attach(None, spec, Status(), ANALYSIS, policy="p", namespace="n", gather=gather)
    assert [(m.track, m.check) for m in got.model] == [("canary", None), ("stable", None)]
    assert all("403 Forbidden: pods/proxy" in m.skipped for m in got.model)
