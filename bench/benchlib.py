"""Shared pieces of the runtime benchmarks: arrival schedules, the load generator, goodput search.

Arrival shapes
* ``poisson``: exponential inter-arrival gaps (seeded).
* ``trace``: the real Azure LLM code trace (../shared/traces/azure-llm-2023-code.csv, CC-BY 4.0,
  Patel et al., Splitwise, ISCA 2024). A trial at mean rate ``R`` replays the first
  ``TRACE_REQUESTS`` (1000) arrivals of the trace with every gap scaled by one constant so that
  the mean rate is exactly ``R``: the same bursts at every rate (gap CV about 11; 0.5% of the
  trial holds up to 77 arrivals, about 15x the mean rate), only faster or slower.

The load generator is ``bench/loadgen.mjs`` (Node.js): open loop, latency from the scheduled send
time, and it reports its own lag behind the schedule and its CPU use.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from batchpilot_localdev import free_port

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
TRACE = Path(os.environ.get("BATCHPILOT_TRACE", REPO.parent / "shared" / "traces" / "azure-llm-2023-code.csv"))
LOADGEN = BENCH / "loadgen.mjs"
SLO_MS = 50.0


_trace_gaps: np.ndarray[Any, Any] | None = None


def trace_gaps() -> np.ndarray[Any, Any]:
    global _trace_gaps
    if _trace_gaps is None:
        stamps = []
        for line in TRACE.read_text().splitlines()[1:]:
            text = line.split(",")[0].strip()
            if text:
                stamps.append(dt.datetime.fromisoformat(text[:26]).timestamp())
        gaps = np.diff(np.array(stamps))
        _trace_gaps = np.clip(gaps, 0.0, None)
    return _trace_gaps


TRACE_REQUESTS = 1000
"""Trace trials replay this many arrivals: the first ones of the trace, time-scaled."""


def schedule(shape: str, rate: float, duration: float, trace_requests: int = TRACE_REQUESTS) -> list[float]:
    """Send offsets (seconds from start) for one trial at mean ``rate`` requests/s.

    ``poisson``: ``rate * duration`` arrivals with exponential gaps (fixed seed).
    ``trace``: the first ``trace_requests`` arrivals of the real trace, every gap multiplied by one
    constant so that the mean rate is ``rate`` (the burst pattern is the same at every rate, only
    faster or slower; the trial lasts ``trace_requests / rate`` seconds).
    """
    if shape == "poisson":
        n = max(1, round(rate * duration))
        gaps = np.random.default_rng(1).exponential(1.0 / rate, n)
        offs = np.cumsum(gaps) - gaps[0]
    elif shape == "trace":
        g = trace_gaps()
        reps = int(np.ceil(trace_requests / len(g)))
        gaps = np.tile(g, reps)[: trace_requests - 1]
        scale = (trace_requests / rate) / float(gaps.sum())
        offs = np.concatenate([[0.0], np.cumsum(gaps) * scale])
    else:
        raise ValueError(shape)
    return [round(float(x), 6) for x in offs]


def onoff_arrivals(
    rate: float, duration: float, rng: random.Random, on_mean: float, off_mean: float, on_over_off: float
) -> list[float]:
    """ON/OFF-modulated Poisson arrivals with mean ``rate`` over ``duration`` seconds: exponential
    ON periods of mean ``on_mean`` seconds at ``on_over_off`` times the rate of exponential OFF
    periods of mean ``off_mean``, starting in either state by its share of time."""
    off_rate = rate * (on_mean + off_mean) / (on_over_off * on_mean + off_mean)
    on = rng.random() < on_mean / (on_mean + off_mean)
    t, out = 0.0, []
    while t < duration:
        span = rng.expovariate(1.0 / (on_mean if on else off_mean))
        r = off_rate * (on_over_off if on else 1.0)
        u = t
        while True:
            u += rng.expovariate(r)
            if u >= min(t + span, duration):
                break
            out.append(u)
        t += span
        on = not on
    return out


def loadgen_command() -> list[str]:
    """Node.js generator when ``node`` is on PATH (faster), else the Python one (BENCH_LOADGEN=python forces it)."""
    node = shutil.which("node")
    if node is not None and os.environ.get("BENCH_LOADGEN", "node") == "node":
        return [node, str(LOADGEN)]
    return [sys.executable, str(BENCH / "pyloadgen.py")]


def run_loadgen(spec: dict[str, Any]) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
        path = f.name
    try:
        out = subprocess.run([*loadgen_command(), path], capture_output=True, text=True, timeout=600, check=False)
    finally:
        os.unlink(path)
    if out.returncode != 0:
        raise RuntimeError(f"loadgen failed: {out.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


MIN_SAMPLES = 300
"""A trial lasts long enough for this many requests, so its p99 rests on more than a handful."""


def open_loop(
    url: str,
    body: str,
    shape: str,
    rate: float,
    duration: float,
    headers: dict[str, str] | None = None,
    min_samples: int = MIN_SAMPLES,
    trace_requests: int = TRACE_REQUESTS,
) -> dict[str, Any]:
    duration = max(duration, min(min_samples / rate, 30.0))
    offs = schedule(shape, rate, duration, trace_requests)
    res = run_loadgen(
        {"url": url, "body": body, "headers": headers or {}, "mode": "open", "offsets": offs, "timeout": 10}
    )
    res["offered_rate"] = rate
    res["shape"] = shape
    res["loadavg_1m_after"] = round(os.getloadavg()[0], 2)
    return res


def closed_loop(
    url: str, body: str, concurrency: int, duration: float, headers: dict[str, str] | None = None
) -> dict[str, Any]:
    return run_loadgen(
        {
            "url": url, "body": body, "headers": headers or {}, "mode": "closed",
            "concurrency": concurrency, "duration": duration, "timeout": 10,
        }
    )  # fmt: skip


def meets_slo(res: dict[str, Any], slo_ms: float = SLO_MS) -> bool:
    p99 = res.get("slo_p99_ms")
    return isinstance(p99, int | float) and p99 <= slo_ms and not res.get("hung")


def goodput_search(
    trial: Callable[[float], dict[str, Any]],
    start: float,
    max_trials: int,
    ratio: float = 1.08,
    floor: float = 2.0,
    ceiling: float = 1e5,
    deadline: float | None = None,
    confirm_failures: bool = False,
) -> dict[str, Any]:
    """Highest offered rate whose p99 (failures counted as infinite) stays within the SLO.

    The search never tries a rate above one that failed, so one unlucky trial caps it. With
    ``confirm_failures`` a failure is tried once more at the same rate before it counts (both
    trials are recorded; the second decides)."""
    trials: list[dict[str, Any]] = []
    lo: float | None = None
    hi: float | None = None
    rate = start

    def record(res: dict[str, Any], ok: bool, **extra: Any) -> None:
        trials.append(
            {
                "rate": round(rate, 1), "meets_slo": ok, "slo_p99_ms": res.get("slo_p99_ms"), **extra,
                "p50_ms": res["latency_ms"]["p50"], "ok": res["ok"], "errors": res["errors"],
                "send_lag_p99_ms": res["send_lag_ms"]["p99"], "generator_cpu_frac": res["generator_cpu_frac"],
                "machine_loadavg_1m": res.get("loadavg_1m_after"),
            }
        )  # fmt: skip

    while len(trials) < max_trials:
        if deadline is not None and time.monotonic() > deadline:
            break
        res = trial(rate)
        ok = meets_slo(res)
        if not ok and confirm_failures:
            record(res, ok, retried=True)
            print(
                f"    trial rate={rate:8.1f}/s  slo_p99={res.get('slo_p99_ms')} ms  failed: once more", file=sys.stderr
            )
            res = trial(rate)
            ok = meets_slo(res)
        record(res, ok)
        print(f"    trial rate={rate:8.1f}/s  slo_p99={res.get('slo_p99_ms')} ms  ok={ok}", file=sys.stderr)
        if ok:
            lo = rate
        else:
            hi = rate
        if lo is None:
            if rate <= floor:
                break
            rate = max(rate / 2, floor)
        elif hi is None:
            rate = rate * 1.6
            if rate > ceiling:
                break
        else:
            if hi / lo <= ratio:
                break
            rate = (lo * hi) ** 0.5
    return {"goodput_rps": round(lo, 1) if lo is not None else 0.0, "first_failing_rps": hi, "trials": trials}


def wait_http(url: str, timeout: float, proc: subprocess.Popen[Any] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before ready")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except (OSError, urllib.error.HTTPError):
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} not ready after {timeout}s")


def start_runtime_server(
    cfg: dict[str, Any],
    workdir: Path,
    name: str,
    threads: int = 1,
    env: dict[str, str | None] | None = None,
    ready_timeout: float = 300.0,
) -> tuple[subprocess.Popen[Any], str]:
    """The runtime (this checkout's) with config ``cfg`` on a free loopback port, in a session of
    its own, logging to ``workdir/<name>.log``; returns once ready: (process, base URL).
    ``env``: extra variables for the server (None removes one)."""
    port = free_port()
    path = workdir / f"{name}.json"
    path.write_text(json.dumps(cfg))
    server_env = dict(os.environ, PYTHONPATH=str(REPO / "runtime"), OMP_NUM_THREADS=str(threads))
    for key, value in (env or {}).items():
        if value is None:
            server_env.pop(key, None)
        else:
            server_env[key] = value
    with (workdir / f"{name}.log").open("a") as logf:
        proc = subprocess.Popen(
            [sys.executable, "-m", "batchpilot_runtime.server", "--config", str(path), "--port", str(port),
             "--log-level", "WARNING"],
            env=server_env, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        wait_http(base + "/v2/health/ready", ready_timeout, proc)
    except BaseException:
        stop_process(proc)
        raise
    return proc, base


def stop_process(proc: subprocess.Popen[Any], grace: float = 20.0) -> None:
    """SIGTERM the server itself (graceful), then its process group if it lingers."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace)
        return
    except subprocess.TimeoutExpired:
        pass
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(10)
            return
        except subprocess.TimeoutExpired:
            continue


def mlp_body(rows: int = 1, seed: int = 0) -> str:
    x = np.random.default_rng(seed).standard_normal((rows, 512)).astype(np.float32)
    doc = {"inputs": [{"name": "input", "datatype": "FP32", "shape": [rows, 512], "data": x.ravel().tolist()}]}
    return json.dumps(doc)


def transformer_body(rows: int = 1, seed: int = 0, seq: int = 64, vocab: int = 8192) -> str:
    ids = np.random.default_rng(seed).integers(0, vocab, (rows, seq))
    doc = {"inputs": [{"name": "input", "datatype": "INT64", "shape": [rows, seq], "data": ids.ravel().tolist()}]}
    return json.dumps(doc)


def model_ceiling(
    source: str, sizes: list[int], threads: int | None, device: str, seconds: float = 1.0
) -> dict[str, Any]:
    """Rows/s of a bare forward pass per batch size (no HTTP, no batcher), in this process."""
    import torch

    sys.path.insert(0, str(REPO / "runtime"))
    from batchpilot_runtime.config import ModelConfig
    from batchpilot_runtime.models import LoadedModel

    model = LoadedModel(ModelConfig(name="m", source=source, device=device, threads=threads))
    out: dict[str, Any] = {}
    for bs in sizes:
        x = model.example(bs)
        if source == "builtin:transformer":
            x = np.random.default_rng(0).integers(0, 8192, x.shape).astype(np.int64)
        else:
            x = np.random.default_rng(0).standard_normal(x.shape).astype(np.float32)
        for _ in range(3):
            model.run(x)
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        n = 0
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds or n < 3:
            model.run(x)  # includes host->device copy and the copy back, as the server does
            n += 1
        dt_s = (time.perf_counter() - t0) / n
        out[str(bs)] = {"ms_per_batch": round(dt_s * 1000, 3), "rows_per_s": round(bs / dt_s, 1)}
    return out


PIN_MODES = ("auto", "on", "split", "off")


def pin_for_bench(mode: str) -> str:
    """``--pin auto|on|split|off``: where the runtime under test and the load generator run; the
    layout chosen (``on``, ``split`` or ``off``), for the JSON. ``on``: the runtime's processes on
    the cores after the first, this process (and the load generators it starts) on core 0.
    ``split``: the runtime's model process alone on the cores after the first, its server process
    (the HTTP loop and the worker thread) on core 0 beside the load generator, so that no pass
    shares a core with the traffic, as a pod's passes do not on its accelerator. ``auto``: ``on``
    on 4 cores or more, ``split`` on 2 or 3 (``on`` would make the server and its model process
    share one core), ``off`` on 1. Apply it to each runtime with :func:`pin_runtime`."""
    cores = os.cpu_count() or 1
    layout = mode if mode != "auto" else "on" if cores >= 4 else "split" if cores >= 2 else "off"
    if layout not in ("on", "split", "off"):
        raise ValueError(f"--pin {mode}: one of {', '.join(PIN_MODES)}")
    if layout != "off":
        os.sched_setaffinity(0, {0})
    return layout


def pin_runtime(pid: int, layout: str) -> None:
    """Put a started runtime (its server ``pid`` and the model process under it) where ``layout``
    (from :func:`pin_for_bench`) says."""
    rest = list(range(1, os.cpu_count() or 1))
    if layout == "on":
        pin_process_tree(pid, rest)
    elif layout == "split":
        _taskset(str(pid), [0])
        for child in _children(pid):
            _taskset(child, rest)


def _children(pid: int) -> list[str]:
    return subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True, check=False).stdout.split()


def _taskset(pid: str, cores: list[int]) -> None:
    """Every thread of ``pid`` on ``cores``."""
    subprocess.run(["taskset", "-a", "-p", "-c", ",".join(map(str, cores)), pid], capture_output=True, check=False)


def pin_process_tree(pid: int, cores: list[int]) -> None:
    """The process ``pid`` and its children (the runtime's model process), every thread, on ``cores``."""
    for p in [str(pid), *_children(pid)]:
        _taskset(p, cores)
