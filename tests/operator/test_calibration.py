"""The latency model checked against the pods' own outcomes: error, correction, and how a
recommendation states them (pure: fake capture documents, the real simulator)."""

from __future__ import annotations

import math

import pytest

from batchpilot_operator.spec import PolicySpec, parse_spec
from batchpilot_operator.tune.calibration import (
    KEEP,
    MAX_CORRECTION,
    MIN_REQUESTS,
    TOLERANCE,
    Check,
    LaneCalibration,
    calibrations_from_status,
)
from batchpilot_operator.tune.captures import merge_traffic, parse_capture
from batchpilot_operator.tune.live import check_revisions, lane_settings_from_spec, recommend_lane, recommend_policy
from batchpilot_operator.tune.search import SLOTargets
from bp_captures import LANE_SETTINGS, PROFILE, capture_doc, pods_doc, poisson, profile_doc, revision_doc

SPEC: PolicySpec = parse_spec(
    {
        "model": {"name": "m", "image": "i", "source": "builtin:tiny-mlp"},
        "lanes": [{"name": "interactive", **LANE_SETTINGS}],
        "slo": {"p99Latency": "50ms", "maxQueueAge": "30ms"},
    }
)


def test_the_model_against_itself_has_no_error_and_no_correction() -> None:
    result = recommend_policy(SPEC, [pods_doc(1.0)], [profile_doc(1.0)])
    (rec,) = result.lanes
    check = rec.model.last
    assert check is not None and check.requests > MIN_REQUESTS
    assert check.raw_error == pytest.approx(0.0, abs=1e-9) and check.error == pytest.approx(0.0, abs=1e-9)
    assert rec.model.correction == pytest.approx(1.0) and rec.model.within_tolerance is True
    assert not any("correction" in n for n in rec.notes)


def test_pods_slower_than_the_model_are_flagged_then_corrected() -> None:
    slow = [pods_doc(2.0)]
    first = recommend_policy(SPEC, slow, [profile_doc(1.0)])
    (rec,) = first.lanes
    check = rec.model.last
    assert check is not None
    # The model promised half of what the pods took; shown as is (no correction yet), so flagged.
    assert check.raw_error == pytest.approx(-0.5, abs=0.01) and check.error == pytest.approx(-0.5, abs=0.01)
    assert rec.model.within_tolerance is False
    assert any("predictions are estimates" in n for n in rec.notes), rec.notes
    # From now on every p99 stated carries the correction: at the observed traffic it is the pods' p99.
    assert rec.model.correction == pytest.approx(2.0, rel=0.01)
    assert rec.current.at_observed.p99_latency == pytest.approx(check.observed_p99, rel=0.01)
    uncorrected = recommend_policy(SPEC, [pods_doc(1.0)], [profile_doc(1.0)]).lanes[0]
    assert rec.current.capacity < uncorrected.current.capacity  # searched under the SLO / 2
    # The next window, with the correction in force, is within tolerance.
    second = recommend_policy(
        SPEC, [pods_doc(2.0, seed=2)], [profile_doc(1.0)], calibration=calibrations_from_status(
            {"calibration": first.calibration()}
        )
    )  # fmt: skip
    model = second.lanes[0].model
    assert len(model.checks) == 2 and model.last is not None
    assert abs(model.last.error) < 0.1 and model.within_tolerance is True
    assert abs(model.last.raw_error + 0.5) < 0.1
    d = second.lanes[0].to_dict()["model"]
    assert d["withinTolerance"] is True and "model error last window" in d["summary"]


def test_no_check_without_outcomes_or_with_too_few_requests() -> None:
    old_runtime = pods_doc(1.0)
    del old_runtime["lanes"][0]["outcomes"]
    (rec,) = recommend_policy(SPEC, [old_runtime], [profile_doc(1.0)]).lanes
    assert rec.model.checks == () and "no request outcomes" in rec.model.skipped
    assert rec.model.within_tolerance is None and "not measured yet" in rec.model.summary()
    quiet = pods_doc(1.0, rate=3.0, seconds=30.0)
    (rec,) = recommend_policy(SPEC, [quiet], [profile_doc(1.0)]).lanes
    assert rec.model.checks == () and f"fewer than {MIN_REQUESTS}" in rec.model.skipped


def test_requests_not_served_count_as_infinitely_late() -> None:
    doc = pods_doc(1.0)
    lat = doc["lanes"][0]["outcomes"]["latency"]
    for i in range(0, len(lat), 50):  # 2% timed out: the p99 is not finite
        lat[i] = -1.0
    (rec,) = recommend_policy(SPEC, [doc], [profile_doc(1.0)]).lanes
    assert rec.model.checks == () and "not finite" in rec.model.skipped


def check(ratio: float, correction: float = 1.0, t: float = 0.0) -> Check:
    return Check(
        time=t, requests=1000, predicted_p99=0.010, observed_p99=0.010 * ratio, predicted_wait=0.002,
        observed_wait=0.003, correction=correction,
    )  # fmt: skip


def test_the_correction_is_the_median_of_recent_ratios_bounded() -> None:
    cal = LaneCalibration()
    for r in (1.5, 1.6, 9.0, 1.4):  # one wild window does not move the median far
        cal = cal.add(check(r))
    assert cal.correction == pytest.approx(1.55)
    for k in range(KEEP):
        cal = cal.add(check(0.01, t=k))
    assert len(cal.checks) == KEEP and cal.correction == pytest.approx(1 / MAX_CORRECTION)
    assert LaneCalibration().correction == 1.0


def test_error_as_shown_uses_the_correction_then_in_force() -> None:
    c = check(2.0, correction=1.8)
    assert c.raw_error == pytest.approx(-0.5) and c.error == pytest.approx(-0.1)
    assert LaneCalibration((c,)).within_tolerance is True
    far = check(2.0, correction=2 * (1 - TOLERANCE) - 0.1)  # shown error just beyond -TOLERANCE
    assert LaneCalibration((far,)).within_tolerance is False


def test_calibration_round_trips_through_the_status() -> None:
    cal = LaneCalibration((check(1.2, t=1.0), check(1.3, 1.2, t=2.0)), "")
    back = calibrations_from_status({"calibration": {"interactive": cal.to_dict()}})["interactive"]
    assert back.correction == pytest.approx(cal.correction)
    assert [c.to_dict() for c in back.checks] == [c.to_dict() for c in cal.checks]
    # An unreadable history starts over instead of failing the recommendation.
    assert (
        calibrations_from_status({"calibration": {"interactive": {"checks": [{"time": "x"}]}}})["interactive"].checks
        == ()
    )
    assert calibrations_from_status(None) == {}


def test_recommend_lane_states_corrected_predictions() -> None:
    times = poisson(100.0, 60.0)
    traffic = merge_traffic(
        [parse_capture(capture_doc("a", times, window_start=1000.0, captured_at=1060.0))], "interactive"
    )
    current = lane_settings_from_spec(LANE_SETTINGS)
    slo = SLOTargets(0.050, 0.030, 0.2)
    plain = recommend_lane(traffic, PROFILE, current, slo, replicas=1)
    corrected = recommend_lane(traffic, PROFILE, current, slo, replicas=1, model=LaneCalibration((check(3.0),)))
    assert corrected.current.at_observed.p99_latency == pytest.approx(3 * plain.current.at_observed.p99_latency)
    assert corrected.current.capacity < plain.current.capacity
    assert math.isfinite(corrected.current.capacity)
    assert any("correction x3" in n for n in corrected.notes), corrected.notes


# --------------------------------------------------------------------------- per revision, per analysis


def test_each_revision_is_checked_at_the_traffic_it_got() -> None:
    # The canary's pods took 1.5x what the model says; the stable's what it says.
    docs = [revision_doc("new", 1.5, seed=3), revision_doc("old", 1.0, seed=4)]
    checks = check_revisions(docs, [profile_doc(1.0)] * 2, ["interactive"], {"new": "canary", "old": "stable"})
    by_track = {c.track: c for c in checks}
    canary, stable = by_track["canary"].check, by_track["stable"].check
    assert canary is not None and stable is not None
    assert canary.raw_error == pytest.approx(1 / 1.5 - 1, abs=0.01)
    assert stable.raw_error == pytest.approx(0.0, abs=0.01)
    assert "canary p99" in by_track["canary"].describe() and "-33%" in by_track["canary"].describe()


def test_a_revision_check_applies_the_lanes_correction_as_shown() -> None:
    docs = [revision_doc("old", 2.0, seed=5)]
    (check,) = check_revisions(docs, [profile_doc(1.0)], ["interactive"], {"old": "stable"}, {"interactive": 2.0})
    assert check.check is not None
    assert check.check.raw_error == pytest.approx(-0.5, abs=0.01)
    assert check.check.error == pytest.approx(0.0, abs=0.01)


def test_a_revision_without_pods_or_traffic_says_why() -> None:
    quiet = revision_doc("old", 1.0, seed=6)
    quiet["lanes"][0]["times"] = quiet["lanes"][0]["times"][:50]
    quiet["lanes"][0]["rows"] = quiet["lanes"][0]["rows"][:50]
    for key in ("times", "latency", "queueWait"):
        quiet["lanes"][0]["outcomes"][key] = quiet["lanes"][0]["outcomes"][key][:50]
    checks = check_revisions([quiet], [profile_doc(1.0)], ["interactive"], {"new": "canary", "old": "stable"})
    by_track = {c.track: c for c in checks}
    assert by_track["canary"].check is None and "no ready pod of revision new" in by_track["canary"].skipped
    assert by_track["stable"].check is None and f"fewer than {MIN_REQUESTS}" in by_track["stable"].skipped
    assert "stable not checked" in by_track["stable"].describe()
