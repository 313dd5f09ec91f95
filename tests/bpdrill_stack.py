"""A drill's own real stack (issue 11, drills 1, 2, 6, 7): a LocalCluster of its own (the drills
restart its apiserver and etcd, and take its nodes away, so they never share the session's
``kube``), the CRD, a namespace, a real Prometheus, the runtime harness (one real runtime
process per pod), the real trace as traffic, operator processes, and an audit that checks,
all along, that no pod runs a revision whose ConfigMap is missing.

Used by tests/drills/test_crash.py, test_control_plane.py and test_capacity.py::

    with DrillStack.start(tmp_path, gpu_nodes=2) as stack:
        stack.start_traffic()
        op = stack.operator(env={"BATCHPILOT_CRASH_AT": "canary-created"})
        stack.apply(policy)
        stack.wait(lambda st: st.get("phase") == "Healthy", 120, "first revision")
"""

from __future__ import annotations

import copy
import json
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

from kubernetes import client, config

from batchpilot_localdev.cluster import LocalCluster
from batchpilot_localdev.harness import RuntimeHarness
from batchpilot_localdev.load import TraceReplay
from batchpilot_localdev.prometheus import PrometheusServer, start_prometheus
from batchpilot_operator.children import LABEL_POLICY, LABEL_REVISION
from batchpilot_operator.tune.trace import load_trace
from bptest import CRD, REPO, TINY_CANARY_POLICY, Kube, LedgerSeen, OperatorProcess, start_operator

TRACE = REPO.parent / "shared" / "traces" / "azure-llm-2023-code.csv"
NAMESPACE = "drill"
POLICY_NAME = "shop"

# The drills' policy: the canary e2e's tiny CPU model, two pods, two short canary steps
# analysed every 3 s (so a rollout takes about half a minute), a short progress deadline.
POLICY: dict[str, Any] = copy.deepcopy(TINY_CANARY_POLICY)
POLICY["metadata"]["name"] = POLICY_NAME
POLICY["spec"]["lanes"][0].pop("priority")
POLICY["spec"]["rollout"].update(
    steps=[{"weight": 25, "pause": "4s"}, {"weight": 50, "pause": "4s"}],
    analysisInterval="3s",
    minSamples=15,
    progressDeadline="30s",
)


def policy(window: str = "2ms", max_batch_size: int = 8, **rollout: Any) -> dict[str, Any]:
    """The drills' policy with another batching window (a new revision); rollout overrides."""
    body = copy.deepcopy(POLICY)
    lane = body["spec"]["lanes"][0]
    lane["maxQueueDelay"], lane["maxBatchSize"] = window, max_batch_size
    body["spec"]["rollout"].update(rollout)
    return body


# A change that breaks the SLO in every analysis (the canary e2e's (b)): a 110 ms window with
# 64-row batches that never fill, so p99 and queue age are over their objectives.
BAD = {"window": "110ms", "max_batch_size": 64}


class ConfigMapAudit:
    """Checks, every ``interval`` seconds for the whole drill, that every pod of the policy that
    is not terminating mounts a ConfigMap that exists (a "silent partial write" would leave a
    pod running a revision whose config is gone, or never written)."""

    def __init__(self, kubeconfig: Path, namespace: str, interval: float = 0.25) -> None:
        self.core = client.CoreV1Api(config.new_client_from_config(config_file=str(kubeconfig)))  # type: ignore[no-untyped-call]
        self.namespace, self.interval = namespace, interval
        self.violations: list[str] = []
        self.checks = 0
        self.errors = 0
        self.revisions_seen: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="configmap-audit", daemon=True)

    def start(self) -> ConfigMapAudit:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.check()
            except Exception:  # the apiserver may be down (drill 2): the next pass checks again
                self.errors += 1
            self._stop.wait(self.interval)

    def check(self) -> None:
        pods = self.core.list_namespaced_pod(self.namespace, label_selector=LABEL_POLICY, _request_timeout=5).items
        cms = {
            cm.metadata.name for cm in self.core.list_namespaced_config_map(self.namespace, _request_timeout=5).items
        }
        self.checks += 1
        for pod in pods:
            if pod.metadata.deletion_timestamp is not None:
                continue
            mounted = [v.config_map.name for v in pod.spec.volumes or [] if v.config_map is not None]
            self.revisions_seen.add((pod.metadata.labels or {}).get(LABEL_REVISION, "?"))
            missing = [m for m in mounted if m not in cms]
            if not missing:
                continue
            # Re-read: the pod may have been deleted between the two lists.
            try:
                again = self.core.read_namespaced_pod(pod.metadata.name, self.namespace, _request_timeout=5)
            except client.ApiException as exc:
                if exc.status == 404:
                    continue
                raise
            if again.metadata.deletion_timestamp is None:
                self.violations.append(
                    f"{time.strftime('%H:%M:%S')} pod {pod.metadata.name} ({pod.status.phase}) mounts missing {missing}"
                )


class DrillStack:
    def __init__(self, workdir: Path, cluster: LocalCluster) -> None:
        self.workdir = workdir
        self.cluster = cluster
        self.kube = Kube(cluster.kubeconfig, str(cluster.bin_dir / "kubectl"), external=False)
        api = config.new_client_from_config(config_file=str(cluster.kubeconfig))  # type: ignore[no-untyped-call]
        self.custom = client.CustomObjectsApi(api)
        self.namespace = NAMESPACE
        self.ops: list[OperatorProcess] = []
        self.prom: PrometheusServer | None = None
        self.harness: RuntimeHarness | None = None
        self.replay: TraceReplay | None = None
        self.audit: ConfigMapAudit | None = None
        self.ledger = LedgerSeen()
        """Every ledger entry a read of the status showed (status keeps the newest analyses only)."""

    # ---- lifecycle -----------------------------------------------------------------------
    @classmethod
    @contextmanager
    def start(cls, workdir: Path, *, runtime: bool = True, **cluster_kw: Any) -> Iterator[DrillStack]:
        """``runtime``: also Prometheus and the runtime harness (not needed where no analysis runs)."""
        cluster = LocalCluster.start(workdir / "cluster", **cluster_kw)
        stack = cls(workdir, cluster)
        try:
            stack.kube.apply(CRD.read_text())
            stack.kube.wait_established("batchingpolicies.batchpilot.dev")
            stack.kube.kubectl("create", "namespace", stack.namespace)
            if runtime:
                stack.prom = start_prometheus(workdir / "prom")
                stack.harness = RuntimeHarness(
                    cluster.kubeconfig, stack.namespace, workdir / "runtime", stack.prom
                ).start()
            stack.audit = ConfigMapAudit(cluster.kubeconfig, stack.namespace).start()
            yield stack
        finally:
            stack.stop()

    def stop(self) -> None:
        if self.replay is not None:
            self.replay.stop()
        for op in self.ops:
            op.stop()
        if self.audit is not None:
            self.audit.stop()
        if self.harness is not None:
            self.harness.stop()
        if self.prom is not None:
            self.prom.stop()
        self.cluster.stop()

    def operator(self, env: dict[str, str] | None = None, extra_args: tuple[str, ...] = ()) -> OperatorProcess:
        prom = self.prom.url if self.prom is not None else "http://127.0.0.1:9"
        op = start_operator(self.kube, self.namespace, self.workdir, prom, resync=5.0, extra_args=extra_args, env=env)
        self.ops.append(op)
        return op

    def start_traffic(self, rate: float = 30.0) -> TraceReplay:
        assert self.harness is not None
        harness = self.harness
        trace = load_trace(TRACE)
        self.replay = TraceReplay(trace.scaled_arrivals(rate), lambda: harness.endpoints(POLICY_NAME), model="tiny")
        return self.replay.start()

    def traffic(self) -> tuple[int, int, int]:
        """(sent, failed, lost) so far: lost = sent with no answer yet, plus arrivals that found
        no ready endpoint at all."""
        if self.replay is None:
            return 0, 0, 0
        stats = list(self.replay.stats.values())
        sent = sum(s.sent for s in stats) + self.replay.dropped_no_endpoint
        failed = sum(s.errors for s in stats)
        lost = sent - failed - sum(s.ok for s in stats)
        return sent, failed, lost

    # ---- reading -------------------------------------------------------------------------
    def apply(self, manifest: dict[str, Any]) -> None:
        self.kube.apply(manifest, "-n", self.namespace)

    def status(self) -> dict[str, Any]:
        """The policy's status (through the Python client: no kubectl process per poll)."""
        try:
            obj = self.custom.get_namespaced_custom_object(
                "batchpilot.dev", "v1alpha1", self.namespace, "batchingpolicies", POLICY_NAME, _request_timeout=10
            )
        except client.ApiException as exc:
            if exc.status == 404:
                return {}
            raise
        status: dict[str, Any] = obj.get("status") or {}
        return self.ledger.record(status)

    def wait(self, predicate: Callable[[dict[str, Any]], Any], timeout: float, what: str) -> dict[str, Any]:
        def check() -> Any:
            try:
                status = self.status()
            except Exception:  # the apiserver is restarting (drill 2)
                return None
            return status if predicate(status) else None

        try:
            result: dict[str, Any] = self.kube.wait_for(check, timeout, what)
        except AssertionError as exc:
            figures = []
            for op in self.ops[-2:]:
                if op.proc.poll() is None:
                    try:
                        figures.append(
                            f"{op.log_path.name}: reconciles "
                            f"{op.metric('batchpilot_operator_reconciles_total')}, errors "
                            f"{op.metric('batchpilot_operator_reconcile_errors_total')}, queue "
                            f"{op.metric('batchpilot_operator_workqueue_depth')}, requeues pending "
                            f"{op.metric('batchpilot_operator_requeues_pending')}"
                        )
                    except OSError as err:
                        figures.append(f"{op.log_path.name}: metrics unreadable: {err}")
                    op.proc.send_signal(signal.SIGUSR1)  # thread stacks into its log
                    time.sleep(1.0)  # (the stack dump is written asynchronously; diagnostics only)
            logs = "\n".join(f"--- {op.log_path.name}\n{op.log()[-6000:]}" for op in self.ops[-2:])
            logs += "\n" + "\n".join(figures)
            raise AssertionError(
                f"{exc}\nstatus: {json.dumps(self.status(), indent=1)[-3000:]}\n{logs}\n"
                f"harness errors: {self.harness.errors[-5:] if self.harness else None}"
            ) from exc
        return result

    def events(self) -> list[dict[str, Any]]:
        out = self.kube.kubectl(
            "get",
            "events",
            "-n",
            self.namespace,
            "--field-selector",
            f"involvedObject.name={POLICY_NAME}",
            "-o",
            "json",
        ).stdout
        items: list[dict[str, Any]] = json.loads(out)["items"]
        return items

    def deployment(self, track: str) -> dict[str, Any] | None:
        return self.kube.get("deployment", f"{POLICY_NAME}-{track}", self.namespace)


def wait_exit(op: OperatorProcess, timeout: float) -> int:
    """Wait for an operator process to end by itself (a crash point); its exit status."""
    try:
        return op.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"operator still running after {timeout}s:\n{op.log()[-3000:]}") from exc


def kill(op: OperatorProcess) -> None:
    op.proc.send_signal(signal.SIGKILL)
    op.proc.wait(timeout=30)


def ts(text: str) -> float:
    """An RFC 3339 time of the status as a Unix time."""
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def stalled(status: dict[str, Any]) -> dict[str, Any] | None:
    return next((c for c in status.get("conditions", []) if c["type"] == "Stalled" and c["status"] == "True"), None)


def condition(status: dict[str, Any], type_: str) -> dict[str, Any] | None:
    return next((c for c in status.get("conditions", []) if c["type"] == type_), None)


DECISION_KINDS = ("Initial", "CanaryStarted", "StepAdvanced", "Promoted", "RolledBack", "Aborted", "Superseded")


def duplicate_decisions(ledger: list[dict[str, Any]]) -> list[tuple[str, ...]]:
    """Decisions recorded twice (a crash replayed and re-recorded them): the same kind for the
    same revision and reason, or the same measurement (time, track, lane, metric) twice."""
    seen: set[tuple[str, ...]] = set()
    dups: list[tuple[str, ...]] = []
    for e in ledger:
        if e.get("kind") in DECISION_KINDS:
            key: tuple[str, ...] = (e["kind"], e.get("revision", ""), str(e.get("reason", "")))
        elif e.get("kind") == "Analysis":
            key = ("Analysis", e["time"], e.get("track", ""), e.get("lane", ""), e.get("metric", ""))
        else:
            continue
        if key in seen:
            dups.append(key)
        seen.add(key)
    return dups
