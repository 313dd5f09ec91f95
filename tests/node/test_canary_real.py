"""The canary, end to end on the real node: a real Prometheus finds the runtime pods through
Kubernetes service discovery (the PodMonitor's relabelings, ``batchpilot_localdev/prometheus.py``) and
scrapes them at their pod IPs, while the real arrival trace is replayed against the ready pods
(what the Service would route to). A sensible window change is promoted through its step; a
window that breaks the SLO is rolled back on the metrics the canary's containers exported."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from batchpilot_localdev.cluster import ADMIN_TOKEN, LocalCluster
from batchpilot_localdev.load import TraceReplay
from batchpilot_localdev.prometheus import KubernetesSD, PrometheusServer, start_prometheus
from batchpilot_localdev.realnode import PodEndpoints, RealNode
from batchpilot_operator.tune.trace import load_trace
from bpnode import pod_ip, pods, ready_pods, real_policy
from bptest import REPO, Kube, LedgerSeen, OperatorProcess, PolicyScenario, start_operator

pytestmark = [pytest.mark.cluster, pytest.mark.realnode, pytest.mark.prometheus, pytest.mark.slow]

TRACE = REPO.parent / "shared" / "traces" / "azure-llm-2023-code.csv"
RATE = 40.0  # requests/s over the whole policy, as tests/operator/test_canary_e2e.py


def with_window(window: str, max_batch_size: int | None = None) -> dict[str, Any]:
    policy = real_policy()
    lane = policy["spec"]["lanes"][0]
    lane["maxQueueDelay"] = window
    if max_batch_size is not None:
        lane["maxBatchSize"] = max_batch_size
    return policy


@dataclass
class Scenario(PolicyScenario):
    kube: Kube
    namespace: str
    prom: PrometheusServer
    op: OperatorProcess
    replay: TraceReplay
    ledger: LedgerSeen

    def diagnostics(self) -> str:
        return f"prometheus:\n{self.prom.log_tail()}"


@pytest.fixture
def scenario(
    kube: Kube, real_node: tuple[LocalCluster, RealNode], namespace: str, tmp_path: Path
) -> Iterator[Scenario]:
    cluster, _ = real_node
    arrivals = load_trace(TRACE).scaled_arrivals(RATE)  # first: a missing trace starts nothing
    sd = KubernetesSD(cluster.server, cluster.workdir / "pki" / "ca.crt", ADMIN_TOKEN, (namespace,))
    prom = start_prometheus(tmp_path, kubernetes_sd=sd)
    op = start_operator(kube, namespace, tmp_path, prometheus_url=prom.url, resync=1.0)
    endpoints = PodEndpoints(cluster.kubeconfig, namespace, "shop").start()
    replay = TraceReplay(arrivals, endpoints, model="tiny").start()
    try:
        yield Scenario(kube, namespace, prom, op, replay, LedgerSeen())
    finally:
        replay.stop()
        endpoints.stop()
        op.stop()
        prom.stop()
        sys.stderr.write(
            f"\n[realnode e2e] replay: { {k: (v.sent, v.ok, v.errors) for k, v in replay.stats.items()} }\n"
        )


def test_good_change_promoted_bad_one_rolled_back_on_metrics_scraped_from_the_pods(scenario: Scenario) -> None:
    s = scenario
    first = s.first_revision(real_policy(), 180)
    stable = s.kube.wait_for(lambda: ready_pods(s.kube, s.namespace, "shop", "stable", 2), 120, "2 ready pods")
    # Prometheus found the pods in the cluster and scrapes them at their addresses on the bridge,
    # labelled by the PodMonitor's relabelings.
    up = s.prom.wait_for(f'up{{job="batchpilot",namespace="{s.namespace}"}} == 1', lambda r: len(r) >= 2, 60)
    assert {r["metric"]["instance"] for r in up} >= {f"{pod_ip(p)}:8000" for p in stable}
    assert {r["metric"]["pod"] for r in up} >= {p["metadata"]["name"] for p in stable}
    assert {(r["metric"]["policy"], r["metric"]["revision"], r["metric"]["track"]) for r in up} == {
        ("shop", first, "stable")
    }

    # (a) a sensible window: canary at 50%, analysed on the pods' metrics, promoted.
    canary = s.begin_canary(with_window("4ms"), first, weight_timeout=180)
    done = s.promoted(canary, 240)
    assert done["history"][-1]["outcome"] == "Promoted"
    assert s.ledger.entries(revision=canary, outcome="Successful")
    served = s.prom.query(
        f'sum by (track) (batchpilot_requests_total{{namespace="{s.namespace}",revision="{canary}",code="200"}})'
    )
    assert served and float(served[0]["value"][1]) > 0, served

    # (b) a window that breaks the SLO (64-row batches that never fill, 110 ms windows under a
    # 120 ms p99 and a 60 ms queue-age objective): rolled back, the stable untouched.
    s.apply(with_window("110ms", max_batch_size=64))
    bad = s.wait(lambda st: st.get("canaryRevision") not in (None, canary), 60, "the bad canary")["canaryRevision"]
    rolled = s.wait(lambda st: st.get("phase") == "RolledBack", 240, "automatic rollback")
    assert rolled["stableRevision"] == canary and not rolled.get("canaryRevision")
    failed = s.ledger.entries(revision=bad, outcome="Failed")
    assert failed, rolled["ledger"]
    assert all(e["value"] > e["threshold"] for e in failed)
    assert {e["metric"] for e in failed} <= {"p99Latency", "queueAge"}
    # The breaching values came from the canary's containers, scraped by Prometheus (over the
    # last minutes: the pods are gone, so their series went stale).
    bad_series = s.prom.query(
        f'last_over_time(batchpilot_queue_age_seconds_count{{namespace="{s.namespace}",revision="{bad}",track="canary"}}[10m])'
    )
    assert bad_series and all(r["metric"]["instance"].startswith("198.18.0.") for r in bad_series), bad_series
    s.kube.wait_for(lambda: not pods(s.kube, s.namespace, "shop", "canary"), 60, "the canary's pods gone")
    # The stable Deployment back at both replicas (one was the canary's share).
    s.kube.wait_for(lambda: ready_pods(s.kube, s.namespace, "shop", "stable", 2), 120, "2 ready stable pods")
    stats = s.replay.stats
    stable_stats = stats.get((canary, "stable"))
    assert stable_stats is not None and stable_stats.ok > 0
