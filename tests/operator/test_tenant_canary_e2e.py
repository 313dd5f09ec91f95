"""End to end (issue 12): canaries judged per tenant slice and on what they reject.

Operator + real control plane + real Prometheus scraping real runtime processes (one per pod,
started by the local harness) under two tenants' traffic sharing one policy and one lane:

* ``bulk`` replays the real trace (``RATE`` requests/s, bursty) of 12-row requests; it names
  itself in the ``X-Batchpilot-Tenant`` header.
* ``chat`` is a steady trickle (Poisson, ``CHAT_RATE``/s) of 1-row requests; it names itself in
  ``parameters.tenant``.

The policy carries ``batchpilot.dev/environment: staging``: the harness labels the targets as
the PodMonitor would, and every analysis query filters by it (without the label reaching
Prometheus the canaries below would be Inconclusive, never rolled back).

(a) ``maxBatchSize`` 12 -> 8: every bulk request is a 400 on the canary. Latency, queue age and
    error rate only see served requests (chat's, all fast), so the analysis of issue 9 would
    find nothing against it; the 4xx share against the stable's fails it, tenant named.
(b) ``maxQueueDelay`` 2ms -> 150ms with ``maxBatchSize`` 12: a bulk request fills a batch on
    arrival and is dispatched at once, as before. A chat row arriving to an empty queue now
    waits for the window, unless a bulk request arrives first (1 + 12 rows reach the limit;
    the chat row goes out alone, the bulk request does not fit beside it and follows). Between
    the trace's bursts that is often longer than the 100 ms queue-age objective (in the trace
    at this rate about 74% of chat's arrivals see no bulk arrival on their pod within 100 ms):
    most chat requests breach it, bulk ones do not, and chat is 0.83% of the requests, so the
    lane's total stays within its 1% budget while chat's slice fails. (The p99 latency SLO,
    300 ms, is not what breaches: a chat request waits at most the 150 ms window.)

Why so few chat requests: a slice that fails while the total passes must be a small share of
the requests (its bad share times its share of requests is at most the total's 1%), so its
requests per window are few (about 4 on the canary): minSamples 3 and a 30 s window keep it
judged in most windows (a window in which it is thin passes the step), and the 180 s step pause
gives the verdict six analyses to find the two failures failureLimit asks for before the canary
could be promoted (one is not enough: the canary's first window on a busy machine can breach on
the total, the new process starting under load). The bulk rate is
bounded by the machine: each bulk request is a batch of its own, and the trace's bursts reach
15x its mean rate; the 100 ms queue-age objective leaves room for the queueing those bursts
cause on a busy machine, on both tracks alike.
"""

from __future__ import annotations

import copy
import json
import random
import struct
import sys
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from batchpilot_localdev.harness import RuntimeHarness
from batchpilot_localdev.load import ROW, TraceReplay
from batchpilot_localdev.prometheus import PrometheusServer
from batchpilot_operator.analysis import Outcome, run_analysis
from batchpilot_operator.prom import PrometheusBackend
from batchpilot_operator.spec import parse_spec
from batchpilot_operator.tune.trace import load_trace
from bptest import (
    REPO,
    TINY_MODEL,
    Kube,
    LedgerSeen,
    OperatorProcess,
    Plugin,
    PolicyScenario,
    policy,
    start_operator,
)

pytestmark = [pytest.mark.cluster, pytest.mark.prometheus, pytest.mark.slow]

TRACE = REPO.parent / "shared" / "traces" / "azure-llm-2023-code.csv"
RATE = 30.0  # bulk requests/s over the policy (12 rows each, binary tensors): one batch each
CHAT_RATE = 0.25  # chat requests/s over the policy (1 row each, JSON): 0.83% of the requests
BULK_ROWS = 12

POLICY: dict[str, Any] = policy(
    "mall",
    model=dict(TINY_MODEL),
    lanes=[
        {
            "name": "interactive",
            "maxBatchSize": 12,
            "maxQueueDelay": "2ms",
            "maxQueueLength": 512,
            "requestTimeout": "1s",
        }
    ],
    slo={"p99Latency": "300ms", "maxQueueAge": "100ms"},
    tenants={"names": ["bulk", "chat"]},
    rollout={
        "steps": [{"weight": 50, "pause": "180s"}],
        "analysisInterval": "30s",
        "failureLimit": 2,
        "minSamples": 3,
        "maxInconclusive": 20,
        "onMetricsUnavailable": {"action": "Hold"},
    },
)
POLICY["metadata"]["labels"] = {"batchpilot.dev/environment": "staging"}


def changed(**lane: Any) -> dict[str, Any]:
    policy = copy.deepcopy(POLICY)
    policy["spec"]["lanes"][0].update(lane)
    return policy


def ts(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def poisson(rate: float, seconds: float, seed: int) -> list[float]:
    rng, t, out = random.Random(seed), 0.0, []
    while t < seconds:
        t += rng.expovariate(rate)
        out.append(t)
    return out


class Scenario(PolicyScenario):
    policy_name = "mall"

    def __init__(self, kube: Kube, namespace: str, prom: PrometheusServer, op: OperatorProcess, h: RuntimeHarness):
        self.kube, self.namespace, self.prom, self.op, self.harness = kube, namespace, prom, op, h
        self.ledger = LedgerSeen()
        """Every ledger entry the polls below saw: a canary's analyses over its whole life (status
        keeps the newest only; one analysis every 30 s adds at most a dozen)."""

    status_tail = 6000

    def diagnostics(self) -> str:
        return f"harness errors: {self.harness.errors}"

    def roll(self, policy: dict[str, Any], stable: str) -> tuple[str, dict[str, Any]]:
        """Apply a change and wait for its canary to be rolled back; (its revision, the status)."""
        self.apply(policy)
        rev = self.wait(lambda st: st.get("canaryRevision") not in (None, stable), 60, "the canary")["canaryRevision"]
        done = self.wait(
            lambda st: any(h["revision"] == rev for h in st.get("history", [])), 240, f"canary {rev} decided"
        )
        outcome = next(h for h in done["history"] if h["revision"] == rev)
        assert outcome["outcome"] == "RolledBack", (outcome, json.dumps(done["ledger"], indent=1)[-5000:])
        assert done["stableRevision"] == stable, "stable untouched by the rollback"
        return rev, done


@pytest.fixture
def scenario(kube: Kube, namespace: str, prometheus: PrometheusServer, tmp_path: Path) -> Iterator[Scenario]:
    trace = load_trace(TRACE)  # first: a missing trace fails the set-up before anything is started
    harness = RuntimeHarness(kube.kubeconfig, namespace, tmp_path / "runtime", prometheus).start()
    op = start_operator(kube, namespace, tmp_path, prometheus_url=prometheus.url, resync=1.0)
    # The bulk client sends binary tensors (the extension's raw little-endian bytes after a JSON
    # header) and asks for a binary output: 12 rows without 40 KB of JSON to write and parse.
    tensor = struct.pack(f"<{BULK_ROWS * 512}f", *(ROW * BULK_ROWS))
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "input",
                    "shape": [BULK_ROWS, 512],
                    "datatype": "FP32",
                    "parameters": {"binary_data_size": len(tensor)},
                }
            ],
            "parameters": {"binary_data_output": True},
        }
    ).encode()
    bulk_headers = {"X-Batchpilot-Tenant": "bulk", "Inference-Header-Content-Length": str(len(header))}
    chat_body = {
        "inputs": [{"name": "input", "shape": [1, 512], "datatype": "FP32", "data": ROW}],
        "parameters": {"tenant": "chat"},
    }
    endpoints = lambda: harness.endpoints("mall")  # noqa: E731
    bulk = TraceReplay(
        trace.scaled_arrivals(RATE),
        endpoints,
        model="tiny",
        headers=bulk_headers | {"Content-Type": "application/octet-stream"},
        raw=header + tensor,
    )
    chat = TraceReplay(poisson(CHAT_RATE, 3600, seed=5), endpoints, model="tiny", body=chat_body, seed=2)
    bulk.start(), chat.start()
    s = Scenario(kube, namespace, prometheus, op, harness)
    try:
        yield s
    finally:
        bulk.stop(), chat.stop()
        op.stop()
        harness.stop()
        for name, replay in (("bulk", bulk), ("chat", chat)):
            stats = {k: (v.sent, v.ok, v.errors) for k, v in replay.stats.items()}
            sys.stderr.write(f"\n[e2e] {name} replay stats: {stats}\n")


def test_canary_breaking_one_tenant_is_rolled_back_on_its_slice(scenario: Scenario) -> None:
    s = scenario
    stable = s.first_revision(POLICY)
    s.harness.wait_ready("mall", 2)
    # The environment reaches Prometheus as a target label, the tenant as the runtime's label.
    s.prom.wait_for(
        'sum by (tenant) (batchpilot_requests_total{environment="staging",policy="mall",tenant=~"bulk|chat"})',
        lambda r: len(r) == 2,
        timeout=60,
    )
    figures: dict[str, Any] = {"bulk_rate": RATE, "chat_rate": CHAT_RATE}

    # (a) maxBatchSize below the bulk tenant's 12 rows: its requests are rejected by the canary.
    rejecting, rolled = s.roll(changed(maxBatchSize=8), stable)
    failed = s.ledger.entries(revision=rejecting, outcome="Failed")
    by_bulk = [e for e in failed if e.get("tenant") == "bulk" and e["metric"] == "clientErrors"]
    assert by_bulk, json.dumps(failed, indent=1)
    for e in by_bulk:
        assert e["evidence"].startswith("lane interactive tenant bulk: rejected 100% (400) of "), e
        assert " vs stable 0% of " in e["evidence"] and e["badFraction"] == 1.0 and e["stableBadFraction"] == 0.0, e
        assert e["confidenceWorse"] >= 0.95, e
    history = next(h for h in rolled["history"] if h["revision"] == rejecting)
    assert history["reason"] == "AnalysisFailed" and "tenant bulk: rejected 100% (400)" in history["evidence"]
    # What the verdict of issue 9 had to go on: the same lane's latency, queue age and errors
    # (the served requests, all chat's), which never failed. Judged again on the same data, at
    # the first failed analysis, by the analysis without tenants and without the 4xx share:
    at = min(ts(e["time"]) for e in by_bulk)
    no_tenants = copy.deepcopy(POLICY["spec"])
    del no_tenants["tenants"]
    backend = PrometheusBackend(s.prom.url)
    t0 = time.perf_counter()
    old = run_analysis(
        backend,
        parse_spec(no_tenants),
        policy="mall",
        namespace=s.namespace,
        canary_revision=rejecting,
        stable_revision=stable,
        now=datetime.fromtimestamp(at).astimezone(),
    )
    t1 = time.perf_counter()
    run_analysis(  # the same with tenants: how long the slices' queries take (a figure, not a check)
        backend,
        parse_spec(POLICY["spec"]),
        policy="mall",
        namespace=s.namespace,
        canary_revision=rejecting,
        stable_revision=stable,
        now=datetime.fromtimestamp(at).astimezone(),
        environment="staging",
    )
    figures["analysis_seconds"] = {
        "lane_total_only": round(t1 - t0, 2),
        "with_4_tenant_slices": round(time.perf_counter() - t1, 2),
    }
    backend.close()
    (old_lane,) = old.lanes
    old_checks = [c for c in old_lane.canary if c.metric != "clientErrors"]
    assert not any(c.outcome is Outcome.FAILED for c in old_checks), [c.describe() for c in old_checks]
    figures["rejecting"] = {
        "failed_analyses": len({e["time"] for e in failed}),
        "evidence": by_bulk[-1]["evidence"],
        "old_analysis": {c.metric: c.outcome.value for c in old_checks},
        "old_analysis_evidence": [c.describe() for c in old_checks],
    }
    view = Plugin(s.kube, s.namespace).json("status", "mall")
    (lane,) = view["lanes"]
    bulk_row = next(t for t in lane["tenants"] if t["tenant"] == "bulk")
    assert bulk_row["outcome"] == "Failed" and bulk_row["rejected"] == 1.0 and bulk_row["stableRejected"] == 0.0
    assert "tenant bulk: rejected 100% (400)" in bulk_row["evidence"]
    s.kube.wait_for(lambda: s.kube.get("deployment", "mall-canary", s.namespace) is None, 60, "canary removed")

    # (b) a 150 ms window: chat's rows wait for it between bulk bursts, bulk's fill batches alone.
    slow, rolled = s.roll(changed(maxQueueDelay="150ms"), stable)
    entries = s.ledger.entries(revision=slow, kind="Analysis")
    sys.stderr.write("\n[e2e] slow window analyses:\n" + "\n".join(f"{e['time']} {e['evidence']}" for e in entries))
    chat_failed = [e for e in entries if e.get("tenant") == "chat" and e["outcome"] == "Failed"]
    assert chat_failed and {e["metric"] for e in chat_failed} <= {"p99Latency", "queueAge"}, entries

    # The lane's total (entries without a tenant) did not fail the canary while chat's slice did:
    # in at least one analysis that failed chat, no check of the total failed, so the slice is
    # what caught it. Whether the total then *passed* is the machine's business, not the
    # product's: on a busy machine the canary's bulk tail can go over its budget in the trace's
    # bursts without being clearly worse than the stable's (Inconclusive: a cold CI run saw
    # 1.79% of 1,784 bulk-dominated requests over the p99 SLO on the canary against 0.57% on
    # the stable, 92% confidence, in the only analyses that failed chat). (In a worse burst the
    # total may fail too: the rollback's evidence still names chat, asserted below.)
    def totals_at(t: str) -> list[dict[str, Any]]:
        return [e for e in entries if e["time"] == t and e.get("tenant") is None]

    def passed(e: dict[str, Any]) -> bool:
        return e["outcome"] != "Failed"

    times = sorted({e["time"] for e in chat_failed})
    total_ok = [t for t in times if all(passed(e) for e in totals_at(t))]
    assert total_ok, json.dumps(entries, indent=1)
    totals = totals_at(total_ok[-1])
    assert [e["metric"] for e in totals] == ["p99Latency", "queueAge", "errorRate", "clientErrors"], totals
    for e in chat_failed:
        assert e["evidence"].startswith("lane interactive tenant chat p99 "), e
        # Worse than the stable's same slice decides; over the budget only while the stable's
        # slice has too few requests to compare with (as for a lane's total).
        if "confidenceWorse" in e:
            assert e["confidenceWorse"] >= 0.95 and e["stableBadFraction"] < e["badFraction"], e
        else:
            assert e["confidenceOverBudget"] >= 0.95 and "over its 1% budget with" in e["evidence"], e
    history = next(h for h in rolled["history"] if h["revision"] == slow)
    assert "tenant chat" in history["evidence"], history
    figures["slow_window"] = {
        "chat_failed": [(e["metric"], e["badFraction"], e.get("stableBadFraction")) for e in chat_failed],
        "total_when_chat_failed": [(e["metric"], e["outcome"], e.get("badFraction")) for e in totals],
    }
    plugin = Plugin(s.kube, s.namespace)
    table = plugin.run("status", "mall").stdout
    assert "Tenant slices" in table and "chat" in table
    sys.stderr.write("\n[kubectl batchpilot status, a tenant's slice]\n" + table)
    # Each rollback is an Event on the policy naming the tenant.
    events = json.loads(
        s.kube.kubectl(
            "get", "events", "-n", s.namespace, "--field-selector", "involvedObject.name=mall", "-o", "json"
        ).stdout
    )["items"]
    failed_msgs = [e["message"] for e in events if e["reason"] == "AnalysisFailed"]
    assert any("tenant bulk" in m for m in failed_msgs) and any("tenant chat" in m for m in failed_msgs), failed_msgs
    sys.stderr.write(f"\n[e2e] {json.dumps(figures, indent=1)}\n")
