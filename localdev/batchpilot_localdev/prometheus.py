"""A real, local Prometheus (Debian ``/usr/bin/prometheus``) for the tests and the local demo.

``start_prometheus(tmp_path, targets)`` starts one on a free 127.0.0.1 port with a generated
config: one scrape job (``batchpilot``), ``scrape_interval`` 1s, targets from a
``file_sd_configs`` JSON file that :meth:`PrometheusServer.set_targets` rewrites atomically
(Prometheus re-reads it on change, and every second anyway). Each :class:`ScrapeTarget`
carries target labels (``namespace``, ``policy``, ``track``, ...) as the PodMonitor
relabelling yields them in a cluster. :meth:`PrometheusServer.stop` /
:meth:`PrometheusServer.start` stop and restart the same server (same port, same TSDB)
for outage tests.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchpilot_localdev import checkout, free_port
from batchpilot_localdev.processes import stop_process

PROMETHEUS_BIN = shutil.which("prometheus") or "/usr/bin/prometheus"
UPSTREAM_PROMETHEUS_BIN = (
    Path(os.environ.get("BATCHPILOT_PROMETHEUS_BIN", checkout() / ".cache" / "prometheus-bin")) / "prometheus"
)
"""Upstream Prometheus (``hack/prometheus/build.sh``), for :class:`KubernetesSD`: Debian's is built
without Kubernetes service discovery."""
PODMONITOR = checkout() / "manifests" / "components" / "monitoring" / "podmonitor.yaml"


@dataclass(frozen=True)
class KubernetesSD:
    """Discover the runtime pods from an apiserver (``role: pod``), as the PodMonitor of
    ``manifests/components/monitoring`` has the Prometheus Operator do in a cluster: pods of a
    real node (localdev/realnode.py), scraped at their own addresses."""

    api_server: str
    ca_file: Path
    token: str
    namespaces: tuple[str, ...] = ()
    """Only these namespaces (all when empty)."""


def _relabel(rule: dict[str, Any]) -> dict[str, Any]:
    """A PodMonitor relabeling (camelCase) as a Prometheus relabel config (snake_case)."""
    names = {"sourceLabels": "source_labels", "targetLabel": "target_label"}
    return {names.get(k, k): v for k, v in rule.items()}


def _label_meta(label: str) -> str:
    return "__meta_kubernetes_pod_label_" + "".join(c if c.isalnum() else "_" for c in label)


def podmonitor_scrape_config(sd: KubernetesSD, scrape_interval: str, podmonitor: Path = PODMONITOR) -> dict[str, Any]:
    """The ``batchpilot`` job the Prometheus Operator would generate from the PodMonitor (its
    selector, port, path, relabelings and metric relabelings), with kubernetes_sd against ``sd``;
    the interval is the tests' rather than the manifest's."""
    import yaml

    monitor = yaml.safe_load(podmonitor.read_text())
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    match = monitor["spec"]["selector"]["matchLabels"]
    sd_config: dict[str, Any] = {
        "role": "pod",
        "api_server": sd.api_server,
        "tls_config": {"ca_file": str(sd.ca_file)},
        "authorization": {"credentials": sd.token},
    }
    if sd.namespaces:
        sd_config["namespaces"] = {"names": list(sd.namespaces)}
    return {
        "job_name": "batchpilot",
        "scrape_interval": scrape_interval,
        "scrape_timeout": scrape_interval,
        "metrics_path": endpoint.get("path", "/metrics"),
        "kubernetes_sd_configs": [sd_config],
        "relabel_configs": [
            {
                "action": "keep",
                "source_labels": [_label_meta(k) for k in match],
                "regex": ";".join(match.values()),
            },
            {
                "action": "keep",
                "source_labels": ["__meta_kubernetes_pod_container_port_name"],
                "regex": endpoint["port"],
            },
            *(_relabel(r) for r in endpoint.get("relabelings", [])),
        ],
        "metric_relabel_configs": [_relabel(r) for r in endpoint.get("metricRelabelings", [])],
    }


@dataclass(frozen=True)
class ScrapeTarget:
    """One scrape target: ``host:port`` (``/metrics``) and its target labels."""

    address: str
    labels: dict[str, str] = field(default_factory=dict)


class PrometheusServer:
    def __init__(
        self,
        workdir: Path,
        *,
        scrape_interval: str = "1s",
        port: int | None = None,
        kubernetes_sd: KubernetesSD | None = None,
    ) -> None:
        """``kubernetes_sd``: find the targets in the cluster (the PodMonitor's job) instead of
        the file :meth:`set_targets` writes."""
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.sd_file = workdir / "targets.json"
        self.config_file = workdir / "prometheus.yml"
        self.data_dir = workdir / "data"
        self.log_file = workdir / "prometheus.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.kubernetes_sd = kubernetes_sd
        self.set_targets([])
        job = (
            podmonitor_scrape_config(kubernetes_sd, scrape_interval)
            if kubernetes_sd
            else {
                "job_name": "batchpilot",
                "scrape_interval": scrape_interval,
                "scrape_timeout": scrape_interval,
                "file_sd_configs": [{"files": [str(self.sd_file)], "refresh_interval": "1s"}],
            }
        )
        self.config_file.write_text(
            json.dumps(  # JSON is YAML
                {
                    "global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval},
                    "scrape_configs": [job],
                },
                indent=2,
            )
        )

    # ------------------------------------------------------------------ targets

    def set_targets(self, targets: Sequence[ScrapeTarget]) -> None:
        """Replace the scrape targets (atomic rename: Prometheus never reads half a file)."""
        groups = [{"targets": [t.address], "labels": dict(t.labels)} for t in targets]
        tmp = self.sd_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(groups))
        os.replace(tmp, self.sd_file)

    # ------------------------------------------------------------------ lifecycle

    def start(self, timeout: float = 30.0) -> None:
        if self.process is not None and self.process.poll() is None:
            return
        log = self.log_file.open("ab")
        binary = str(UPSTREAM_PROMETHEUS_BIN) if self.kubernetes_sd else PROMETHEUS_BIN
        if self.kubernetes_sd and not UPSTREAM_PROMETHEUS_BIN.exists():
            raise RuntimeError(f"{UPSTREAM_PROMETHEUS_BIN} is missing: run hack/prometheus/build.sh")
        self.process = subprocess.Popen(
            [
                binary,
                f"--config.file={self.config_file}",
                f"--storage.tsdb.path={self.data_dir}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--storage.tsdb.retention.time=1h",
                "--log.level=warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"prometheus exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"prometheus not ready after {timeout}s:\n{self.log_tail()}")

    def stop(self, timeout: float = 15.0) -> None:
        proc, self.process = self.process, None
        if proc is not None:
            stop_process(proc, timeout)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    # ------------------------------------------------------------------ queries

    def query(self, promql: str, at: float | None = None) -> list[Any]:
        """Instant query (now, or at unix time ``at``); the ``data.result`` list (raises on HTTP errors)."""
        params = {"query": promql} if at is None else {"query": promql, "time": f"{at:.3f}"}
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(url, timeout=5) as resp:
            body = json.loads(resp.read())
        result: list[Any] = body["data"]["result"]
        return result

    def query_range(self, promql: str, start: float, end: float, step: float) -> list[Any]:
        """Range query (unix seconds); the ``data.result`` matrix."""
        params = {"query": promql, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step}"}
        url = f"{self.url}/api/v1/query_range?" + urllib.parse.urlencode(params)
        with urllib.request.urlopen(url, timeout=30) as resp:
            body = json.loads(resp.read())
        result: list[Any] = body["data"]["result"]
        return result

    def wait_for(
        self, promql: str, predicate: Callable[[list[Any]], bool], timeout: float = 30.0, poll: float = 0.25
    ) -> list[Any]:
        """Poll ``promql`` until ``predicate(result)`` holds; fail the test after ``timeout``."""
        deadline = time.monotonic() + timeout
        last: list[Any] = []
        while time.monotonic() < deadline:
            try:
                last = self.query(promql)
                if predicate(last):
                    return last
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(poll)
        raise AssertionError(f"{promql!r} did not satisfy the condition in {timeout}s; last {last}\n{self.log_tail()}")

    def wait_for_targets_up(self, count: int, timeout: float = 30.0) -> None:
        """Wait until ``count`` targets of the job were scraped successfully."""
        self.wait_for('up{job="batchpilot"} == 1', lambda r: len(r) >= count, timeout=timeout)


def start_prometheus(
    tmp_path: Path,
    targets: Sequence[ScrapeTarget] = (),
    *,
    scrape_interval: str = "1s",
    port: int | None = None,
    kubernetes_sd: KubernetesSD | None = None,
) -> PrometheusServer:
    """Start a real Prometheus scraping ``targets``, or the pods ``kubernetes_sd`` finds (the caller stops it)."""
    server = PrometheusServer(
        tmp_path / "prometheus", scrape_interval=scrape_interval, port=port, kubernetes_sd=kubernetes_sd
    )
    server.set_targets(targets)
    server.start()
    return server
