"""End to end: operator + real control plane + real Prometheus scraping real runtime processes
(one per pod, started by the local harness) under load replayed from the real trace.

(a) a sensible window change is promoted through every step; (b) a window that breaks the
SLO is rolled back by the operator, stable keeps serving, and the ledger holds the breaching
values; (c) with Prometheus stopped the rollout holds with Stalled, and resumes when it
returns. Figures (time from first breach to rollback, analyses it took) are printed and
written to $BATCHPILOT_E2E_REPORT when set.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from batchpilot_localdev.harness import RuntimeHarness
from batchpilot_localdev.load import TraceReplay
from batchpilot_localdev.prometheus import PrometheusServer
from batchpilot_operator.tune.trace import load_trace
from bptest import REPO, TINY_CANARY_POLICY, Kube, LedgerSeen, OperatorProcess, Plugin, PolicyScenario, start_operator

pytestmark = [pytest.mark.cluster, pytest.mark.prometheus, pytest.mark.slow]

TRACE = REPO.parent / "shared" / "traces" / "azure-llm-2023-code.csv"
RATE = 40.0  # requests/s over the whole policy

POLICY = TINY_CANARY_POLICY


def with_window(window: str, max_batch_size: int | None = None, max_queue_length: int | None = None) -> dict[str, Any]:
    policy = copy.deepcopy(POLICY)
    lane = policy["spec"]["lanes"][0]
    lane["maxQueueDelay"] = window
    if max_batch_size is not None:
        lane["maxBatchSize"] = max_batch_size
    if max_queue_length is not None:
        lane["maxQueueLength"] = max_queue_length
    return policy


def ts(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


class Scenario(PolicyScenario):
    def __init__(
        self, kube: Kube, namespace: str, prom: PrometheusServer, op: OperatorProcess, harness: RuntimeHarness
    ) -> None:
        self.kube, self.namespace, self.prom, self.op, self.harness = kube, namespace, prom, op, harness
        self.ledger = LedgerSeen()
        """Every ledger entry the polls below saw: each canary's analyses over its whole life
        (status keeps the newest only; one analysis every 4 s adds 4)."""

    def diagnostics(self) -> str:
        return f"harness errors: {self.harness.errors}"


@pytest.fixture
def scenario(kube: Kube, namespace: str, prometheus: PrometheusServer, tmp_path: Path) -> Iterator[Scenario]:
    trace = load_trace(TRACE)  # first: a missing trace fails the set-up before anything is started
    harness = RuntimeHarness(kube.kubeconfig, namespace, tmp_path / "runtime", prometheus).start()
    op = start_operator(kube, namespace, tmp_path, prometheus_url=prometheus.url, resync=1.0)
    replay = TraceReplay(trace.scaled_arrivals(RATE), lambda: harness.endpoints("shop"), model="tiny").start()
    scenario = Scenario(kube, namespace, prometheus, op, harness)
    try:
        yield scenario
    finally:
        replay.stop()
        op.stop()
        harness.stop()
        sys.stderr.write(f"\n[e2e] replay stats: { {k: (v.sent, v.ok, v.errors) for k, v in replay.stats.items()} }\n")


def test_canary_promotes_good_change_and_rolls_back_bad_one(scenario: Scenario) -> None:
    s = scenario
    first = s.first_revision(POLICY)
    s.harness.wait_ready("shop", 2)

    # (a) a sensible window: canary at 50%, analysed, promoted.
    canary = s.begin_canary(with_window("4ms"), first)
    done = s.promoted(canary, 180)
    assert done["history"][-1]["outcome"] == "Promoted"
    assert s.ledger.entries(revision=canary, outcome="Successful")

    # (b) a window that breaks the SLO: valid at admission (shorter than the 120 ms p99 SLO),
    # but window plus execution is not, and the queue age is far beyond its 60 ms objective.
    # The batch is raised to 64 rows with it (the usual "bigger batches, longer window to fill
    # them" mistake): the trace is bursty enough (at 40 req/s, 56% of arrivals start a 110 ms
    # span holding 16 or more requests) that 8-row batches often fill before the window ends,
    # and the p99 would then breach only in some analyses; 64 rows never fill (the largest such
    # span holds 118 requests, over two pods), so both objectives breach in every analysis.
    s.apply(with_window("110ms", max_batch_size=64))
    bad = s.wait(lambda st: st.get("canaryRevision") not in (None, canary), 60, "the bad canary")["canaryRevision"]
    rolled = s.wait(lambda st: st.get("phase") == "RolledBack", 180, "automatic rollback")
    assert rolled["stableRevision"] == canary, "stable untouched by the rollback"
    assert not rolled.get("canaryRevision")
    failed = s.ledger.entries(revision=bad, outcome="Failed")
    assert failed, rolled["ledger"]
    assert all(e["value"] > e["threshold"] for e in failed)
    # The queue age of every request that opens a batch is the whole 110 ms window: over its
    # 60 ms objective in full, it fails every analysis with data. The p99 breaches in each of them
    # too (its value over 120 ms, never Successful), but its count over 120 ms is interpolated
    # inside the 100-150 ms bucket, about a third of the queue age's: in a thin first window its
    # evidence can fall short of the sequential gate while the queue age's clears it, and the two
    # queue-age failures roll the canary back first (CI, 2026-12-07: only queueAge Failed).
    assert "queueAge" in {e["metric"] for e in failed}
    for at in {e["time"] for e in failed}:
        (p99,) = s.ledger.entries(revision=bad, time=at, metric="p99Latency", lane="interactive")
        assert p99["value"] > p99["threshold"] and p99["outcome"] in ("Failed", "Inconclusive"), p99
    # Each Failed entry carries the verdict's evidence: the share of requests over the
    # objective on both tracks and the confidence of the test that decided, in words and as
    # fields. Worse than the stable decides; over the budget only while the stable has too few
    # requests to compare with (its pods just rolled to the promoted revision).
    for e in failed:
        assert e["badFraction"] > 0.01, e
        if "confidenceWorse" in e:
            assert e["confidenceWorse"] >= 0.95 and e["stableBadFraction"] < e["badFraction"], e
            assert "worse than stable with" in e["evidence"], e
        else:
            assert e["confidenceOverBudget"] >= 0.95 and "over its 1% budget with" in e["evidence"], e
    rollback = next(e for e in reversed(rolled["ledger"]) if e.get("kind") == "RolledBack")
    first_breach = min(ts(e["time"]) for e in failed)
    figures = {
        "first_breach_to_rollback_seconds": round(ts(rollback["time"]) - first_breach, 1),
        "failed_analyses_before_rollback": len({e["time"] for e in failed}),
        "analysis_interval_seconds": 4,
        "breaching_values": [(e["lane"], e["metric"], e["value"], e["threshold"]) for e in failed],
    }
    # On-call's view of it: `kubectl batchpilot status` shows the breach against the SLO.
    plugin = Plugin(s.kube, s.namespace)
    view = plugin.json("status", "shop")
    (lane,) = view["lanes"]
    # The last analysis may have failed on either objective (or both): the view must show the
    # one that breached, against its SLO, and agree with what the ledger recorded.
    assert lane["outcome"] == "Failed"
    assert (lane["p99LatencySlo"], lane["maxQueueAge"]) == (0.12, 0.06)
    breached = {
        m for m, v, slo in (("p99Latency", lane["p99Latency"], 0.12), ("queueAge", lane["queueAge"], 0.06)) if v > slo
    }
    last_time = max(e["time"] for e in failed)
    failed_last = {e["metric"] for e in failed if e["time"] == last_time}
    assert failed_last and failed_last <= breached, (lane, failed)
    assert view["why"].startswith(f"revision {bad} rolled back (AnalysisFailed")
    table = plugin.run("status", "shop").stdout
    assert "RolledBack" in table and "Failed" in table
    sys.stderr.write("\n[kubectl batchpilot status, automatic rollback]\n" + table)
    if os.environ.get("BATCHPILOT_E2E_REPORT"):
        Path(os.environ["BATCHPILOT_E2E_REPORT"]).with_suffix(".status.txt").write_text(
            table + "\n" + plugin.run("history", "shop").stdout
        )
    # The stable track kept serving: its pods are ready and the canary is gone.
    s.kube.wait_for(lambda: s.kube.get("deployment", "shop-canary", s.namespace) is None, 60, "canary removed")
    assert len(s.harness.endpoints("shop")) >= 1
    # Not retried: the failed revision stays RolledBack over further resyncs.
    resyncs = s.op.metric("batchpilot_operator_reconciles_total", namespace=s.namespace)
    s.kube.wait_for(
        lambda: s.op.metric("batchpilot_operator_reconciles_total", namespace=s.namespace) >= resyncs + 5,
        30,
        "five more reconciles",
    )
    again = s.status()
    assert again["phase"] == "RolledBack" and not again.get("canaryRevision")

    # (c) Prometheus goes away mid-rollout: hold with Stalled, resume when it returns.
    s.apply(with_window("3ms"))
    third = s.wait(lambda st: st.get("canaryRevision") not in (None, canary, bad), 60, "a third canary")
    third_rev = third["canaryRevision"]
    s.prom.stop()
    t_stop = time.monotonic()
    stalled = s.wait(
        lambda st: any(c["type"] == "Stalled" and c["status"] == "True" for c in st.get("conditions", [])),
        60,
        "Stalled while Prometheus is down",
    )
    cond = next(c for c in stalled["conditions"] if c["type"] == "Stalled")
    assert cond["reason"] == "MetricsUnavailable", cond
    assert stalled["canaryRevision"] == third_rev and stalled["phase"] in ("Progressing",)
    figures["stall_detected_after_seconds"] = round(time.monotonic() - t_stop, 1)
    s.prom.start()
    s.wait(
        lambda st: st.get("stableRevision") == third_rev and st.get("phase") == "Healthy",
        180,
        "promotion after Prometheus returned",
    )

    # (d) a change that sheds load: a one-request queue bound. Whatever it serves is fast (a 5 ms
    # window, and never more than one request waiting), but in this trace's bursts many arrivals
    # find the slot taken and get a 429 (at least ~9% of the canary's requests in every 4 s
    # window): the error rate fails it. (Whether latency also breached in some window depends on
    # how busy the machine is, so the test asks only that the error rate did.)
    s.apply(with_window("5ms", max_queue_length=1))
    shedding = s.wait(lambda st: st.get("canaryRevision") not in (None, third_rev), 60, "the shedding canary")
    shed_rev = shedding["canaryRevision"]
    s.wait(
        lambda st: st.get("phase") == "RolledBack" and st.get("stableRevision") == third_rev,
        180,
        "rollback on the error rate",
    )
    shed_failed = s.ledger.entries(revision=shed_rev, outcome="Failed")
    shed_errors = [e for e in shed_failed if e["metric"] == "errorRate"]
    assert shed_errors and all(e["value"] > e["threshold"] == 0.01 for e in shed_errors), shed_failed
    (shed_lane,) = Plugin(s.kube, s.namespace).json("status", "shop")["lanes"]
    assert shed_lane["outcome"] == "Failed" and shed_lane["maxErrorRate"] == 0.01
    figures["shedding_error_rates"] = [round(e["value"], 3) for e in shed_errors]
    figures["shedding_failed_metrics"] = sorted({e["metric"] for e in shed_failed})

    # Every step of the story is also an Event on the policy, for `kubectl describe`.
    def reasons() -> set[str]:
        out = s.kube.kubectl(
            "get", "events", "-n", s.namespace, "--field-selector", "involvedObject.name=shop", "-o", "json"
        ).stdout
        return {e["reason"] for e in json.loads(out)["items"]}

    story = {"CanaryStarted", "Promoted", "RolledBack", "Stalled", "MetricsRestored"}
    s.kube.wait_for(lambda: story <= reasons(), 10, f"the Events {sorted(story)}")
    sys.stderr.write(f"\n[e2e] {json.dumps(figures)}\n")
    if os.environ.get("BATCHPILOT_E2E_REPORT"):
        Path(os.environ["BATCHPILOT_E2E_REPORT"]).write_text(json.dumps(figures, indent=2))
