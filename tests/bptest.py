"""Helpers shared by the test directories (imported as `bptest`; tests/ is on pythonpath)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from batchpilot_localdev import free_port
from batchpilot_localdev.processes import stop_process
from batchpilot_operator.spec import PolicySpec

REPO = Path(__file__).resolve().parents[1]
CRD = REPO / "crds" / "batchingpolicy.yaml"


def wait_until(predicate: Any, timeout: float, what: str, interval: float = 0.3) -> Any:
    """Poll ``predicate`` every ``interval`` seconds until it returns something truthy, its
    value; an AssertionError with the last value after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last value: {last!r}")


def batchpilot(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """The ``batchpilot`` command line as a user runs it: a subprocess, its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "batchpilot_operator.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        check=False,
    )


@dataclass
class Kube:
    """A handle on the cluster under test: a kubeconfig plus a kubectl that uses it."""

    kubeconfig: Path
    kubectl_bin: str
    external: bool
    audit_log: Path | None = None
    """The apiserver's audit log (JSON lines), when the cluster under test writes one."""

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [self.kubectl_bin, f"--kubeconfig={self.kubeconfig}", *args],
            input=input,
            capture_output=True,
            text=True,
            check=False,
            timeout=60,
        )
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed:\n{result.stderr}")
        return result

    def wait_established(self, *crds: str, timeout: float = 60.0) -> None:
        """Every named CRD Established (not ``kubectl wait``: see batchpilot_localdev.cluster.wait_established)."""
        from batchpilot_localdev.cluster import wait_established

        wait_established([self.kubectl_bin, f"--kubeconfig={self.kubeconfig}"], list(crds), timeout)

    def apply(
        self, manifest: dict[str, Any] | str, *extra: str, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        text = manifest if isinstance(manifest, str) else yaml.safe_dump(manifest)
        return self.kubectl("apply", "-f", "-", *extra, input=text, check=check)

    def get(self, kind: str, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        args = ["get", kind, name, "-o", "json", "--show-managed-fields"]
        if namespace:
            args += ["-n", namespace]
        result = self.kubectl(*args, check=False)
        if result.returncode != 0:
            if "NotFound" in result.stderr or "not found" in result.stderr:
                return None
            raise AssertionError(result.stderr)
        # json, not yaml: PyYAML parses a 24 KB status in ~60 ms of pure Python holding the GIL,
        # at every poll (0.3 s), which made a load sender in the test process late (TraceReplay.late).
        obj: dict[str, Any] = json.loads(result.stdout)
        return obj

    def wait_for(self, predicate: Any, timeout: float, what: str) -> Any:
        """Poll ``predicate`` until it returns something truthy (bounded by ``timeout``)."""
        return wait_until(predicate, timeout, what)


INTERACTIVE_LANE: dict[str, Any] = {
    "name": "interactive",
    "maxBatchSize": 8,
    "maxQueueDelay": "2ms",
    "maxQueueLength": 64,
    "requestTimeout": "100ms",
}


def conclusive(spec: PolicySpec) -> dict[str, list[list[float]]]:
    """A rollout history (``status.rollout.evidence``) whose sequential evidence is already
    past any bound for every objective of every lane and tenant slice: the window's own rule
    then decides alone (the tests of that rule; the sequential gate has its own)."""
    from batchpilot_operator.analysis import METRICS, lane_key, sequential_key
    from batchpilot_operator.stats import LOG_CAP, OVER_BUDGET_RATIOS, WORSE_ODDS

    keys = [lane_key(lane.name, t) for lane in spec.lanes for t in (None, *spec.tenant_slices)]
    full = [[LOG_CAP] * len(OVER_BUDGET_RATIOS), [LOG_CAP] * len(WORSE_ODDS)]
    return {sequential_key(k, m): [list(part) for part in full] for k in keys for m in METRICS}


def make_spec(*, batch: int = 8, replicas: int = 4, lanes: int = 1, **rollout: Any) -> PolicySpec:
    """The pure-logic tests' policy (planner, analysis): an interactive lane (``batch`` rows, 5 ms
    window) and, with ``lanes=2``, a background lane with its own 2 s / 500 ms SLO; policy SLO
    200 ms / 50 ms; steps 25% and 50% of 60 s; analysed every 30 s over at least 50 samples.
    Keyword arguments replace rollout fields."""
    lane_list = [
        {
            "name": "interactive",
            "maxBatchSize": batch,
            "maxQueueDelay": "5ms",
            "maxQueueLength": 100,
            "requestTimeout": "1s",
        },
        {
            "name": "background",
            "maxBatchSize": 64,
            "maxQueueDelay": "50ms",
            "maxQueueLength": 1000,
            "requestTimeout": "10s",
            "slo": {"p99Latency": "2s", "maxQueueAge": "500ms"},
        },
    ][:lanes]
    ro: dict[str, Any] = {
        "steps": [{"weight": 25, "pause": "60s"}, {"weight": 50, "pause": "60s"}],
        "analysisInterval": "30s",
        "failureLimit": 2,
        "minSamples": 50,
        "maxInconclusive": 3,
    }
    ro.update(rollout)
    return PolicySpec.model_validate(
        {
            "model": {"name": "m", "image": "img:1", "source": "builtin:mlp"},
            "replicas": replicas,
            "lanes": lane_list,
            "slo": {"p99Latency": "200ms", "maxQueueAge": "50ms"},
            "rollout": ro,
        }
    )


def policy(name: str, **spec: Any) -> dict[str, Any]:
    """A valid BatchingPolicy manifest for tests: the builtin MLP, 2 replicas of 1 GPU, one
    interactive lane under a 50 ms / 10 ms SLO, one 50% step held for an hour, analysed every
    second, holding when metrics are missing. Keyword arguments replace whole spec fields."""
    body: dict[str, Any] = {
        "model": {"name": "mlp", "image": "runtime:dev", "source": "builtin:mlp"},
        "replicas": 2,
        "resources": {"gpus": 1},
        "lanes": [dict(INTERACTIVE_LANE)],
        "slo": {"p99Latency": "50ms", "maxQueueAge": "10ms"},
        "rollout": {
            "steps": [{"weight": 50, "pause": "1h"}],
            "analysisInterval": "1s",
            "onMetricsUnavailable": {"action": "Hold"},
        },
    }
    body.update(spec)
    return {"apiVersion": "batchpilot.dev/v1alpha1", "kind": "BatchingPolicy", "metadata": {"name": name}, "spec": body}


@dataclass
class OperatorProcess:
    """`batchpilot run` as a real subprocess against the cluster under test."""

    proc: subprocess.Popen[bytes]
    metrics_port: int
    log_path: Path

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of ``name`` whose labels include ``labels`` (0 if none)."""
        import urllib.request

        from prometheus_client.parser import text_string_to_metric_families

        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        total = 0.0
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                    total += sample.value
        return total

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        stop_process(self.proc, 15)


NO_PROMETHEUS = "http://127.0.0.1:9"
"""A Prometheus URL nothing listens on: analyses report Error (and, under Hold, canaries wait)."""


def policy_status(kube: Kube, namespace: str, name: str) -> dict[str, Any]:
    """The policy's ``.status`` ({} while it has none or the policy is gone)."""
    return ((kube.get("batchingpolicy", name, namespace) or {}).get("status")) or {}


class LedgerSeen:
    """Every ledger entry any read of a policy's status showed, in the order first seen.

    ``status.ledger`` keeps only the newest analysis entries (``status.trim_ledger``): a canary
    analysed more times than usual before it is decided (a slow machine's Inconclusive windows)
    pushes its early analyses out before the test reads the decided status. A test that records
    every status it polls while the rollout runs misses none: a poll comes every second or so,
    and the ledger holds many analyses' entries."""

    def __init__(self) -> None:
        self._seen: dict[str, dict[str, Any]] = {}

    def record(self, status: dict[str, Any]) -> dict[str, Any]:
        for entry in status.get("ledger") or []:
            self._seen.setdefault(json.dumps(entry, sort_keys=True), entry)
        return status

    def entries(self, **match: Any) -> list[dict[str, Any]]:
        """The entries whose fields equal ``match`` (e.g. ``revision=rev, outcome="Failed"``)."""
        return [e for e in self._seen.values() if all(e.get(k) == v for k, v in match.items())]


class PolicyScenario:
    """What an end-to-end scenario does with its policy: read its status (every ledger entry the
    polls saw kept in ``ledger``), wait for a condition on it with the evidence on timeout, and
    apply a change. A scenario sets the attributes below, adds its own evidence in
    :meth:`diagnostics` and checks what it started in :meth:`check_alive` (every poll). Another
    policy of the namespace is read with ``name``."""

    kube: Kube
    namespace: str
    op: OperatorProcess
    ledger: LedgerSeen
    policy_name: str = "shop"
    status_tail: int = 4000
    """How much of the status (JSON, the end) a timeout shows."""

    def diagnostics(self) -> str:
        return ""

    def check_alive(self) -> None:
        """Raise when something the scenario started has died (called before every poll)."""

    def status(self, name: str | None = None) -> dict[str, Any]:
        obj = self.kube.get("batchingpolicy", name or self.policy_name, self.namespace) or {}
        return self.ledger.record(obj.get("status") or {})

    def wait(self, predicate: Any, timeout: float, what: str, name: str | None = None) -> dict[str, Any]:
        def check() -> Any:
            self.check_alive()
            status = self.status(name)
            return status if predicate(status) else None

        try:
            result: dict[str, Any] = self.kube.wait_for(check, timeout, what)
        except AssertionError as exc:
            raise AssertionError(
                f"{exc}\nstatus: {json.dumps(self.status(name), indent=1)[-self.status_tail :]}\n"
                f"operator log:\n{self.op.log()[-3000:]}\n{self.diagnostics()}"
            ) from exc
        return result

    def apply(self, policy: dict[str, Any]) -> None:
        self.kube.apply(policy, "-n", self.namespace)

    def first_revision(self, policy: dict[str, Any], timeout: float = 120) -> str:
        """Apply the policy's first revision and wait until it is Healthy; its revision."""
        self.apply(policy)
        return str(
            self.wait(lambda st: st.get("phase") == "Healthy", timeout, "the first revision Healthy")["stableRevision"]
        )

    def begin_canary(self, policy: dict[str, Any], stable: str, weight_timeout: float = 120) -> str:
        """Apply a change to the policy (whose stable revision is ``stable``) and wait for its
        canary, then for the canary at 50% of the pods; the canary's revision."""
        self.apply(policy)
        canary = self.wait(lambda st: st.get("canaryRevision") not in (None, stable), 60, "a canary")["canaryRevision"]
        self.wait(lambda st: st.get("canaryWeight") == 50, weight_timeout, "the canary at 50% of the pods")
        return str(canary)

    def promoted(self, canary: str, timeout: float) -> dict[str, Any]:
        """Wait until ``canary`` is the stable revision and the policy Healthy; the status."""
        return self.wait(
            lambda st: st.get("stableRevision") == canary and st.get("phase") == "Healthy",
            timeout,
            "the good change promoted",
        )


def wait_policy_status(
    kube: Kube, namespace: str, name: str, pred: Any, what: str, op: OperatorProcess, timeout: float = 90
) -> dict[str, Any]:
    """Wait until ``pred(status)`` holds; on timeout the error carries the operator's log tail."""

    def check() -> dict[str, Any] | None:
        st = policy_status(kube, namespace, name)
        return st if pred(st) else None

    try:
        result: dict[str, Any] = kube.wait_for(check, timeout, what)
    except AssertionError as exc:
        raise AssertionError(f"{exc}\noperator log:\n{op.log()[-3000:]}") from exc
    return result


def start_operator(
    kube: Kube,
    namespace: str,
    log_dir: Path,
    prometheus_url: str,
    resync: float = 1.0,
    extra_args: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
) -> OperatorProcess:
    import os
    import sys

    port = free_port()
    log_path = log_dir / f"operator-{port}.log"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "batchpilot_operator.cli",
            "run",
            f"--kubeconfig={kube.kubeconfig}",
            f"--namespace={namespace}",
            f"--prometheus-url={prometheus_url}",
            f"--metrics-port={port}",
            "--health-port=0",
            f"--resync={resync}",
            *extra_args,
        ],
        stdout=log_path.open("wb"),
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
    )
    op = OperatorProcess(proc, port, log_path)

    def up() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"operator exited {proc.returncode}:\n{op.log()[-3000:]}")
        try:
            op.metric("batchpilot_operator_reconciles_total")
        except OSError:
            return False
        return True

    kube.wait_for(up, 60, "the operator's metrics endpoint")
    return op


class Plugin:
    def __init__(self, kube: Kube, namespace: str) -> None:
        self.kube, self.namespace = kube, namespace
        scripts = Path(sys.executable).parent
        assert (scripts / "kubectl-batchpilot").exists(), "pip install -e . installs the kubectl-batchpilot script"
        self.env = {**os.environ, "PATH": f"{scripts}{os.pathsep}{os.environ.get('PATH', '')}", "COLUMNS": "200"}

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        # kubectl hands everything after the plugin name to the plugin (flags included).
        cmd = [
            self.kube.kubectl_bin,
            "batchpilot",
            *args,
            "-n",
            self.namespace,
            "--kubeconfig",
            str(self.kube.kubeconfig),
        ]
        result = subprocess.run(cmd, capture_output=True, text=True, env=self.env, timeout=120, check=False)
        if check and result.returncode != 0:
            raise AssertionError(f"kubectl batchpilot {' '.join(args)} exited {result.returncode}:\n{result.stderr}")
        return result

    def json(self, *args: str) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(self.run(*args, "-o", "json").stdout)
        return data


def lua_literal(value: Any) -> str:
    """A Python JSON value as a Lua 5.1 table constructor (JSON null becomes an absent key)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        out = []
        for byte in value.encode():
            ch = chr(byte)
            if ch in '\\"':
                out.append("\\" + ch)
            elif 32 <= byte < 127:
                out.append(ch)
            else:
                out.append(f"\\{byte:03d}")
        return '"' + "".join(out) + '"'
    if isinstance(value, list):
        return "{" + ", ".join(lua_literal(v) for v in value if v is not None) + "}"
    if isinstance(value, dict):
        items = [f"[{lua_literal(str(k))}] = {lua_literal(v)}" for k, v in value.items() if v is not None]
        return "{" + ", ".join(items) + "}"
    raise TypeError(f"not JSON: {value!r}")


TINY_MODEL: dict[str, Any] = {
    "name": "tiny",
    "image": "runtime:dev",
    "source": "builtin:tiny-mlp",
    "device": "cpu",
    "dtype": "float32",
    "threads": 1,
}
"""The builtin tiny MLP on one CPU thread: the model of the end-to-end policies (copy it)."""

# The canary end-to-end policy: the tiny CPU model on two pods, one interactive lane, one 50%
# step of 6 s analysed every 4 s; Prometheus trouble holds the rollout. The drills start from it.
TINY_CANARY_POLICY: dict[str, Any] = policy(
    "shop",
    model=dict(TINY_MODEL),
    lanes=[dict(INTERACTIVE_LANE, maxQueueLength=256, requestTimeout="1s", priority=10)],
    slo={"p99Latency": "120ms", "maxQueueAge": "60ms"},
    rollout={
        "steps": [{"weight": 50, "pause": "6s"}],
        "analysisInterval": "4s",
        "failureLimit": 2,
        "minSamples": 20,
        "onMetricsUnavailable": {"action": "Hold"},
    },
)
