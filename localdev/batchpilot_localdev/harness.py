"""Local runtime harness: one real runtime server process per pod of our Deployments.

kwok makes pods Running/Ready without running anything, so on one machine this harness plays
the container runtime: for every running pod of a batchpilot Deployment in a namespace it
starts ``python -m batchpilot_runtime.server`` with that pod's revision config (read from the
ConfigMap the pod mounts) and track, and registers it as a target of the local Prometheus (file_sd)
labelled like the pod would be by the PodMonitor: ``namespace``, ``policy``, ``revision``,
``track``, ``pod``, and ``environment`` from the pod's ``batchpilot.dev/environment`` label.
When a pod goes away its process is stopped as a kubelet stops a container: it keeps serving
for the container's ``preStop`` sleep (the endpoint's removal reaches Envoy, the local data plane
and the pod network's other clients in that time, so no request meets a closed port), then it
drains with SIGTERM. Once a pod's process answers its
readiness endpoint the harness annotates the pod ``batchpilot.dev/serving: "true"``: on a
cluster started with ``ready_when_serving`` kwok reports the pod Ready only then, as a
kubelet's readiness probe would (otherwise kwok reports it Ready at once, seconds before the
process has loaded its model, and a rollout moves weight onto pods that do not serve yet).

Traffic is spread over the processes of a policy as a Service spreads it over ready
endpoints: uniformly per pod, so the canary's share follows its share of pods.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes import client, config

from batchpilot_localdev import free_port, podnet
from batchpilot_localdev.cluster import POD_ROUTES, SERVING_ANNOTATION
from batchpilot_localdev.processes import stop_group, stop_groups
from batchpilot_localdev.prometheus import PrometheusServer, ScrapeTarget
from batchpilot_operator.children import CONFIG_KEY, LABEL_ENVIRONMENT, LABEL_POLICY, LABEL_REVISION, LABEL_TRACK


@dataclass
class RuntimeProcess:
    pod: str
    policy: str
    revision: str
    track: str
    port: int
    proc: subprocess.Popen[bytes]
    ready: bool = False
    pod_ip: str | None = None
    pod_port: int | None = None
    model: str = ""
    environment: str | None = None
    pre_stop_seconds: float = 0.0

    @property
    def address(self) -> str:
        """Where the process listens (``127.0.0.1:<port>``): its pod's route leads here."""
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"


class RuntimeHarness:
    def __init__(
        self,
        kubeconfig: Path,
        namespace: str,
        workdir: Path,
        prometheus: PrometheusServer,
        device: str | None = None,
    ) -> None:
        """``device``: when set, overrides every config's ``model.device`` (kwok's GPU nodes are
        fake: ``auto`` runs a policy that asks for ``cuda`` on this machine's CPU when it has no GPU)."""
        self.namespace = namespace
        self.device = device
        self.workdir = workdir
        self.prometheus = prometheus
        workdir.mkdir(parents=True, exist_ok=True)
        self.core = client.CoreV1Api(config.new_client_from_config(config_file=str(kubeconfig)))  # type: ignore[no-untyped-call]
        self.procs: dict[str, RuntimeProcess] = {}
        self.stopping: dict[str, tuple[RuntimeProcess, float]] = {}
        """Processes of pods gone, serving out their ``preStop`` sleep: each with the monotonic
        time of its SIGTERM. No longer an endpoint, still a scrape target."""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.errors: list[str] = []
        # The local pod network (localdev/podnet.py): the apiserver's pod proxy reaches a pod's
        # ip:port through it, and it forwards to the process playing that pod on 127.0.0.1.
        routes = Path(kubeconfig).parent / POD_ROUTES
        self.routes: Path | None = routes if routes.is_dir() else None
        self._write_targets()

    # ---- lifecycle ---------------------------------------------------------------------
    def start(self, interval: float = 0.5) -> RuntimeHarness:
        def loop() -> None:
            while not self._stop.is_set():
                try:
                    self.sync()
                except Exception as exc:  # keep the harness alive; the test reads errors
                    self.errors.append(repr(exc))
                self._stop.wait(interval)

        self._thread = threading.Thread(target=loop, name="runtime-harness", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=10)
        with self._lock:
            # SIGTERM all first, then wait: each drains on its own, in parallel.
            procs = self._running()
            self.procs.clear()
            self.stopping.clear()
            stop_groups((p.proc for p in procs), timeout=20)
            self._write_targets()

    def __enter__(self) -> RuntimeHarness:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- one pass --------------------------------------------------------------------------
    def sync(self) -> None:
        pods: list[Any] = self.core.list_namespaced_pod(self.namespace, label_selector=LABEL_POLICY).items
        wanted: dict[str, Any] = {}
        for pod in pods:
            if pod.metadata.deletion_timestamp is not None or pod.status.phase != "Running":
                continue
            wanted[pod.metadata.name] = pod
        with self._lock:
            changed = False
            now = time.monotonic()
            for name in list(self.procs):
                if name not in wanted:
                    proc = self.procs.pop(name)
                    self.stopping[name] = (proc, now + proc.pre_stop_seconds)
            for name, (proc, sigterm_at) in list(self.stopping.items()):
                if now >= sigterm_at:
                    del self.stopping[name]
                    self._terminate(proc)
                    changed = True
            for name, pod in wanted.items():
                if name not in self.procs:
                    self._launch(pod)
                    changed = True
            for proc in self.procs.values():
                if proc.proc.poll() is not None:
                    self.errors.append(f"runtime for pod {proc.pod} exited with {proc.proc.returncode}")
                if not proc.ready and self._probe(proc):
                    proc.ready = True
                    changed = True
                    self._mark_serving(proc.pod)
            if changed:
                self._write_targets()

    def _launch(self, pod: Any) -> None:
        labels = pod.metadata.labels or {}
        cm_name = next(v.config_map.name for v in pod.spec.volumes if v.config_map is not None)
        cm = self.core.read_namespaced_config_map(cm_name, self.namespace)
        cfg = json.loads((cm.data or {})[CONFIG_KEY])
        if self.device is not None:
            cfg["model"]["device"] = self.device
        cfg_path = self.workdir / f"{pod.metadata.name}.json"
        cfg_path.write_text(json.dumps(cfg))
        port = free_port()
        track = labels.get(LABEL_TRACK, "stable")
        log = (self.workdir / f"{pod.metadata.name}.log").open("wb")
        env = {
            **os.environ,
            "BATCHPILOT_TRACK": track,
            "BATCHPILOT_POD_NAME": pod.metadata.name,
            "PYTHONUNBUFFERED": "1",
        }
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "batchpilot_runtime.server",
                "--config",
                str(cfg_path),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--track",
                track,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        pod_ip: str | None = pod.status.pod_ip
        ports = [p.container_port for c in pod.spec.containers for p in (c.ports or [])]
        pod_port = ports[0] if ports else None
        runtime = self.procs[pod.metadata.name] = RuntimeProcess(
            pod=pod.metadata.name,
            policy=labels.get(LABEL_POLICY, ""),
            revision=labels.get(LABEL_REVISION, cfg.get("revision", "")),
            track=track,
            port=port,
            proc=proc,
            pod_ip=pod_ip,
            pod_port=pod_port,
            model=str(cfg.get("model", {}).get("name", "")),
            environment=labels.get(LABEL_ENVIRONMENT),
            pre_stop_seconds=_pre_stop_seconds(pod),
        )
        if self.routes is not None and pod_ip and pod_port:
            podnet.write_route(self.routes, pod_ip, pod_port, runtime.address)

    def _terminate(self, proc: RuntimeProcess) -> None:
        if self.routes is not None and proc.pod_ip and proc.pod_port:
            podnet.remove_route(self.routes, proc.pod_ip, proc.pod_port, proc.address)
        stop_group(proc.proc, timeout=20)

    def _mark_serving(self, pod: str) -> None:
        """The readiness probe's verdict on the pod (see the module doc); a pod already gone is
        no error."""
        body = {"metadata": {"annotations": {SERVING_ANNOTATION: "true"}}}
        try:
            self.core.patch_namespaced_pod(pod, self.namespace, body)
        except client.ApiException as exc:
            if exc.status != 404:
                self.errors.append(f"marking pod {pod} serving: {exc.status} {exc.reason}")

    @staticmethod
    def _probe(proc: RuntimeProcess) -> bool:
        try:
            with urllib.request.urlopen(f"{proc.url}/v2/health/ready", timeout=1) as resp:
                return bool(resp.status == 200)
        except OSError:
            return False

    def _running(self) -> list[RuntimeProcess]:
        """Every process still running: the pods' and those serving out their ``preStop``."""
        return [*self.procs.values(), *(p for p, _ in self.stopping.values())]

    def _write_targets(self) -> None:
        self.prometheus.set_targets(
            [
                ScrapeTarget(
                    f"127.0.0.1:{p.port}",
                    {
                        "namespace": self.namespace,
                        "policy": p.policy,
                        "revision": p.revision,
                        "track": p.track,
                        "pod": p.pod,
                    }
                    # as the PodMonitor relabels the pod's batchpilot.dev/environment label
                    | ({"environment": p.environment} if p.environment else {}),
                )
                for p in self._running()
                if p.ready
            ]
        )

    # ---- for load generators ---------------------------------------------------------------
    def endpoints(self, policy: str) -> list[RuntimeProcess]:
        """Ready runtime processes of ``policy``: what its Service would route to."""
        with self._lock:
            return [p for p in self.procs.values() if p.policy == policy and p.ready]

    def processes(self) -> list[RuntimeProcess]:
        """Every runtime process, ready or not (a snapshot)."""
        with self._lock:
            return list(self.procs.values())

    def wait_ready(self, policy: str, count: int, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len(self.endpoints(policy)) >= count:
                return
            time.sleep(0.2)
        raise TimeoutError(f"{count} ready runtime processes of {policy} not up after {timeout}s: {self.errors}")


def _pre_stop_seconds(pod: Any) -> float:
    """The pod's ``preStop`` sleep (the first container's that has one), which a kubelet runs
    before the container's SIGTERM; 0 without one."""
    for container in pod.spec.containers:
        hook = container.lifecycle.pre_stop if container.lifecycle is not None else None
        if hook is not None and hook.sleep is not None:
            return float(hook.sleep.seconds)
    return 0.0
