"""The operator at scale, on the real local control plane: prints JSON.

For each N in ``--policies``, a fresh control plane (etcd, kube-apiserver with an audit log,
controller-manager, scheduler, kwok fake nodes), a real Prometheus with no targets (analyses
query it and find no samples: Inconclusive, so canaries hold), and two operator processes
with leader election (``--leader-elect``); N policies of 1 replica and no GPU.

Figures per N:
* ``apply_to_all_healthy_s``: from the first create to every policy ``Healthy`` at its
  generation (and ``apply_to_all_ready_s``: every stable Deployment's pod ready);
* ``idle``: over ``--idle-seconds`` with nothing changing, the requests each operator sent
  (the apiserver's audit log, by the per-replica user agent), its CPU (cores) and RSS;
* ``reaction_idle`` / ``reaction_busy``: apply -> canary Deployment exists, over ``--changes``
  spec changes, first with the rest idle, then with 10% of the policies mid-canary and
  analysed against Prometheus every 10 s;
* ``failover`` (N in ``--failover``): SIGKILL the leader with those canaries in flight; time
  until the standby leads, until a change applied at the kill has its canary, and until a
  mid-canary policy is analysed again; ledgers checked for duplicates / double promotions,
  failure counts for losses, and the standby's requests before the kill for writes.

The machine is shared: every phase records the 1-minute load average.

    PYTHONPATH=operator:runtime .venv/bin/python bench/operator_scale.py --policies 100 300 1000 \\
        --out bench/results/operator_scale.json
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import os
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from kubernetes import client, config
from kubernetes.watch.watch import iter_resp_lines

from batchpilot_localdev import free_port
from batchpilot_localdev.cluster import LocalCluster
from batchpilot_localdev.processes import stop_process
from batchpilot_localdev.prometheus import start_prometheus

REPO = Path(__file__).resolve().parents[1]
CRD = REPO / "crds" / "batchingpolicy.yaml"
NS = "bench"
GROUP, VERSION, PLURAL = "batchpilot.dev", "v1alpha1", "batchingpolicies"
WRITE_VERBS = {"create", "update", "patch", "delete", "deletecollection"}


def loadavg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def lanes(delay_ms: int) -> list[dict[str, Any]]:
    return [
        {
            "name": "interactive",
            "maxBatchSize": 8,
            "maxQueueDelay": f"{delay_ms}ms",
            "maxQueueLength": 64,
            "requestTimeout": "100ms",
        }
    ]


def policy(name: str) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "BatchingPolicy",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "model": {"name": "mlp", "image": "runtime:dev", "source": "builtin:mlp"},
            "replicas": 1,
            "resources": {"gpus": 0, "cpu": "100m", "memory": "128Mi"},
            "lanes": lanes(2),
            "slo": {"p99Latency": "50ms", "maxQueueAge": "10ms"},
            "rollout": {
                "steps": [{"weight": 50, "pause": "1h"}],
                "analysisInterval": "10s",
                "onMetricsUnavailable": {"action": "Hold"},
            },
        },
    }


# --------------------------------------------------------------------------- operator processes


class Operator:
    def __init__(self, identity: str, cluster: LocalCluster, prom_url: str, workdir: Path, extra: list[str]) -> None:
        self.identity = identity
        self.port = free_port()
        self.log = workdir / f"operator-{identity}.log"
        self.proc = subprocess.Popen(
            [
                sys.executable, "-m", "batchpilot_operator.cli", "run",
                f"--kubeconfig={cluster.kubeconfig}", f"--prometheus-url={prom_url}", f"--namespace={NS}",
                f"--metrics-port={self.port}", "--health-port=0", "--leader-elect",
                f"--leader-election-namespace={NS}", *extra,
            ],
            stdout=self.log.open("wb"), stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "BATCHPILOT_IDENTITY": identity},
        )  # fmt: skip

    def metric(self, name: str, **labels: str) -> float:
        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        return sum(
            s.value
            for fam in text_string_to_metric_families(text)
            for s in fam.samples
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
        )

    def leads(self) -> bool:
        try:
            return self.metric("batchpilot_operator_leader", identity=self.identity) == 1
        except OSError:
            return False

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def rss_mb(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def stop(self) -> None:
        stop_process(self.proc, 20)


# --------------------------------------------------------------------------- the bench's own view


class Watcher:
    """The bench's own watch of the policies and Deployments (first-seen times, status)."""

    def __init__(self, api: client.ApiClient) -> None:
        self.lock = threading.Lock()
        self.policies: dict[str, dict[str, Any]] = {}
        self.deployments: dict[str, dict[str, Any]] = {}
        self.first_seen: dict[str, float] = {}
        self.changed = threading.Condition(self.lock)
        custom, apps = client.CustomObjectsApi(api), client.AppsV1Api(api)
        self.stop = threading.Event()

        def list_policies(**kw: Any) -> Any:
            return custom.list_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, **kw)

        def list_deployments(**kw: Any) -> Any:
            return apps.list_namespaced_deployment(NS, label_selector="batchpilot.dev/policy", **kw)

        for fn, store in ((list_policies, self.policies), (list_deployments, self.deployments)):
            threading.Thread(target=self._run, args=(fn, store), daemon=True).start()

    def _run(self, fn: Any, store: dict[str, dict[str, Any]]) -> None:
        version = None
        while not self.stop.is_set():
            try:
                kw: dict[str, Any] = {"watch": True, "timeout_seconds": 120, "_preload_content": False}
                if version:
                    kw["resource_version"] = version
                for line in iter_resp_lines(fn(**kw)):
                    if not line:
                        continue
                    ev = json.loads(line)
                    obj = ev["object"]
                    if ev["type"] == "ERROR":
                        version = None
                        break
                    version = obj["metadata"]["resourceVersion"]
                    name = obj["metadata"]["name"]
                    with self.changed:
                        if ev["type"] == "DELETED":
                            store.pop(name, None)
                        else:
                            store[name] = obj
                            self.first_seen.setdefault(
                                name + ("" if store is self.policies else "#dep"), time.monotonic()
                            )
                        self.changed.notify_all()
            except Exception as exc:  # keep watching
                if self.stop.is_set():
                    return
                print(f"[bench] watch: {exc}", file=sys.stderr)
                time.sleep(1)

    def wait(self, predicate: Any, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self.changed:
            while not predicate():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.changed.wait(min(left, 1.0))
        return True

    def healthy(self, name: str) -> bool:
        obj = self.policies.get(name) or {}
        st = obj.get("status") or {}
        return st.get("phase") == "Healthy" and st.get("observedGeneration") == obj["metadata"].get("generation")

    def ready(self, name: str) -> bool:
        dep = self.deployments.get(f"{name}-stable") or {}
        return int((dep.get("status") or {}).get("readyReplicas", 0)) >= 1


# --------------------------------------------------------------------------- audit log


def audit(cluster: LocalCluster, since: datetime, until: datetime) -> dict[str, Counter[str]]:
    """Requests received in [since, until) per operator identity -> Counter of verb/resource."""
    marker = f"audit-marker-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("get", "namespace", marker, check=False)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if marker in cluster.audit_log.read_bytes()[-2_000_000:].decode(errors="replace"):
            break
        time.sleep(0.5)
    out: dict[str, Counter[str]] = {}
    seen: set[str] = set()
    with cluster.audit_log.open(errors="replace") as f:
        for line in f:
            if "batchpilot-operator/" not in line:
                continue
            e = json.loads(line)
            ua = e.get("userAgent", "")
            if not ua.startswith("batchpilot-operator/") or e["auditID"] in seen:
                continue
            t = datetime.fromisoformat(e["requestReceivedTimestamp"].replace("Z", "+00:00"))
            if not since <= t < until:
                continue
            seen.add(e["auditID"])
            identity = ua.split("/", 1)[1].split()[0]
            resource = (e.get("objectRef") or {}).get("resource") or e.get("requestURI", "?").split("?")[0]
            out.setdefault(identity, Counter())[f"{e['verb']} {resource}"] += 1
    return out


def apply_breakdown(cluster: LocalCluster, leader: str) -> dict[str, Any]:
    """From the audit log: when the operator created the last stable Deployment (measured from
    the bench's first policy create), and the apiserver's latency for its writes."""
    first: datetime | None = None
    last: datetime | None = None
    latency: dict[str, list[float]] = {}
    with cluster.audit_log.open(errors="replace") as f:
        for line in f:
            e = json.loads(line)
            if e.get("stage") != "ResponseComplete":
                continue
            ua, ref = e.get("userAgent", ""), e.get("objectRef") or {}
            t = datetime.fromisoformat(e["requestReceivedTimestamp"].replace("Z", "+00:00"))
            if ua == "bench" and e["verb"] == "create" and first is None:
                first = t
            if not ua.startswith(f"batchpilot-operator/{leader}") or e["verb"] not in WRITE_VERBS:
                continue
            done = datetime.fromisoformat(e["stageTimestamp"].replace("Z", "+00:00"))
            latency.setdefault(f"{e['verb']} {ref.get('resource')}", []).append((done - t).total_seconds())
            created = (e.get("responseStatus") or {}).get("code") == 201
            if ref.get("resource") == "deployments" and str(ref.get("name", "")).endswith("-stable") and created:
                last = t
    return {
        "first_create_to_last_stable_deployment_s": round((last - first).total_seconds(), 2)
        if first and last
        else None,
        "operator_write_latency_p50_p99_s": {k: [pct(v, 50), pct(v, 99), len(v)] for k, v in sorted(latency.items())},
    }


def summary(counts: Counter[str], seconds: float) -> dict[str, Any]:
    total = sum(counts.values())
    return {
        "requests": total,
        "requests_per_s": round(total / seconds, 3),
        "writes": sum(v for k, v in counts.items() if k.split()[0] in WRITE_VERBS),
        "by_verb_resource": dict(counts.most_common()),
    }


def pct(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 3) if values else None


# --------------------------------------------------------------------------- one point


class Bench:
    def __init__(self, n: int, workdir: Path, args: argparse.Namespace) -> None:
        self.n, self.workdir, self.args = n, workdir, args
        self.result: dict[str, Any] = {"policies": n, "workers": args.workers}
        self.next_delay = 3  # maxQueueDelay (ms) of the next spec change; each one is a new revision

    def change(self, name: str) -> None:
        self.next_delay += 1
        self.custom.patch_namespaced_custom_object(
            GROUP, VERSION, NS, PLURAL, name, {"spec": {"lanes": lanes(self.next_delay % 40 + 3)}}
        )

    def react(self, names: list[str]) -> list[float | None]:
        out: list[float | None] = []
        for name in names:
            with self.w.lock:
                self.w.first_seen.pop(f"{name}-canary#dep", None)
            t0 = time.monotonic()
            self.change(name)
            ok = self.w.wait(lambda n=name: f"{n}-canary#dep" in self.w.first_seen, 60)
            out.append(round(self.w.first_seen[f"{name}-canary#dep"] - t0, 3) if ok else None)
        return out

    def run(self) -> dict[str, Any]:
        n, args = self.n, self.args
        nodes = max(2, math.ceil(n * 1.3 / 250))
        cluster = LocalCluster.start(
            self.workdir / "cluster", gpu_nodes=nodes, audit=True, pods_per_node=250,
            pod_cidr="10.0.0.1/16", controller_qps=200,
        )  # fmt: skip
        ops: list[Operator] = []
        prom = None
        try:
            cluster.kubectl("apply", "-f", str(CRD))
            cluster.wait_established(f"{PLURAL}.{GROUP}")
            cluster.kubectl("create", "namespace", NS)
            prom = start_prometheus(self.workdir / "prom", [], scrape_interval="5s")
            api = config.new_client_from_config(config_file=str(cluster.kubeconfig))
            api.user_agent = "bench"
            self.custom = client.CustomObjectsApi(api)
            self.w = Watcher(api)
            extra = [f"--workers={args.workers}"]
            a = Operator("bench-a", cluster, prom.url, self.workdir, extra)
            ops.append(a)
            self._until(a.leads, 60, "operator a to lead")
            b = Operator("bench-b", cluster, prom.url, self.workdir, extra)
            ops.append(b)
            self._until(lambda: "held by bench-a" in b.log.read_text(), 60, "operator b to stand by")
            self.result["nodes"] = nodes

            # ---- apply -> all Healthy
            names = [f"p{i:04d}" for i in range(n)]
            load0 = loadavg()
            t0 = time.monotonic()
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                list(
                    pool.map(
                        lambda nm: self.custom.create_namespaced_custom_object(GROUP, VERSION, NS, PLURAL, policy(nm)),
                        names,
                    )
                )
            created = time.monotonic() - t0
            healthy_ok = self.w.wait(lambda: all(self.w.healthy(nm) for nm in names), args.timeout)
            healthy = time.monotonic() - t0
            ready_ok = self.w.wait(lambda: all(self.w.ready(nm) for nm in names), args.timeout)
            ready = time.monotonic() - t0
            self.result["apply"] = {
                "create_all_s": round(created, 2),
                "apply_to_all_healthy_s": round(healthy, 2) if healthy_ok else None,
                "apply_to_all_ready_s": round(ready, 2) if ready_ok else None,
                "healthy": sum(self.w.healthy(nm) for nm in names),
                "loadavg_before": load0,
                "loadavg_after": loadavg(),
                "leader_cpu_s": round(a.cpu_seconds(), 2),
            }
            self.result["apply"].update(apply_breakdown(cluster, a.identity))
            print(f"[bench] N={n}: {self.result['apply']}", file=sys.stderr)

            # ---- idle
            self._until(lambda: a.metric("batchpilot_operator_workqueue_depth") == 0, 120, "an empty queue")
            self._until(lambda: a.metric("batchpilot_operator_requeues_pending") == 0, 120, "no requeue pending")
            self.result["idle"] = self.window(cluster, a, b, args.idle_seconds)
            print(f"[bench] N={n}: idle {json.dumps(self.result['idle'])[:400]}", file=sys.stderr)

            # ---- reactions, idle
            lat = self.react(names[: args.changes])
            self.result["reaction_idle"] = self.reactions(lat)

            # ---- 10% mid-canary, analysed against Prometheus
            k = max(1, n // 10)
            canaries = names[args.changes : args.changes + k]
            for nm in canaries:
                self.change(nm)
            self.w.wait(lambda: all(f"{nm}-canary" in self.w.deployments for nm in canaries), args.timeout)
            self._until(
                lambda: sum(bool(self.analysed_at(nm)) for nm in canaries) >= 0.9 * len(canaries),
                180,
                "the canaries' analyses",
            )
            busy_cpu0, t_busy = a.cpu_seconds(), time.monotonic()
            lat = self.react(names[args.changes + k : 2 * args.changes + k])
            busy = self.reactions(lat)
            busy["mid_canary_policies"] = len(canaries) + args.changes
            busy["leader_cpu_cores_during"] = round((a.cpu_seconds() - busy_cpu0) / (time.monotonic() - t_busy), 3)
            busy["analyses_total"] = a.metric("batchpilot_operator_analyses_total")
            self.result["reaction_busy"] = busy

            # ---- failover
            if n in args.failover:
                self.result["failover"] = self.failover(cluster, a, b, canaries, names[2 * args.changes + k])
        finally:
            if hasattr(self, "w"):
                self.w.stop.set()
            for op in ops:
                op.stop()
            if prom is not None:
                prom.stop()
            cluster.stop()
        return self.result

    def analysed_at(self, name: str) -> str | None:
        st = (self.w.policies.get(name) or {}).get("status") or {}
        value = (st.get("rollout") or {}).get("lastAnalysisAt")
        return str(value) if value else None

    def reactions(self, lat: list[float | None]) -> dict[str, Any]:
        ok = [x for x in lat if x is not None]
        return {
            "changes": len(lat),
            "timed_out": len(lat) - len(ok),
            "p50_s": pct(ok, 50),
            "p99_s": pct(ok, 99),
            "max_s": round(max(ok), 3) if ok else None,
            "all_s": lat,
            "loadavg": loadavg(),
        }

    def window(self, cluster: LocalCluster, a: Operator, b: Operator, seconds: float) -> dict[str, Any]:
        cpu_a, cpu_b, reconciles = a.cpu_seconds(), b.cpu_seconds(), a.metric("batchpilot_operator_reconciles_total")
        since, t0, load0 = datetime.now(UTC), time.monotonic(), loadavg()
        time.sleep(seconds)  # the measured idle window itself
        until, elapsed = datetime.now(UTC), time.monotonic() - t0
        counts = audit(cluster, since, until)
        return {
            "seconds": round(elapsed, 1),
            "leader": summary(counts.get(a.identity, Counter()), elapsed),
            "standby": summary(counts.get(b.identity, Counter()), elapsed),
            "leader_cpu_cores": round((a.cpu_seconds() - cpu_a) / elapsed, 4),
            "standby_cpu_cores": round((b.cpu_seconds() - cpu_b) / elapsed, 4),
            "leader_rss_mb": round(a.rss_mb(), 1),
            "standby_rss_mb": round(b.rss_mb(), 1),
            "leader_reconciles": a.metric("batchpilot_operator_reconciles_total") - reconciles,
            "loadavg_before": load0,
            "loadavg_after": loadavg(),
        }

    def failover(
        self, cluster: LocalCluster, a: Operator, b: Operator, canaries: list[str], fresh: str
    ) -> dict[str, Any]:
        before = {nm: json.loads(json.dumps((self.w.policies.get(nm) or {}).get("status") or {})) for nm in canaries}
        with self.w.lock:
            self.w.first_seen.pop(f"{fresh}-canary#dep", None)
        load0 = loadavg()
        killed_wall, t0 = datetime.now(UTC), time.monotonic()
        a.proc.kill()
        a.proc.wait()
        self.change(fresh)  # a change that lands while nobody leads
        self._until(b.leads, 120, "the standby to lead")
        t_lead = time.monotonic() - t0
        got = self.w.wait(lambda: f"{fresh}-canary#dep" in self.w.first_seen, 120)
        t_react = self.w.first_seen[f"{fresh}-canary#dep"] - t0 if got else None
        kill_stamp = killed_wall.strftime("%Y-%m-%dT%H:%M:%SZ")

        def analysed_again() -> bool:
            return any((self.analysed_at(nm) or "") > kill_stamp for nm in canaries)

        cont = self.w.wait(analysed_again, 120)
        t_continue = time.monotonic() - t0 if cont else None
        # let every canary be analysed once by the new leader, then compare the ledgers
        self.w.wait(lambda: all((self.analysed_at(nm) or "") > kill_stamp for nm in canaries), 60)
        after = {nm: (self.w.policies.get(nm) or {}).get("status") or {} for nm in canaries}
        duplicates, double_promotions, lost_failures, lost_entries = 0, 0, 0, 0
        for nm in canaries:
            ledger_after = [json.dumps(e, sort_keys=True) for e in after[nm].get("ledger") or []]
            duplicates += len(ledger_after) - len(set(ledger_after))
            promoted = Counter(
                e.get("revision") for e in after[nm].get("ledger") or [] if "romot" in str(e.get("kind", ""))
            )
            double_promotions += sum(c - 1 for c in promoted.values() if c > 1)
            f0 = (before[nm].get("rollout") or {}).get("failures") or 0
            f1 = (after[nm].get("rollout") or {}).get("failures") or 0
            lost_failures += int(f1 < f0)
            old = [json.dumps(e, sort_keys=True) for e in before[nm].get("ledger") or []]
            lost_entries += sum(1 for e in old if e not in ledger_after) if len(ledger_after) >= len(old) else 0
        counts_before = audit(cluster, datetime(2000, 1, 1, tzinfo=UTC), killed_wall).get(b.identity, Counter())
        return {
            "standby_leads_after_s": round(t_lead, 2),
            "change_at_kill_canary_after_s": round(t_react, 2) if t_react is not None else None,
            "mid_canary_analysed_again_after_s": round(t_continue, 2) if t_continue is not None else None,
            "mid_canary_policies_checked": len(canaries),
            "duplicate_ledger_entries": duplicates,
            "double_promotions": double_promotions,
            "failure_counts_lost": lost_failures,
            "ledger_entries_lost": lost_entries,
            "standby_writes_before_kill": sum(v for k, v in counts_before.items() if k.split()[0] in WRITE_VERBS),
            "standby_requests_before_kill": dict(counts_before.most_common()),
            "loadavg_before": load0,
            "loadavg_after": loadavg(),
        }

    @staticmethod
    def _until(predicate: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if predicate():
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"timed out after {timeout}s waiting for {what}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--policies", type=int, nargs="+", default=[100, 300, 1000])
    p.add_argument("--failover", type=int, nargs="*", default=None, help="N values with a failover (default: all)")
    p.add_argument("--idle-seconds", type=float, default=60.0)
    p.add_argument("--changes", type=int, default=20)
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--timeout", type=float, default=900.0, help="bound on each wait for all policies")
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    if any(n < 2 * args.changes + 2 for n in args.policies):
        p.error(f"every N must be at least {2 * args.changes + 2} (two rounds of --changes, and the canaries)")
    if args.failover is None:
        args.failover = list(args.policies)
    import tempfile

    base = args.workdir or Path(tempfile.mkdtemp(prefix="bp-scale-"))
    results = {
        "bench": "operator_scale",
        "started": datetime.now(UTC).isoformat(timespec="seconds"),
        "cpus": os.cpu_count(),
        "git": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO
        ).stdout.strip(),
        "points": [],
    }
    for n in args.policies:
        point = Bench(n, base / f"n{n}", args).run()
        results["points"].append(point)
        text = json.dumps(results, indent=2)
        if args.out:
            args.out.write_text(text + "\n")
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
