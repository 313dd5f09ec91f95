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

from batchpilot_operator.localdev import free_port

PROMETHEUS_BIN = shutil.which("prometheus") or "/usr/bin/prometheus"


@dataclass(frozen=True)
class ScrapeTarget:
    """One scrape target: ``host:port`` (``/metrics``) and its target labels."""

    address: str
    labels: dict[str, str] = field(default_factory=dict)


class PrometheusServer:
    def __init__(self, workdir: Path, *, scrape_interval: str = "1s", port: int | None = None) -> None:
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.sd_file = workdir / "targets.json"
        self.config_file = workdir / "prometheus.yml"
        self.data_dir = workdir / "data"
        self.log_file = workdir / "prometheus.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.set_targets([])
        self.config_file.write_text(
            json.dumps(  # JSON is YAML
                {
                    "global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval},
                    "scrape_configs": [
                        {
                            "job_name": "batchpilot",
                            "scrape_interval": scrape_interval,
                            "scrape_timeout": scrape_interval,
                            "file_sd_configs": [{"files": [str(self.sd_file)], "refresh_interval": "1s"}],
                        }
                    ],
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
        self.process = subprocess.Popen(
            [
                PROMETHEUS_BIN,
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
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout)

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    # ------------------------------------------------------------------ queries

    def query(self, promql: str) -> list[Any]:
        """Instant query; the ``data.result`` list (raises on HTTP errors)."""
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
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
) -> PrometheusServer:
    """Start a real Prometheus scraping ``targets`` (the caller stops it)."""
    server = PrometheusServer(tmp_path / "prometheus", scrape_interval=scrape_interval, port=port)
    server.set_targets(targets)
    server.start()
    return server
