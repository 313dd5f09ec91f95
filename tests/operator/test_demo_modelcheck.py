"""The demo's per-analysis-window model check (pure: pod records built from the real simulator)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pytest

from batchpilot_localdev.modelcheck import (
    OutcomeCollector,
    PodRecord,
    stable_over_slo,
    window_rows,
    window_table,
)
from batchpilot_operator.tune.captures import MergedTraffic, merge_profiles
from batchpilot_operator.tune.live import lane_settings_from_spec
from batchpilot_operator.tune.simulator import simulate
from bp_captures import LANE_SETTINGS, poisson, profile_doc

T0 = 1_800_000_000.0


def pod(name: str, revision: str, track: str, slowdown: float, seed: int) -> PodRecord:
    """A pod that served Poisson traffic for 60 s, its requests ``slowdown`` x the model's time."""
    times = [T0 + t - 1000.0 for t in poisson(60.0, 60.0, seed)]
    profile = merge_profiles([profile_doc(1.0)])
    sim = simulate(
        [t - times[0] for t in times],
        lane_settings_from_spec(LANE_SETTINGS),
        profile.exec_table(LANE_SETTINGS["maxBatchSize"]),
        1,
        "random",
        0,
        profile.request_overhead,
        dispatch_delay=profile.dispatch_delay,
    )
    rec = PodRecord(name, revision, track, settings={"interactive": LANE_SETTINGS}, profile=profile_doc(1.0))
    # Latencies in arrival order are not the simulator's completion order, but a p99 is a p99.
    rec.arrivals["interactive"] = {
        t: [1, lat * slowdown, wait * slowdown]
        for t, lat, wait in zip(times, sim.latencies, sim.queue_waits, strict=True)
    }
    return rec


def analysis(at: float, **extra: Any) -> dict[str, Any]:
    when = datetime.fromtimestamp(T0 + at, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return {
        "kind": "Analysis", "metric": "p99Latency", "lane": "interactive", "track": "canary", "revision": "bad",
        "time": when, "value": 0.2, "stableValue": 0.05, "outcome": "Failed",
        "query": 'histogram_quantile(0.99, sum by (le) (rate(x_bucket{track="canary"}[20s])))',
    } | extra  # fmt: skip


def test_each_analysis_window_gets_the_model_against_each_track() -> None:
    collector = OutcomeCollector(lambda: [])
    collector.pods = {
        "s1": pod("s1", "good", "stable", 1.0, seed=1),
        "c1": pod("c1", "bad", "canary", 3.0, seed=2),
        "c0": pod("c0", "older", "canary", 1.0, seed=3),  # another revision's canary: not this analysis's
        # A stable pod replaced before the window (a slower profile): it lends nothing to it.
        "s0": pod("s0", "first", "stable", 1.0, seed=4),
    }
    s0 = collector.pods["s0"]
    s0.arrivals["interactive"] = {t - 1000.0: v for t, v in s0.arrivals["interactive"].items()}
    s0.profile = profile_doc(5.0)
    ledger = [
        analysis(40.0),
        analysis(40.0, tenant="web"),  # slices are not lane-level windows
        analysis(40.0, metric="queueAge"),
        {"kind": "Promoted", "time": "2027-01-01T00:00:00Z"},
    ]
    rows = window_rows(collector, ledger, start=T0)
    assert [(r["track"], r["revision"]) for r in rows] == [("canary", "bad"), ("stable", "good")]
    canary, stable = rows
    assert canary["window"] == 20.0 and canary["t"] == 40.0 and canary["prometheusP99"] == 0.2
    assert stable["prometheusP99"] == 0.05
    # 20 s at 60 req/s, one pod each.
    assert 900 < canary["requests"] < 1500
    assert stable["error"] == pytest.approx(0.0, abs=1e-9)
    assert canary["error"] == pytest.approx(1 / 3 - 1, abs=0.02)  # the canary took 3x the model
    table = window_table(rows)
    assert "model p99" in table and "1 of 2 windows within 20%" in table
    assert "SLO" not in table  # said only when asked, with the SLO


def test_a_runs_captures_read_back_give_the_same_rows() -> None:
    """report/captures.json (``dump``, through JSON) replays a run already made: ``load`` gives
    back pods from which the rows come out the same, a request never answered included."""
    collector = OutcomeCollector(lambda: [])
    collector.pods = {"s1": pod("s1", "good", "stable", 1.0, seed=1), "c1": pod("c1", "bad", "canary", 2.0, seed=2)}
    held = collector.pods["c1"].arrivals["interactive"]
    # Served requests as a runtime records them now: the batch's pass and the answer's hand-off
    # too, a tenth of the request's time after its queue wait each (s1 keeps the older form).
    for entry in held.values():
        entry += [(entry[1] - entry[2]) / 10, (entry[1] - entry[2]) / 10]
    held[max(held)] = [1, float("inf"), 0.0, None, None]  # timed out
    held[max(held) + 0.001] = [2, None, None, None, None]  # still unanswered when the run ended
    ledger = [analysis(40.0), analysis(60.0)]
    doc = json.loads(json.dumps(collector.dump()))
    back = OutcomeCollector(lambda: [])
    back.pods = OutcomeCollector.load(doc)
    assert back.pods.keys() == collector.pods.keys()
    for name, rec in collector.pods.items():
        assert back.pods[name] == rec
    rows = window_rows(collector, ledger, start=T0)
    assert window_rows(back, ledger, start=T0) == rows
    # Where the canary's time went, from its parts (the stable's pod recorded none).
    canary = [r for r in rows if r["track"] == "canary"]
    assert canary and all(set(r["observedParts"]) == {"wait", "pass", "handoff"} for r in canary)
    assert all(r["observedParts"]["pass"] == r["observedParts"]["handoff"] > 0 for r in canary)
    assert not any("observedParts" in r for r in rows if r["track"] == "stable")


def test_the_stables_breaches_are_told_with_the_burst_they_came_in() -> None:
    # Three stable windows: one at the median burst under the SLO, one in a burst twice it over
    # the SLO (the trace's), one at the median over it (the setting's own, or the machine's).
    def row(t: float, peak: float, p99: float | None) -> dict[str, Any]:
        return {
            "t": t,
            "track": "stable",
            "revision": "r1",
            "requests": 400,
            "pods": 2,
            "peakPerPod": peak,
            "observedP99": p99,
        }

    rows = [
        row(20, 10.0, 0.05),
        row(40, 20.0, 0.3),
        row(60, 10.0, 0.15),
        {
            "t": 60,
            "track": "canary",
            "revision": "r2",
            "requests": 50,
            "pods": 1,
            "peakPerPod": 90.0,
            "observedP99": 0.9,
        },
        row(80, 0.0, None),  # no requests answered: not a window of the stable's
    ]
    rows[2]["observedParts"] = {"wait": 0.03, "pass": 0.09, "handoff": 0.04}
    line = stable_over_slo(rows, 0.12)
    assert line.startswith("stable over its 120ms SLO in 2 of 3 windows")
    assert "t=40s 2.0x, " in line and "t=20s" not in line
    # a breach at the median burst, with where its time went: the pass, not the queue
    assert "t=60s 1.0x (p99 queue 30 ms, pass 90 ms, hand-off 40 ms)" in line
    assert stable_over_slo(rows[:1], 0.12) == "stable over its 120ms SLO in 0 of 1 windows"
    assert stable_over_slo([], 0.12) == ""
    assert line in window_table(rows, 0.12)


def test_a_windows_burst_is_its_busiest_second() -> None:
    # 30 arrivals spread over 30 s, then 20 within half a second: the burst is 20/s, not the
    # window's mean of 50/30 s.
    times = [float(t) for t in range(30)] + [30.0 + 0.025 * k for k in range(20)]

    def peak(ts: list[float]) -> float:
        return MergedTraffic("interactive", ["p"], ["r"], 0.0, 31.0, ts, [1] * len(ts)).peak_row_rate()

    assert peak(times) == 20.0
    assert peak([]) == 0.0 and peak([1.0]) == 1.0


def test_a_window_with_too_few_requests_says_why() -> None:
    collector = OutcomeCollector(lambda: [])
    collector.pods = {"s1": pod("s1", "good", "stable", 1.0, seed=1)}
    (row,) = window_rows(collector, [analysis(2.0, query="rate(x[1s])")], start=T0)
    assert "fewer than" in row["skipped"] and row.get("error") is None
    assert "fewer than" in window_table([row])
