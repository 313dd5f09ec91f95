"""Latency profiles (format, validation, interpolation) and arrival traces (formats, scaling)."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from batchpilot_operator.tune.profile import LatencyProfile, load_profile
from batchpilot_operator.tune.trace import Trace, load_trace

PROFILE_YAML = """\
apiVersion: batchpilot.dev/v1alpha1
kind: LatencyProfile
model: {name: mlp, source: "builtin:mlp", device: cpu, threads: 2}
requestOverhead: 200us
points:
  - {batchSize: 1, p50: 1ms, p90: 1.5ms, p99: 2ms}
  - {batchSize: 4, p50: 2ms, p90: 3ms, p99: 4ms}
  - {batchSize: 8, p50: 4ms, p90: 5ms, p99: 6ms}
"""


def test_profile_loads_durations_and_interpolates(tmp_path: Path) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(PROFILE_YAML)
    prof = load_profile(path)
    assert prof.request_overhead == pytest.approx(200e-6)
    assert prof.quantile == "p90"
    assert prof.exec_time(1) == pytest.approx(1.5e-3)
    assert prof.exec_time(4, "p50") == pytest.approx(2e-3)
    assert prof.exec_time(2) == pytest.approx(1.5e-3 + (3e-3 - 1.5e-3) / 3)
    assert prof.exec_time(6, "p99") == pytest.approx(5e-3)
    # Beyond the largest measured size: along the last segment, flagged as extrapolated.
    assert prof.exec_time(16) == pytest.approx(5e-3 + 8 * 0.5e-3)
    assert prof.extrapolated(16) and not prof.extrapolated(8)
    table = prof.exec_table(8)
    assert table[0] == 0.0 and len(table) == 9 and table[8] == pytest.approx(5e-3)


def test_profile_round_trips_through_yaml(tmp_path: Path) -> None:
    prof = LatencyProfile.model_validate(__import__("yaml").safe_load(PROFILE_YAML))
    path = tmp_path / "again.yaml"
    path.write_text(prof.to_yaml())
    assert load_profile(path) == prof
    assert "1.5ms" in path.read_text()


@pytest.mark.parametrize(
    ("points", "message"),
    [
        (
            [{"batchSize": 4, "p50": "1ms", "p99": "2ms"}, {"batchSize": 2, "p50": "1ms", "p99": "2ms"}],
            "increasing",
        ),
        ([{"batchSize": 1, "p50": "3ms", "p99": "2ms"}], "below p50"),
        ([{"batchSize": 1, "p50": "1ms", "p90": "5ms", "p99": "2ms"}], "between p50 and p99"),
        ([{"batchSize": 0, "p50": "1ms", "p99": "2ms"}], "greater than or equal to 1"),
        ([{"batchSize": 1, "p50": "fast", "p99": "2ms"}], "invalid duration"),
    ],
)
def test_profile_rejects_bad_points(points: list[dict[str, object]], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        LatencyProfile.model_validate({"model": {"name": "m", "source": "builtin:mlp"}, "points": points})


AZURE = """\
TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:17:03.9799600,4808,10
2023-11-16 18:17:04.0319600,3180,8
2023-11-16 18:17:04.0781490,110,27
2023-11-16 18:17:05.9799600,7433,14
"""


def test_loads_the_azure_csv(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text(AZURE)
    trace = load_trace(path)
    assert trace.count == 4
    assert trace.arrivals == pytest.approx((0.0, 0.052, 0.098189, 2.0), abs=1e-6)
    assert trace.mean_rate == pytest.approx(3 / 2.0)


def test_loads_plain_timestamps_with_header_and_comments(tmp_path: Path) -> None:
    path = tmp_path / "t.txt"
    path.write_text("# exported\ntimestamp\n1700000010.5\n1700000010.0\n\n1700000012.0,extra\n")
    trace = load_trace(path)
    assert trace.arrivals == pytest.approx((0.0, 0.5, 2.0))


def test_rejects_garbage_trace(tmp_path: Path) -> None:
    path = tmp_path / "t.txt"
    path.write_text("1.0\n2.0\nsoon\n")
    with pytest.raises(ValueError, match="soon"):
        load_trace(path)


def test_scaling_keeps_burst_shape_and_hits_the_rate() -> None:
    trace = Trace.from_times([0.0, 0.001, 0.002, 10.0, 10.001, 30.0], "x")
    fast = trace.scaled(50.0)
    assert fast.mean_rate == pytest.approx(50.0)
    # Every gap shrinks by the same factor: the ratio of burst gap to idle gap is kept.
    g = trace.arrivals
    f = fast.arrivals
    assert (f[1] - f[0]) / (f[3] - f[2]) == pytest.approx((g[1] - g[0]) / (g[3] - g[2]))
    assert trace.scale_factor(50.0) == pytest.approx(50.0 / trace.mean_rate)
    assert trace.window(9.0, 31.0).arrivals == pytest.approx((0.0, 0.001, 20.0))
