"""The model in its own process vs in the server's interpreter (issue 21, part 1).

    .venv/bin/python bench/model_isolation.py --out bench/results/model_isolation.json [--rounds 2]

For each isolation mode (``thread``: the model beside the aiohttp loop, as before;
``process``: ``batchpilot_runtime.modelproc``), in alternating rounds on the same machine:

* **idle forward passes**: the model handle the server would use (``LoadedModel`` or
  ``ModelProcess``), driven directly from this process with no HTTP traffic, at batch sizes
  1..max: p50 and p99 per size;
* **batch-1 latency at low load**: a fresh server, one request at a time (closed loop, 1
  outstanding), client-side p50/p99;
* **saturation**: closed loop with ``4 x max batch`` outstanding; rows/s against the model-only
  ceiling at the max batch size measured just before in this process (``benchlib.model_ceiling``);
* **forward passes at 85% of saturation**: a fresh server, open-loop Poisson at 0.85 x that
  mode's saturation rate (or ``--rate``, the same for both modes); the forward times the server
  recorded per batch size (``/admin/profile``, live batches), and p99/p50 at each size with
  enough samples, against the idle p99/p50 at the same size.

Targets (issue 21): loaded p99/p50 within 1.3x of idle p99/p50; saturation >= 0.9 of the
ceiling; batch-1 latency at low load no more than 10% worse than the thread mode.
Ratios are compared within one round (the machine is shared and noisy).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import (
    REPO,
    closed_loop,
    mlp_body,
    model_ceiling,
    open_loop,
    run_loadgen,
    start_runtime_server,
    stop_process,
    transformer_body,
)

sys.path.insert(0, str(REPO / "runtime"))

from batchpilot_runtime.config import ModelConfig, parse_duration

MODES = ("thread", "process")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def start(
    source: str, mode: str, max_batch: int, window: str, threads: int, tmp: Path
) -> tuple[subprocess.Popen[Any], str]:
    cfg = {
        "revision": f"iso-{mode}",
        "model": {"name": "m", "source": source, "device": "cpu", "threads": threads, "isolation": mode},
        "lanes": [
            {
                "name": "default", "maxBatchSize": max_batch, "maxQueueDelay": window,
                "maxQueueLength": 4096, "requestTimeout": "5s",
            }
        ],
        "drainTimeout": "10s",
    }  # fmt: skip
    return start_runtime_server(cfg, tmp, f"runtime-{mode}", threads)


def quantiles(xs: list[float]) -> dict[str, float]:
    a = np.sort(np.asarray(xs))
    p50, p99 = float(np.quantile(a, 0.5)), float(np.quantile(a, 0.99))
    return {"p50_ms": round(p50 * 1e3, 3), "p99_ms": round(p99 * 1e3, 3), "p99_over_p50": round(p99 / p50, 3)}


def idle_forward(source: str, mode: str, sizes: list[int], threads: int, seconds: float) -> dict[str, Any]:
    """The model handle the server would use, driven from here with nothing else running."""
    cfg = ModelConfig(name="m", source=source, device="cpu", threads=threads, isolation=mode)
    model: Any
    if mode == "process":
        from batchpilot_runtime.modelproc import ModelProcess

        model = ModelProcess(cfg, sizes)
    else:
        from batchpilot_runtime.models import LoadedModel

        model = LoadedModel(cfg)
        model.warmup(sizes)
    out: dict[str, Any] = {}
    try:
        rng = np.random.default_rng(0)
        for b in sizes:
            x = model.example(b)
            if x.dtype == np.int64:  # token ids
                x = rng.integers(0, 8192, x.shape).astype(np.int64)
            else:
                x = rng.standard_normal(x.shape).astype(x.dtype)
            ts: list[float] = []
            t_end = time.perf_counter() + seconds
            while time.perf_counter() < t_end or len(ts) < 200:
                t0 = time.perf_counter()
                model.run(x)
                ts.append(time.perf_counter() - t0)
            out[str(b)] = {**quantiles(ts), "samples": len(ts)}
    finally:
        model.close()
    return out


def noise_body() -> str:
    """A request the server must parse whole before it can refuse it (400): 64 x 512 numbers
    declared as a datatype the model does not take. A misbehaving client keeps the loop busy."""
    data = np.random.default_rng(0).standard_normal(64 * 512).round(4).tolist()
    return json.dumps({"inputs": [{"name": "input", "datatype": "FP16", "shape": [64, 512], "data": data}]})


def with_noise(url: str, workers: int, duration: float, run: Any) -> tuple[Any, dict[str, Any] | None]:
    """``run()`` while ``workers`` closed-loop clients send :func:`noise_body` to ``url``."""
    if workers <= 0:
        return run(), None
    import threading

    out: dict[str, Any] = {}
    spec = {
        "url": url, "body": noise_body(), "mode": "closed", "concurrency": workers,
        "duration": duration, "timeout": 10, "expect_status": 400,
    }  # fmt: skip
    t = threading.Thread(target=lambda: out.update(run_loadgen(spec)))
    t.start()
    try:
        result = run()
    finally:
        t.join()
    return result, {"workers": workers, "rejected_per_s": out.get("ok_per_s"), "errors": out.get("errors")}


def live_profile(base: str) -> dict[str, Any]:
    with urllib.request.urlopen(base + "/admin/profile", timeout=10) as r:
        doc = json.loads(r.read())
    out: dict[str, Any] = {}
    for p in doc["points"]:
        p50, p99 = parse_duration(p["p50"]), parse_duration(p["p99"])
        out[str(p["batchSize"])] = {
            "p50_ms": round(p50 * 1e3, 3), "p99_ms": round(p99 * 1e3, 3),
            "p99_over_p50": round(p99 / p50, 3), "samples": p["samples"],
        }  # fmt: skip
    return out


def one_mode(mode: str, args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    sizes = list(range(1, args.max_batch + 1))
    source = args.source
    body = transformer_body(1) if source == "builtin:transformer" else mlp_body(1)
    row: dict[str, Any] = {"mode": mode}
    log(f"{mode}: idle forward passes")
    row["idle_forward"] = idle_forward(source, mode, sizes, args.threads, args.idle_seconds)

    proc, base = start(source, mode, args.max_batch, args.window, args.threads, tmp)
    url = base + "/v2/models/m/infer"
    try:
        closed_loop(url, body, 1, 2.0)  # warm connections and allocator
        log(f"{mode}: batch-1 latency at low load")
        low = closed_loop(url, body, 1, args.duration)
        row["low_load"] = {"p50_ms": low["latency_ms"]["p50"], "p99_ms": low["latency_ms"]["p99"], "ok": low["ok"]}
        log(f"{mode}: saturation")
        ceiling = model_ceiling(source, [args.max_batch], args.threads, "cpu", 1.5)[str(args.max_batch)]
        sat = closed_loop(url, body, 4 * args.max_batch, args.duration)
        row["saturation"] = {
            "rows_per_s": sat["ok_per_s"], "errors": sat["errors"],
            "ceiling_rows_per_s_just_before": ceiling["rows_per_s"],
            "fraction_of_ceiling": round(sat["ok_per_s"] / ceiling["rows_per_s"], 3),
        }  # fmt: skip
    finally:
        stop_process(proc)

    # 85% of this mode's own saturation, or one rate for both modes (--rate: like for like)
    rate = args.rate or 0.85 * float(row["saturation"]["rows_per_s"])
    proc, base = start(source, mode, args.max_batch, args.window, args.threads, tmp)  # a fresh live profile
    url = base + "/v2/models/m/infer"
    try:
        log(f"{mode}: loaded phase at {rate:.0f}/s, {args.noise} noise clients")
        loaded, noise = with_noise(
            url, args.noise, args.duration, lambda: open_loop(url, body, "poisson", rate, args.duration)
        )
        forward = live_profile(base)
    finally:
        stop_process(proc)
    row["at_85pct"] = {
        "offered_rate": round(rate, 1),
        "client_p50_ms": loaded["latency_ms"]["p50"],
        "client_p99_ms": loaded["latency_ms"]["p99"],
        "errors": loaded.get("errors"),
        "noise": noise,
        "forward": forward,
    }
    # p99/p50 under load against idle, at every size with enough live batches
    spread: dict[str, float] = {}
    for size, live in forward.items():
        idle = row["idle_forward"].get(size)
        if idle is None or live["samples"] < args.min_batches:
            continue
        spread[size] = round(live["p99_over_p50"] / idle["p99_over_p50"], 3)
    row["loaded_spread_over_idle"] = spread
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--source", default="builtin:transformer", help="builtin:transformer or builtin:mlp")
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--window", default="2ms")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--duration", type=float, default=15.0)
    p.add_argument("--idle-seconds", type=float, default=1.5)
    p.add_argument("--min-batches", type=int, default=50)
    p.add_argument("--rate", type=float, default=None, help="req/s of the loaded phase for both modes")
    p.add_argument(
        "--noise", type=int, default=0, help="closed-loop clients sending big requests that are refused (400)"
    )
    args = p.parse_args()
    started = time.time()
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as d:
        for r in range(args.rounds):
            order = MODES if r % 2 == 0 else MODES[::-1]
            rows = {mode: one_mode(mode, args, Path(d)) for mode in order}
            t, pr = rows["thread"], rows["process"]
            rounds.append(
                {
                    "round": r + 1,
                    "rows": rows,
                    "process_vs_thread": {
                        "low_load_p50": round(pr["low_load"]["p50_ms"] / t["low_load"]["p50_ms"], 3),
                        "saturation": round(pr["saturation"]["rows_per_s"] / t["saturation"]["rows_per_s"], 3),
                    },
                }
            )
            log(json.dumps(rounds[-1]["process_vs_thread"]))
    doc = {
        "command": "bench/model_isolation.py " + " ".join(sys.argv[1:]),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "loadavg_1m_end": os.getloadavg()[0]},
        "model": args.source,
        "settings": {
            "max_batch": args.max_batch,
            "window": args.window,
            "threads": args.threads,
            "noise": args.noise,
            "rate": args.rate,
        },
        "targets": {
            "loaded_spread_over_idle_max": 1.3,
            "saturation_fraction_of_ceiling_min": 0.9,
            "low_load_p50_vs_thread_max": 1.1,
        },
        "rounds": rounds,
        "elapsed_s": round(time.time() - started, 1),
    }
    text = json.dumps(doc, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
