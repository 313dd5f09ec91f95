"""The dependency drills' stage (issue 11, drills 3 and 4): the real local stack of the canary
e2e test (control plane, runtime processes per pod, a real Prometheus scraping them, load
replayed from the real trace, the operator as a subprocess), with the operator's Prometheus
behind a Toxiproxy so that faults can be injected between the operator and Prometheus only
(Prometheus itself keeps scraping).
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml

from batchpilot_localdev.harness import RuntimeHarness
from batchpilot_localdev.load import TraceReplay
from batchpilot_localdev.prometheus import PrometheusServer, start_prometheus
from batchpilot_localdev.toxiproxy import Toxiproxy
from batchpilot_operator.tune.trace import load_trace
from bptest import REPO, TINY_CANARY_POLICY, Kube, LedgerSeen, OperatorProcess, PolicyScenario, start_operator

TRACE = REPO.parent / "shared" / "traces" / "azure-llm-2023-code.csv"
RATE = 40.0  # requests/s over the policy under load

# The canary e2e test's policy (drill 4 switches onMetricsUnavailable to Rollback).
POLICY = TINY_CANARY_POLICY


def policy(name: str = "shop", window: str = "2ms", **rollout: Any) -> dict[str, Any]:
    body = copy.deepcopy(POLICY)
    body["metadata"]["name"] = name
    body["spec"]["lanes"][0]["maxQueueDelay"] = window
    body["spec"]["rollout"].update(rollout)
    return body


def condition(status: dict[str, Any], type_: str) -> dict[str, Any] | None:
    return next((c for c in status.get("conditions", []) if c.get("type") == type_), None)


def stalled(status: dict[str, Any]) -> bool:
    c = condition(status, "Stalled")
    return c is not None and c.get("status") == "True"


class Stage(PolicyScenario):
    """The stack one dependency drill runs against; ``status``/``wait`` read policy ``shop``, or
    ``name``."""

    status_tail = 3000

    def __init__(
        self,
        kube: Kube,
        namespace: str,
        prom: PrometheusServer,
        toxi: Toxiproxy,
        op: OperatorProcess,
        harness: RuntimeHarness,
        replay: TraceReplay,
    ) -> None:
        self.kube, self.namespace, self.prom, self.toxi = kube, namespace, prom, toxi
        self.op, self.harness, self.replay = op, harness, replay
        self.ledger = LedgerSeen()

    def diagnostics(self) -> str:
        return f"harness errors: {self.harness.errors}"

    def events(self, name: str = "shop") -> list[dict[str, Any]]:
        out = self.kube.kubectl(
            "get", "events", "-n", self.namespace, "--field-selector", f"involvedObject.name={name}", "-o", "json"
        ).stdout
        items: list[dict[str, Any]] = json.loads(out)["items"]
        return items

    def start_canary(self, window: str, **rollout: Any) -> tuple[str, str]:
        """Roll ``shop`` to a new window; wait until the canary serves at 50%. (stable, canary)"""
        stable = str(self.status()["stableRevision"])
        return stable, self.begin_canary(policy(window=window, **rollout), stable)

    def reconcile_latency(self, name: str, replicas: int, timeout: float = 60.0) -> float:
        """Seconds from a spec change of policy ``name`` to its status observing it (the
        Deployment scaled): how prompt the operator is for a policy not under the fault."""
        t0 = time.monotonic()
        self.kube.kubectl(
            "patch", "batchingpolicy", name, "-n", self.namespace, "--type=merge",
            "-p", json.dumps({"spec": {"replicas": replicas}}),
        )  # fmt: skip

        def observed() -> bool:
            obj = self.kube.get("batchingpolicy", name, self.namespace) or {}
            dep = self.kube.get("deployment", f"{name}-stable", self.namespace) or {}
            gen = obj.get("metadata", {}).get("generation")
            return bool(
                (obj.get("status") or {}).get("observedGeneration") == gen
                and dep.get("spec", {}).get("replicas") == replicas
            )

        self.kube.wait_for(observed, timeout, f"{name} reconciled to {replicas} replicas")
        return time.monotonic() - t0


def stage(
    kube: Kube,
    namespace: str,
    tmp_path: Path,
    *,
    prometheus_timeout: float = 1.0,
    kubeconfig: Path | None = None,
    prometheus_front: Callable[[PrometheusServer], str] | None = None,
    extra_args: tuple[str, ...] = (),
) -> Iterator[Stage]:
    """Start the stack, with policy ``shop`` Healthy under load (a generator for a fixture).

    ``kubeconfig``: the operator's own (e.g. through a proxy in front of the apiserver).
    ``prometheus_front``: the URL the operator queries, given the Prometheus (default: through
    the Toxiproxy proxy ``prometheus``)."""
    prom = start_prometheus(tmp_path / "prom")
    toxi = Toxiproxy(tmp_path / "toxiproxy")
    proxy = toxi.proxy("prometheus", f"127.0.0.1:{prom.port}")
    prom_url = prometheus_front(prom) if prometheus_front else f"http://{proxy.listen}"
    harness = RuntimeHarness(kube.kubeconfig, namespace, tmp_path / "runtime", prom).start()
    op_kube = Kube(kubeconfig, kube.kubectl_bin, kube.external) if kubeconfig else kube
    op: OperatorProcess | None = None
    replay: TraceReplay | None = None
    try:
        op = start_operator(
            op_kube,
            namespace,
            tmp_path,
            prometheus_url=prom_url,
            resync=1.0,
            extra_args=extra_args,
            env={"BATCHPILOT_PROMETHEUS_TIMEOUT": str(prometheus_timeout)},
        )
        trace = load_trace(TRACE)
        replay = TraceReplay(trace.scaled_arrivals(RATE), lambda: harness.endpoints("shop"), model="tiny").start()
        s = Stage(kube, namespace, prom, toxi, op, harness, replay)
        s.first_revision(policy())
        harness.wait_ready("shop", 2)
        yield s
    finally:
        if replay is not None:
            replay.stop()
        if op is not None:
            op.stop()
        harness.stop()
        toxi.stop()
        prom.stop()


def proxied_kubeconfig(kube: Kube, listen: str, out: Path) -> Path:
    """A copy of the cluster's kubeconfig whose server is ``https://<listen>`` (a TCP proxy in
    front of the apiserver; TLS passes through it, and the certificate names 127.0.0.1)."""
    config: dict[str, Any] = yaml.safe_load(kube.kubeconfig.read_text())
    for cluster in config["clusters"]:
        cluster["cluster"]["server"] = f"https://{listen}"
    out.write_text(yaml.safe_dump(config))
    return out


def apiserver_address(kube: Kube) -> str:
    config: dict[str, Any] = yaml.safe_load(kube.kubeconfig.read_text())
    server: str = config["clusters"][0]["cluster"]["server"]
    return server.split("://", 1)[1].rstrip("/")
