"""The main job on one machine (`make demo` / `batchpilot demo`).

Brings up the real local control plane, a real Prometheus, the operator and the runtime
harness (one runtime server process per pod), the local Gateway API data plane (Contour and
Envoy, ``localdev/gateway.py``) with the policy's HTTPRoute, applies the demo policy (its canary
weights set on that route), replays the real arrival trace through Envoy, then applies two changes the way a GitOps pipeline would
(server-side apply under Argo CD's field manager): a good one, promoted through every step,
and a bad one, rolled back by the operator. It prints progress as it goes, ends with
``kubectl batchpilot status``, ``history`` and ``recommend``, and writes a report (PNG plot of p99 latency
and queue age per revision over time with the rollout events marked, plus the ledger).
Everything runs under one work directory that is wiped at the start: safe to re-run.

With ``--real-node`` the pods run under a real kubelet and containerd (``localdev/realnode.py``)
instead of kwok and the harness: the runtime image of ``make images``, readiness probes gating
the Service's endpoints (``realnode.PodEndpoints``, which Envoy's track proxy follows), Prometheus
finding the pods by Kubernetes service discovery, the namespace enforcing the restricted Pod
Security Standard, and each pod asking for :data:`REAL_NODE_RESOURCES`.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml
from rich.console import Console

from batchpilot_localdev import free_port
from batchpilot_localdev.cluster import REPO_ROOT, LocalCluster
from batchpilot_localdev.gateway import LocalGateway, httproute
from batchpilot_localdev.harness import RuntimeHarness
from batchpilot_localdev.load import Endpoint, TraceReplay
from batchpilot_localdev.modelcheck import OutcomeCollector, window_rows, window_table
from batchpilot_localdev.prometheus import PrometheusServer
from batchpilot_operator.spec import parse_spec
from batchpilot_operator.tune.trace import load_trace

if TYPE_CHECKING:  # started only with --real-node, imported there
    from batchpilot_localdev.realnode import PodEndpoints, RealNode

DEMO_DIR = REPO_ROOT / "manifests" / "demo"
CHANGES = [
    ("initial policy", DEMO_DIR / "1-initial.yaml"),
    ("good change: window 2ms -> 5ms, batch 8 -> 16", DEMO_DIR / "2-good-change.yaml"),
    ("bad change: batch 64, window 110ms under a 120ms p99 SLO", DEMO_DIR / "3-bad-change.yaml"),
]
POLICY, NAMESPACE, MODEL = "demo-embedder", "demo", "mlp"
TENANTS = [("web", 0.75), ("mobile", 0.25)]
"""The demo policy's spec.tenants and each one's share of the replayed requests."""
REAL_NODE_RESOURCES = {"cpu": "200m", "memory": "1536Mi"}
"""Each pod's requests on the real node (the memory is its limit too)."""
REAL_NODE_GPUS = 9
"""``nvidia.com/gpu`` the real node advertises: the demo's 4 stable pods, a canary of up to 4 (a
step of the gateway keeps the stable whole), and the one pod the stable surges by when it rolls
to a promoted revision while the canary still serves. With 8 that pod stayed Pending and the
promotion never finished."""
DEFAULT_TRACE = REPO_ROOT.parent / "shared" / "traces" / "azure-llm-2023-code.csv"


class Demo:
    def __init__(self, workdir: Path, rate: float, trace: Path, console: Console, real_node: bool = False) -> None:
        self.workdir, self.rate, self.trace, self.console = workdir, rate, trace, console
        self.real_node = real_node
        """Run the pods on a real node (kubelet + containerd, ``localdev/realnode.py``) instead
        of kwok and the runtime harness."""
        self.started = time.time()
        self.cluster: LocalCluster | None = None
        self.prom: PrometheusServer | None = None
        self.harness: RuntimeHarness | None = None
        self.node: RealNode | None = None
        """The real node (``realnode.RealNode``) with ``real_node``."""
        self.pods: PodEndpoints | None = None
        """The real node's ready pods as the policy's Service lists them (``realnode.PodEndpoints``)."""
        self.operator: subprocess.Popen[bytes] | None = None
        self.replay: TraceReplay | None = None
        self.gateway: LocalGateway | None = None
        self.collector: OutcomeCollector | None = None
        self.analyses: dict[tuple[Any, ...], dict[str, Any]] = {}
        """Every analysis seen in a status read (the status keeps only the newest)."""

    # ---- set-up and tear-down -------------------------------------------------------------
    @contextlib.contextmanager
    def running(self) -> Iterator[Demo]:
        try:
            self._start()
            yield self
        finally:
            self._stop()

    def say(self, text: str) -> None:
        self.console.print(f"[dim]{time.strftime('%H:%M:%S')}[/] {text}")

    def _start(self) -> None:
        if self.real_node:
            self._start_real_node()
        else:
            self.say(
                "[bold]starting the local control plane[/] (etcd, kube-apiserver, controller-manager, scheduler, kwok)"
            )
            self.cluster = LocalCluster.start(self.workdir / "cluster", gpu_nodes=2)
            self.say(f"control plane up in {self.cluster.started_in:.1f}s; kubeconfig: {self.cluster.kubeconfig}")
            self.kubectl("apply", "-f", str(REPO_ROOT / "crds" / "batchingpolicy.yaml"))
            self.cluster.wait_established("batchingpolicies.batchpilot.dev")
            self.kubectl("create", "namespace", NAMESPACE)
            self.prom = PrometheusServer(self.workdir / "prometheus", scrape_interval="1s")
            self.prom.start()
            self.say(f"Prometheus up at {self.prom.url}")
            self.harness = RuntimeHarness(
                self.cluster.kubeconfig, NAMESPACE, self.workdir / "runtime", self.prom
            ).start()
        assert self.cluster is not None and self.prom is not None
        self.gateway = LocalGateway(
            self.cluster.kubeconfig,
            str(self.cluster.bin_dir / "kubectl"),
            self.workdir / "gateway",
            NAMESPACE,
            lambda _policy: self.endpoints(),
        ).start()
        self.gateway.add_policy(POLICY)
        ports = {t: self.gateway.proxy.ports[(POLICY, t)] for t in ("stable", "canary")}
        route = httproute(POLICY, NAMESPACE, self.gateway.gateway, POLICY, ports)
        self.kubectl_input(json.dumps(route), "apply", "--server-side", "--field-manager=argocd-controller", "-f", "-")
        self.say(f"Contour + Envoy serving the Gateway at {self.gateway.url} (HTTPRoute {POLICY})")
        self.operator = start_operator(self.cluster.kubeconfig, self.prom.url, self.workdir / "operator.log", NAMESPACE)
        self.say(f"operator running (log: {self.workdir / 'operator.log'})")

    def _start_real_node(self) -> None:
        """The control plane with no kwok node and the real node beside it: the operator's pods
        run the runtime image under a kubelet and containerd, in a namespace that enforces the
        restricted Pod Security Standard; Prometheus finds them by Kubernetes service discovery
        and requests reach them at their addresses on the node's bridge (as ``batchpilot up
        --real-node``)."""
        from batchpilot_localdev.realnode import PodEndpoints, prepare_namespace, start_beside

        self.say("[bold]starting the local control plane[/] (etcd, kube-apiserver, controller-manager, scheduler)")
        self.cluster = LocalCluster.start(self.workdir / "cluster", gpu_nodes=0)
        self.say(f"control plane up in {self.cluster.started_in:.1f}s; kubeconfig: {self.cluster.kubeconfig}")
        self.say("[bold]starting the real node[/] (kubelet + containerd; builds and imports the images when stale)")
        self.node = start_beside(self.cluster, self.workdir / "node", gpus=REAL_NODE_GPUS)
        self.say(f"node {self.node.name} Ready in {self.node.started_in:.1f}s ({REAL_NODE_GPUS} nvidia.com/gpu)")
        self.prom = prepare_namespace(self.cluster, NAMESPACE, self.workdir / "prometheus")
        self.say(f"Prometheus up at {self.prom.url} (Kubernetes service discovery)")
        self.pods = PodEndpoints(self.cluster.kubeconfig, NAMESPACE, POLICY).start()

    def _stop(self) -> None:
        if self.collector:
            self.collector.stop()
        if self.replay:
            self.replay.stop()
        if self.operator and self.operator.poll() is None:
            self.operator.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.operator.wait(timeout=15)
        if self.gateway:
            self.gateway.stop()
        if self.harness:
            self.harness.stop()
        if self.pods is not None:
            self.pods.stop()
        if self.prom:
            self.prom.stop()
        if self.node is not None:
            problems = self.node.stop()
            if problems:
                self.say(f"[yellow]real node clean-up left[/]: {problems}")
        if self.cluster:
            self.cluster.stop()

    def endpoints(self) -> Sequence[Endpoint]:
        """The policy's ready pods: the harness's runtime processes, or the real node's pods
        whose readiness probe passed."""
        if self.pods is not None:
            pods: Sequence[Endpoint] = self.pods()
            return pods
        return self.harness.endpoints(POLICY) if self.harness is not None else []

    def wait_ready(self, count: int, timeout: float) -> None:
        if self.harness is not None:
            self.harness.wait_ready(POLICY, count, timeout=timeout)
            return
        deadline = time.monotonic() + timeout
        while len(self.endpoints()) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{count} ready pods of {POLICY} not within {timeout:.0f}s")
            time.sleep(0.5)

    # ---- helpers -----------------------------------------------------------------------------
    def kubectl(self, *args: str, check: bool = True) -> str:
        assert self.cluster is not None
        return self.cluster.kubectl(*args, check=check)

    def kubectl_input(self, text: str, *args: str) -> None:
        assert self.cluster is not None
        subprocess.run(
            [str(self.cluster.bin_dir / "kubectl"), f"--kubeconfig={self.cluster.kubeconfig}", *args],
            input=text.encode(),
            check=True,
            capture_output=True,
        )

    def status(self) -> dict[str, Any]:
        out = self.kubectl("get", "batchingpolicy", POLICY, "-n", NAMESPACE, "-o", "json", check=False)
        if not out:
            return {}
        status: dict[str, Any] = json.loads(out).get("status") or {}
        for entry in status.get("ledger") or []:
            if entry.get("kind") == "Analysis":
                key = tuple(entry.get(k) for k in ("time", "metric", "track", "lane", "tenant", "revision"))
                self.analyses[key] = entry
        return status

    def manifest(self, path: Path) -> dict[str, Any]:
        """The policy in ``path`` as the demo applies it: as Git holds it, except that on the real
        node every pod asks for :data:`REAL_NODE_RESOURCES` (the node's 2 cores and the machine's
        memory hold the demo's 9 pods at that size, not at the 1 CPU and 4Gi the policy's defaults give)."""
        doc: dict[str, Any] = yaml.safe_load(path.read_text())
        if self.real_node:
            doc["spec"]["resources"] = {**doc["spec"].get("resources", {}), **REAL_NODE_RESOURCES}
        return doc

    def gitops_apply(self, path: Path) -> None:
        """What Argo CD does on sync: server-side apply under its own field manager."""
        self.kubectl_input(
            json.dumps(self.manifest(path)), "apply", "--server-side", "--field-manager=argocd-controller", "-f", "-"
        )

    def wait(self, done: Callable[[dict[str, Any]], bool], timeout: float, what: str) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        last_line = ""
        while time.monotonic() < deadline:
            if self.operator is not None and self.operator.poll() is not None:
                raise RuntimeError(f"the operator exited; see {self.workdir / 'operator.log'}")
            status = self.status()
            line = progress_line(status)
            if line != last_line:
                self.say(line)
                last_line = line
            if done(status):
                return status
            time.sleep(1.0)
        raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}; last status: {last_line}")

    # ---- the scenario --------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        label, path = CHANGES[0]
        self.say(f"[bold]git push[/] {label} ({path.name})")
        self.gitops_apply(path)
        first = self.wait(lambda s: s.get("phase") == "Healthy", 300, "the first revision")
        self.wait_ready(4, timeout=300)
        trace = load_trace(self.trace)
        self.say(
            f"replaying {trace.count} arrivals of {self.trace.name} (burstiness: gap CV {trace.gap_cv():.1f}) "
            f"time-scaled to {self.rate:.0f} req/s, open loop"
        )
        assert self.gateway is not None
        self.say(f"through the gateway: {self.gateway.url} (Envoy routes by the HTTPRoute's weights)")
        self.say(
            f"two clients share it: {', '.join(f'{t} {w:.0%}' for t, w in TENANTS)} of the requests (X-Batchpilot-Tenant)"
        )
        # The model's p99 against the pods' for every analysis window (the report's model.json).
        self.collector = OutcomeCollector(self.endpoints).start()
        front = [self.gateway.front()]
        self.replay = TraceReplay(trace.scaled_arrivals(self.rate), lambda: front, MODEL, tenants=TENANTS).start()
        time.sleep(5)  # a few seconds of steady traffic on the stable revision before changing it

        label, path = CHANGES[1]
        self.say(f"[bold]git push[/] {label} ({path.name})")
        self.gitops_apply(path)
        good = self.wait(
            lambda s: (
                (s.get("stableRevision") not in (None, first["stableRevision"]) and s.get("phase") == "Healthy")
                or s.get("phase") == "RolledBack"
            ),
            420,
            "the good change to be promoted",
        )
        if good.get("phase") == "RolledBack":
            # The operator judged what it measured: on a machine too busy for this load even
            # the good change can breach. Say so and go on; the report shows the evidence.
            self.say(f"[yellow]the good change was rolled back on this machine[/]: {good.get('message')}")
        else:
            self.say(f"[green]promoted[/] {good['stableRevision']}")

        label, path = CHANGES[2]
        self.say(f"[bold]git push[/] {label} ({path.name})")
        self.gitops_apply(path)
        bad_revision = parse_spec(self.manifest(path)["spec"]).revision()
        bad = self.wait(
            lambda s: s.get("phase") == "RolledBack" and s.get("desiredRevision") == bad_revision,
            420,
            "the bad change to be rolled back",
        )
        self.say(f"[red]rolled back[/] {bad.get('desiredRevision')}: {bad.get('message')}")
        time.sleep(5)  # show the stable revision serving on after the rollback
        return bad

    def plugin(self, *args: str) -> str:
        assert self.cluster is not None
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "batchpilot_operator.kubectl.main",
                *args,
                POLICY,
                "-n",
                NAMESPACE,
                f"--kubeconfig={self.cluster.kubeconfig}",
            ],
            capture_output=True,
            text=True,
            check=False,
            env={**os.environ, "COLUMNS": "140"},
        )
        return result.stdout + result.stderr


def start_operator(
    kubeconfig: Path, prometheus_url: str, log_path: Path, namespace: str | None = None
) -> subprocess.Popen[bytes]:
    """`batchpilot run` as a subprocess against a local cluster (all namespaces when none is given)."""
    with log_path.open("wb") as log:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "batchpilot_operator.cli",
                "run",
                f"--kubeconfig={kubeconfig}",
                *([f"--namespace={namespace}"] if namespace else []),
                f"--prometheus-url={prometheus_url}",
                f"--metrics-port={free_port()}",
                "--health-port=0",
                "--resync=1",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )


def progress_line(status: dict[str, Any]) -> str:
    if not status:
        return "waiting for the operator"
    parts = [f"phase={status.get('phase', '?')}", f"stable={status.get('stableRevision', '-')}"]
    if status.get("canaryRevision") and status.get("canaryRevision") == status.get("stableRevision"):
        parts.append("promoting: stable rolls to the canary's revision")
    elif status.get("canaryRevision"):
        step = (status.get("currentStepIndex") or 0) + 1
        parts += [
            f"canary={status['canaryRevision']}",
            f"step {step}/{status.get('stepCount', '?')}",
            f"weight={status.get('canaryWeight', 0)}%",
        ]
    last = status.get("lastAnalysis") or {}
    for lane in last.get("lanes", []):
        p99, slo = lane.get("p99Latency"), lane.get("p99LatencySlo")
        qa, qslo = lane.get("queueAge"), lane.get("maxQueueAge")
        if p99 is not None:
            parts.append(f"{lane['lane']}: p99 {p99 * 1e3:.1f}ms/{slo * 1e3:.0f}ms")
        if qa is not None:
            parts.append(f"queue age {qa * 1e3:.1f}ms/{qslo * 1e3:.0f}ms")
        err, eslo = lane.get("errorRate"), lane.get("maxErrorRate")
        if err is not None and eslo is not None:
            parts.append(f"errors {err * 100:.2g}%/{eslo * 100:.2g}%")
        parts.append(f"[{lane.get('outcome', '?')}]")
        detectable = lane.get("detectableP99Regression")
        if detectable is not None:
            parts.append(f"detects p99 +{detectable:.0%}")
        errors_seen = lane.get("detectableErrorRate")
        if errors_seen is not None:
            parts.append(f"errors >={errors_seen * 100:.2g}%")
    stalled = [c for c in status.get("conditions", []) if c.get("type") == "Stalled" and c.get("status") == "True"]
    if stalled:
        parts.append(f"Stalled: {stalled[0].get('reason')}")
    return "  ".join(parts)


@dataclass
class ReportData:
    """What the report shows, gathered from Prometheus and the final status (plotting is pure)."""

    start: float
    end: float
    panels: dict[str, list[dict[str, Any]]]
    """panel title -> Prometheus range-query series (``metric`` labels, ``values`` [[t, "v"], ...])."""
    slo: dict[str, float]
    """panel title -> SLO line, seconds (panels without one are absent)."""
    events: list[tuple[float, str, str]]
    """(seconds since start, ledger kind, revision), in time order."""
    summary: list[dict[str, Any]] = field(default_factory=list)
    """per revision and track: served req/s, mean batch rows, p99 latency and queue age over the run."""
    tenants: list[dict[str, Any]] = field(default_factory=list)
    """per revision, track and tenant: requests and p99 latency over the run (the slices the
    canary analysis judges)."""


LATENCY, QUEUE_AGE, THROUGHPUT, BATCH = "p99 latency", "p99 queue age", "throughput", "mean batch size"
PANEL_UNITS = {LATENCY: "ms", QUEUE_AGE: "ms", THROUGHPUT: "req/s", BATCH: "rows"}
EVENT_STYLE = {
    "CanaryStarted": ("orange", "canary"),
    "StepAdvanced": ("grey", "step"),
    "Promoted": ("green", "promoted"),
    "RolledBack": ("red", "rolled back"),
    "Aborted": ("red", "aborted"),
}
_REVISION = re.compile(r"\b([0-9a-f]{10})\b")


def _epoch(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def rollout_events(
    ledger: list[dict[str, Any]], k8s_events: list[dict[str, Any]], start: float
) -> list[tuple[float, str, str]]:
    """The rollout's events, (seconds since start, kind, revision) in time order.

    The ledger is bounded (its oldest entries give way to analyses on a long run), so the
    policy's Kubernetes Events (the operator posts one per decision, the message naming the
    revision first) fill in what it no longer holds; an event both have counts once.
    """
    events = [(_epoch(e["time"]) - start, e["kind"], e["revision"]) for e in ledger if e.get("kind") in EVENT_STYLE]
    for item in k8s_events:
        kind = item.get("reason")
        when = item.get("lastTimestamp") or item.get("eventTime") or item.get("firstTimestamp")
        found = _REVISION.search(item.get("message") or "")
        if kind not in EVENT_STYLE or not when or found is None:
            continue
        t = _epoch(when) - start
        if not any(k == kind and r == found.group(1) and abs(t - u) <= 3 for u, k, r in events):
            events.append((t, kind, found.group(1)))
    return sorted(events)


def _demo_slo() -> tuple[float, float]:
    """The p99 latency and queue age SLO of the demo policy's first lane (from its manifest)."""
    doc = yaml.safe_load(CHANGES[0][1].read_text())
    spec = parse_spec(doc["spec"])
    slo = spec.lane_slo(spec.lanes[0].name)
    return slo.p99_latency, slo.max_queue_age


def collect_report(demo: Demo, final_status: dict[str, Any]) -> ReportData:
    assert demo.prom is not None
    start, end = demo.started, time.time()
    sel = f'namespace="{NAMESPACE}",policy="{POLICY}"'
    by = "revision, track"
    queries = {
        LATENCY: f"histogram_quantile(0.99, sum by (le, {by}) (rate(batchpilot_request_latency_seconds_bucket{{{sel}}}[10s])))",
        QUEUE_AGE: f"histogram_quantile(0.99, sum by (le, {by}) (rate(batchpilot_queue_age_seconds_bucket{{{sel}}}[10s])))",
        THROUGHPUT: f'sum by ({by}) (rate(batchpilot_requests_total{{{sel},outcome="ok"}}[10s]))',
        BATCH: f"sum by ({by}) (rate(batchpilot_batch_size_rows_sum{{{sel}}}[10s])) "
        f"/ sum by ({by}) (rate(batchpilot_batch_size_rows_count{{{sel}}}[10s]))",
    }
    panels = {title: demo.prom.query_range(promql, start, end, step=2.0) for title, promql in queries.items()}
    window = f"{max(10, round(end - start))}s"
    run_p99 = {
        title: demo.prom.query(
            f"histogram_quantile(0.99, sum by (le, {by}) (increase({metric}_bucket{{{sel}}}[{window}])))"
        )
        for title, metric in (
            (LATENCY, "batchpilot_request_latency_seconds"),
            (QUEUE_AGE, "batchpilot_queue_age_seconds"),
        )
    }
    k8s_events: list[dict[str, Any]] = []
    if demo.cluster is not None:
        out = demo.kubectl(
            "get", "events", "-n", NAMESPACE, "--field-selector", f"involvedObject.name={POLICY}", "-o", "json",
            check=False,
        )  # fmt: skip
        with contextlib.suppress(ValueError):
            k8s_events = json.loads(out).get("items", []) if out else []
    events = rollout_events(final_status.get("ledger", []), k8s_events, start)
    p99, queue_age = _demo_slo()
    data = ReportData(start, end, panels, {LATENCY: p99, QUEUE_AGE: queue_age}, events)
    data.summary = summarize(data, run_p99)
    per_tenant = f"{by}, tenant"
    latency = "batchpilot_request_latency_seconds"
    data.tenants = tenant_rows(
        demo.prom.query(
            f"histogram_quantile(0.99, sum by (le, {per_tenant}) (increase({latency}_bucket{{{sel}}}[{window}])))"
        ),
        demo.prom.query(f"sum by ({per_tenant}) (increase({latency}_count{{{sel}}}[{window}]))"),
        [rev for _, _, rev in data.events],
    )
    return data


def tenant_rows(p99: list[dict[str, Any]], counts: list[dict[str, Any]], order: list[str]) -> list[dict[str, Any]]:
    """Per (revision, track, tenant): served requests and p99 latency over the run."""
    rows: dict[tuple[str, str, str], dict[str, Any]] = {}
    for samples, key in ((p99, "p99Latency"), (counts, "requests")):
        for sample in samples:
            labels = sample["metric"]
            rev, track = _key(labels)
            tenant = labels.get("tenant", "?")
            value = float(sample["value"][1])
            if math.isfinite(value):
                rows.setdefault((rev, track, tenant), {"revision": rev, "track": track, "tenant": tenant})[key] = value
    rank = {rev: i for i, rev in enumerate(order)}
    served = [r for r in rows.values() if r.get("requests") or r.get("p99Latency") is not None]  # not an idle "default"
    return sorted(served, key=lambda r: (rank.get(r["revision"], -1), r["revision"], r["track"], r["tenant"]))


def _points(series: dict[str, Any], start: float) -> list[tuple[float, float]]:
    out = []
    for t, v in series["values"]:
        value = float(v)
        if math.isfinite(value):
            out.append((float(t) - start, value))
    return out


def _key(labels: dict[str, str]) -> tuple[str, str]:
    return labels.get("revision", "?"), labels.get("track", "?")


def summarize(data: ReportData, run_p99: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per (revision, track): mean served rate and mean batch size while it served, p99s over the run."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}

    def row(labels: dict[str, str]) -> dict[str, Any]:
        rev, track = _key(labels)
        return rows.setdefault((rev, track), {"revision": rev, "track": track})

    for series in data.panels.get(THROUGHPUT, []):
        serving = [v for _, v in _points(series, data.start) if v > 0]
        if serving:
            row(series["metric"])["throughput"] = sum(serving) / len(serving)
    for series in data.panels.get(BATCH, []):
        sizes = [v for _, v in _points(series, data.start)]
        if sizes:
            row(series["metric"])["meanBatchRows"] = sum(sizes) / len(sizes)
    for title, key in ((LATENCY, "p99Latency"), (QUEUE_AGE, "p99QueueAge")):
        for sample in run_p99.get(title, []):
            value = float(sample["value"][1])
            if math.isfinite(value):
                row(sample["metric"])[key] = value
    order = {rev: i for i, (_, _, rev) in enumerate(data.events)}
    return sorted(rows.values(), key=lambda r: (order.get(r["revision"], -1), r["revision"], r["track"]))


def stack_labels(spans: list[tuple[float, float]], gap: float) -> list[int]:
    """Rows for labels occupying [start, end] (in time order) so that no two in a row overlap.

    Greedy interval packing: each label takes the lowest row whose last label ends ``gap``
    before it starts.
    """
    ends: list[float] = []
    rows = []
    for start, end in spans:
        for i, last in enumerate(ends):
            if last + gap <= start:
                ends[i] = end
                rows.append(i)
                break
        else:
            ends.append(end)
            rows.append(len(ends) - 1)
    return rows


# Figure geometry, fixed so that label widths can be laid out before drawing.
FIG_WIDTH_IN, LEFT, RIGHT = 13.0, 0.07, 0.985
LABEL_FONT_PT, ROW_IN = 7.0, 0.16


def draw_report(data: ReportData) -> tuple[Any, list[Any]]:
    """The report figure and its event label artists (pure: no I/O)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.font_manager import FontProperties
    from matplotlib.textpath import TextToPath

    duration = max(1.0, data.end - data.start)
    labels = [f"{EVENT_STYLE[kind][1]} {rev}" for _, kind, rev in data.events]
    prop = FontProperties(size=LABEL_FONT_PT)
    measure = TextToPath()
    axis_pt = FIG_WIDTH_IN * (RIGHT - LEFT) * 72
    spans, centers = [], []
    for (t, _, _), text in zip(data.events, labels, strict=True):
        width_pt = measure.get_text_width_height_descent(text, prop, ismath=False)[0]
        half = (width_pt + 4) * duration / axis_pt / 2  # 2pt padding each side
        center = min(max(t, half), duration - half)  # near an edge the label moves inward, not out
        centers.append(center)
        spans.append((center - half, center + half))
    order = sorted(range(len(spans)), key=lambda i: spans[i][0])
    packed = stack_labels([spans[i] for i in order], gap=0.0)
    rows = [0] * len(spans)
    for i, row in zip(order, packed, strict=True):
        rows[i] = row
    n_rows = max(rows, default=0) + 1
    strip_in = ROW_IN * n_rows + 0.12
    panel_in = [2.4, 1.8, 1.8, 1.8]
    height = strip_in + sum(panel_in) + 1.1
    fig = plt.figure(figsize=(FIG_WIDTH_IN, height))
    grid = fig.add_gridspec(
        5, 1, height_ratios=[strip_in, *panel_in], hspace=0.08, left=LEFT, right=RIGHT,
        top=1 - 0.45 / height, bottom=0.55 / height,
    )  # fmt: skip
    strip = fig.add_subplot(grid[0])
    axes = [fig.add_subplot(grid[i + 1], sharex=strip) for i in range(4)]
    strip.set_xlim(0, duration)
    strip.set_ylim(n_rows - 0.5, -0.5)
    strip.axis("off")

    colors: dict[str, Any] = {}
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for rev in [r for _, _, r in data.events] + [
        _key(s["metric"])[0] for series in data.panels.values() for s in series
    ]:
        colors.setdefault(rev, cycle[len(colors) % len(cycle)])
    for ax, title in zip(axes, (LATENCY, QUEUE_AGE, THROUGHPUT, BATCH), strict=True):
        scale = 1e3 if PANEL_UNITS[title] == "ms" else 1.0
        for series in sorted(data.panels.get(title, []), key=lambda s: _key(s["metric"])):
            points = _points(series, data.start)
            if not points:
                continue
            rev, track = _key(series["metric"])
            xs, ys = zip(*points, strict=True)
            ax.plot(
                xs, [y * scale for y in ys], color=colors[rev], ls="--" if track == "canary" else "-", lw=1.3,
                label=f"{rev} ({track})",
            )  # fmt: skip
        if title in data.slo:
            ax.axhline(data.slo[title] * scale, color="red", ls=":", lw=1.2, label="SLO")
        if PANEL_UNITS[title] == "ms":
            ax.set_yscale("log")
        ax.set_ylabel(f"{title} ({PANEL_UNITS[title]})", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", fontsize=7, ncol=3)
        for t, kind, _ in data.events:
            ax.axvline(t, color=EVENT_STYLE[kind][0], lw=0.9, alpha=0.6)
    for ax in axes[:-1]:
        ax.tick_params(labelbottom=False)
    axes[-1].set_xlabel("seconds since the demo started")
    artists = []
    for (t, kind, _), text, row, center in zip(data.events, labels, rows, centers, strict=True):
        color = EVENT_STYLE[kind][0]
        strip.plot([t, t], [row, n_rows - 0.5], color=color, lw=0.6, alpha=0.5)
        artists.append(
            strip.text(center, row, text, ha="center", va="center", fontsize=LABEL_FONT_PT, color=color,
                       bbox={"boxstyle": "square,pad=0.1", "fc": "white", "ec": "none"})
        )  # fmt: skip
    fig.suptitle(
        f"batchpilot demo: {POLICY}: p99, throughput and batch size per revision (dashed: canary), "
        "with the rollout's events",
        fontsize=11,
    )
    return fig, artists


def summary_table(rows: list[dict[str, Any]]) -> str:
    """The per-revision story in a few lines of text (the console and report/summary.txt)."""

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1e3:.1f}ms"

    lines = [
        f"{'revision':<12}{'track':<8}{'served req/s':>13}{'mean batch':>12}{'p99 latency':>13}{'p99 queue age':>15}"
    ]
    for r in rows:
        lines.append(
            f"{r['revision']:<12}{r['track']:<8}"
            f"{r.get('throughput', 0.0):>13.1f}{r.get('meanBatchRows', 0.0):>12.2f}"
            f"{ms(r.get('p99Latency')):>13}{ms(r.get('p99QueueAge')):>15}"
        )
    return "\n".join(lines)


def tenant_table(rows: list[dict[str, Any]]) -> str:
    """Per-tenant p99 per revision and track (what each client felt; the canary is judged per tenant)."""
    lines = [f"{'revision':<12}{'track':<8}{'tenant':<10}{'requests':>10}{'p99 latency':>13}"]
    for r in rows:
        p99 = r.get("p99Latency")
        lines.append(
            f"{r['revision']:<12}{r['track']:<8}{r['tenant']:<10}{r.get('requests', 0.0):>10.0f}"
            f"{'-' if p99 is None else f'{p99 * 1e3:.1f}ms':>13}"
        )
    return "\n".join(lines)


def write_report(demo: Demo, final_status: dict[str, Any], out: Path) -> Path:
    """PNG plot per revision/track over time (p99 latency and queue age against the SLO,
    throughput, mean batch size) with the rollout's events labelled, plus the ledger and a
    per-revision summary."""
    data = collect_report(demo, final_status)
    out.mkdir(parents=True, exist_ok=True)
    fig, _ = draw_report(data)
    png = out / "report.png"
    fig.savefig(png, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    (out / "ledger.json").write_text(json.dumps(final_status.get("ledger", []), indent=2))
    (out / "history.json").write_text(json.dumps(final_status.get("history", []), indent=2))
    (out / "series.json").write_text(json.dumps(data.panels))
    (out / "summary.json").write_text(json.dumps(data.summary, indent=2))
    (out / "tenants.json").write_text(json.dumps(data.tenants, indent=2))
    model_rows: list[dict[str, Any]] = []
    if demo.collector is not None:
        demo.collector.poll()
        ledger = sorted(demo.analyses.values(), key=lambda e: str(e.get("time")))
        model_rows = window_rows(demo.collector, ledger, data.start)
    (out / "model.json").write_text(json.dumps(model_rows, indent=2, default=str))
    (out / "summary.txt").write_text(
        summary_table(data.summary)
        + "\n\nper tenant:\n"
        + tenant_table(data.tenants)
        + "\n\nlatency model, predicted vs observed p99 per analysis window:\n"
        + window_table(model_rows)
        + "\n"
    )
    return png


def run_demo(workdir: Path, rate: float, trace: Path, real_node: bool = False) -> int:
    console = Console(soft_wrap=True)
    t0 = time.monotonic()
    if workdir.exists():
        shutil.rmtree(workdir)  # a previous run's cluster, TSDB and logs: start clean
    workdir.mkdir(parents=True)
    demo = Demo(workdir, rate, trace, console, real_node)

    def terminate(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)  # unwinds through demo.running(): everything is stopped

    signal.signal(signal.SIGTERM, terminate)
    with demo.running():
        final = demo.run()
        console.rule("kubectl batchpilot status")
        console.print(demo.plugin("status"), markup=False, highlight=False)
        console.rule("kubectl batchpilot history")
        console.print(demo.plugin("history"), markup=False, highlight=False)
        # The loop closed: what the pods' own traffic says about the settings now in Git.
        console.rule("kubectl batchpilot recommend")
        console.print(demo.plugin("recommend", "--since", "10m"), markup=False, highlight=False)
        png = write_report(demo, demo.status() or final, workdir / "report")
        console.rule("p99 latency per tenant (report/tenants.json)")
        console.print(tenant_table(json.loads((workdir / "report" / "tenants.json").read_text())), markup=False)
        console.rule("latency model: predicted vs observed p99 per analysis window (report/model.json)")
        console.print(window_table(json.loads((workdir / "report" / "model.json").read_text())), markup=False)
    console.rule("done")
    console.print(f"report: {png} (ledger.json and history.json beside it)")
    console.print(f"scenario finished in {time.monotonic() - t0:.0f}s; everything it started has been stopped")
    return 0
