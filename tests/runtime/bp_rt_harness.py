"""Helpers for the runtime tests: start a real server process, talk to it, read its metrics."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

from batchpilot_localdev import free_port
from batchpilot_localdev.processes import stop_process
from bptest import wait_until

HERE = Path(__file__).parent
REPO = HERE.parent.parent
PYTHON = sys.executable


def lane(name: str, max_batch: int, delay: str, queue: int, timeout: str, priority: int = 0) -> dict[str, Any]:
    return {
        "name": name,
        "maxBatchSize": max_batch,
        "maxQueueDelay": delay,
        "maxQueueLength": queue,
        "requestTimeout": timeout,
        "priority": priority,
    }


def wait_for(cond: Callable[[], Any], timeout: float = 20.0, what: str = "condition") -> Any:
    return wait_until(cond, timeout, what, interval=0.01)


async def await_for(cond: Callable[[], Any], limit: float = 20.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + limit
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {limit}s waiting for {what}")
        await asyncio.sleep(0.01)


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{([^}]*)\})?\s+(\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> list[tuple[str, dict[str, str], float]]:
    out = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        assert m, f"unparsable metrics line {line!r}"
        labels = dict(_LABEL.findall(m.group(2) or ""))
        out.append((m.group(1), labels, float(m.group(3))))
    return out


def fetch(request: str | urllib.request.Request) -> tuple[int, bytes]:
    """Send ``request`` (a URL: a GET); its status and body, an error's too."""
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


class Server:
    """A runtime server subprocess on 127.0.0.1 with the test models on its import path."""

    def __init__(
        self,
        tmp: Path,
        lanes: list[dict[str, Any]],
        source: str = "python:bp_rt_models:testmodel",
        gate: bool = False,
        extra: dict[str, Any] | None = None,
    ) -> None:
        self.tmp = tmp
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp / "batches.log"
        self.gate_path = tmp / "gate"
        cfg: dict[str, Any] = {
            "policy": "test",
            "revision": "rev-test",
            "model": {"name": "m", "source": source, "threads": 1},
            "lanes": lanes,
            "drainTimeout": "20s",
        }
        cfg.update(extra or {})
        self.config_path = tmp / "config.json"
        self.config_path.write_text(json.dumps(cfg))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(REPO / "runtime"), env.get("PYTHONPATH", "")])
        env["BP_TEST_LOG"] = str(self.log_path)
        env["BP_TEST_GATE"] = str(self.gate_path)
        self.nice_path = tmp / "model-thread-nice"
        env["BP_TEST_NICE"] = str(self.nice_path)
        env["OMP_NUM_THREADS"] = "1"
        self.stderr_path = tmp / "server.stderr"
        self._stderr = open(self.stderr_path, "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [PYTHON, "-m", "batchpilot_runtime.server", "--config", str(self.config_path),
             "--port", str(self.port), "--track", "canary"],
            env=env, stdout=self._stderr, stderr=subprocess.STDOUT,
        )  # fmt: skip
        wait_for(self._ready, 60, "server readiness")
        self.log_path.write_text("")  # forget warmup batches
        if gate:
            self.close_gate()

    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise AssertionError(f"server exited {self.proc.returncode}: {self.stderr_path.read_text()}")
        try:
            return self.get("/v2/health/ready")[0] == 200
        except OSError:
            return False

    def get(self, path: str) -> tuple[int, bytes]:
        return fetch(self.url + path)

    def metrics(self) -> list[tuple[str, dict[str, str], float]]:
        status, body = self.get("/metrics")
        assert status == 200
        return parse_metrics(body.decode())

    def metric(self, name: str, **labels: str) -> float:
        total = 0.0
        for n, lab, v in self.metrics():
            if n == name and all(lab.get(k) == val for k, val in labels.items()):
                total += v
        return total

    def batches(self) -> list[list[int]]:
        text = self.log_path.read_text()
        return [[int(v) for v in line.split(",")] for line in text.splitlines() if line]

    def close_gate(self) -> None:
        self.gate_path.write_text("closed")

    def open_gate(self) -> None:
        self.gate_path.unlink(missing_ok=True)

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def stop(self) -> None:
        self.open_gate()
        stop_process(self.proc, 20)
        self._stderr.close()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def rows(markers: list[float], width: int = 512) -> list[list[float]]:
    return [[float(m)] + [0.25] * (width - 1) for m in markers]


def body(markers: list[float], lane_param: str | None = None, rid: str | None = None) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "inputs": [{"name": "input", "datatype": "FP32", "shape": [len(markers), 512], "data": rows(markers)}]
    }
    if lane_param is not None:
        doc["parameters"] = {"lane": lane_param}
    if rid is not None:
        doc["id"] = rid
    return doc


async def infer(
    session: aiohttp.ClientSession,
    server: Server,
    payload: Any,
    lane_header: str | None = None,
    raw: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, Any]]:
    h = dict(headers or {})
    if lane_header is not None:
        h["X-Batchpilot-Lane"] = lane_header
    data = raw if raw is not None else json.dumps(payload).encode()
    async with session.post(f"{server.url}/v2/models/m/infer", data=data, headers=h) as resp:
        text = await resp.read()
        try:
            doc = json.loads(text)
        except ValueError:
            doc = {"raw": text.decode(errors="replace")}
        doc["_headers"] = dict(resp.headers)
        return resp.status, doc
