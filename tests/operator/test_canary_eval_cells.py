"""bench/canary_eval.py's cells are the policies they are named for, whatever clocks a study sets.

The study's numbers describe a routing only if its policies route as named: a ``gateway`` cell
is a policy with a Gateway API route (exact weights 10/25/50, minCanaryLoadRatio 0.5, as the
shipped example), a ``ratio`` cell one without (each step's weight a share of the pods). From
00:21 to 08:12 UTC on 2026-12-06 ``--interval`` moved the route onto every cell and off the
gateway cells without it, and the matrix's "gateway" rows were replica-ratio rollouts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from canary_eval import Cell, policy, step_layouts, summarize


@pytest.mark.parametrize("interval", [None, "20"])
@pytest.mark.parametrize("last_pause", [None, "80"])
@pytest.mark.parametrize("replicas", [2, 4])
def test_routing_follows_the_cell_not_the_clocks(
    monkeypatch: pytest.MonkeyPatch, interval: str | None, last_pause: str | None, replicas: int
) -> None:
    for name, value in (("CANARY_EVAL_INTERVAL", interval), ("CANARY_EVAL_LAST_PAUSE", last_pause)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    routed = policy(8, 2, 512, cell=Cell("code", replicas, "gateway"))
    assert routed.rollout.traffic_routing is not None
    assert routed.rollout.traffic_routing.min_canary_load_ratio == 0.5
    assert [s.weight for s in routed.rollout.steps] == [10, 25, 50]
    assert {w: share for w, (_, _, share) in step_layouts(routed).items()} == {10: 0.1, 25: 0.25, 50: 0.5}

    plain = policy(8, 2, 512, cell=Cell("code", replicas, "ratio"))
    assert plain.rollout.traffic_routing is None
    assert [s.weight for s in plain.rollout.steps] == [25, 50]
    for _, (stable, canary, share) in step_layouts(plain).items():
        assert share == canary / (stable + canary), "without a route every pod takes an equal share"

    for spec in (routed, plain):
        assert spec.rollout.analysis_interval == float(interval or 15)
        assert spec.rollout.steps[-1].pause == float(last_pause or 20)


def test_a_miss_counts_against_the_bar_only_where_the_rollout_did_not_say_so() -> None:
    """The issue's bar is per rollout: caught, or said up front that the effect is out of reach.
    A cell's two shares cannot show it (90% caught and 90% said so may leave 10% with neither)."""

    def rollout(outcome: str, errors: float | None) -> dict[str, object]:
        return {
            "outcome": outcome,
            "analyses": 3,
            "seconds": 60.0,
            "worst_share_seen": 0.0,
            "detectable": 0.3,
            "detectable_errors": errors,
        }

    cell = {"analyses": 30, "failed": 0, "inconclusive": 0}
    rollouts = [
        rollout("RolledBack", 0.01),  # caught, though it said 2% was in reach
        rollout("Promoted", 0.05),  # missed, and said so: 5% errors was the least it could see
        rollout("Promoted", 0.01),  # missed after saying 2% was in reach: against the bar
        rollout("running", None),  # no first analysis: it said nothing
    ]
    out = summarize(cell | {"rollouts": rollouts}, "shed2", failure_limit=2)
    assert out["missed_unwarned"] == 0.5
    assert out["said_2pct_errors_not_detectable"] == round(1 / 3, 4)
    # a 20% slower model is judged on the p99 statement (0.3 > 0.2: every rollout said so)
    assert summarize(cell | {"rollouts": rollouts}, "slower20", failure_limit=2)["missed_unwarned"] == 0.0
    assert "missed_unwarned" not in summarize(cell | {"rollouts": rollouts}, "aa", failure_limit=2)
