"""Runtime benchmark: model-only ceiling, goodput at a p99 SLO with and without batching, peers.

    .venv/bin/python bench/run_runtime_bench.py --out bench/results/runtime.json [--quick]

Prints one JSON document (and writes it to --out). Reference model: ``builtin:mlp``
(512 -> 4096 -> 4096 -> 512, 21M parameters) on CPU. Every request carries one row (512 FP32
values as Open Inference Protocol JSON). Load is open loop (bench/loadgen.mjs, Node.js),
Poisson and the real Azure trace time-scaled (see benchlib). Goodput = highest offered rate
whose p99 latency (measured from the scheduled send time; a failed request counts as
infinitely slow) is within 50 ms. Saturation = rows/s with a closed loop of
``4 x max batch`` outstanding requests. Peers (Ray Serve ``@serve.batch``, MLServer adaptive
batching) serve the same model, same weights and thread count, in their own venvs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import (
    REPO,
    SLO_MS,
    closed_loop,
    goodput_search,
    mlp_body,
    open_loop,
    start_runtime_server,
    stop_process,
)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def start_runtime(
    source: str, max_batch: int, window: str, threads: int, device: str, tmp: Path, queue: int = 4096
) -> tuple[subprocess.Popen[Any], str, str]:
    cfg = {
        "revision": f"bench-b{max_batch}",
        "model": {"name": "m", "source": source, "device": device, "threads": threads},
        "lanes": [
            {
                "name": "default", "maxBatchSize": max_batch, "maxQueueDelay": window,
                "maxQueueLength": queue, "requestTimeout": "5s",
            }
        ],
        "drainTimeout": "10s",
    }  # fmt: skip
    proc, base = start_runtime_server(cfg, tmp, f"runtime-b{max_batch}", threads)
    return proc, base + "/v2/models/m/infer", base + "/metrics"


def scrape_batches(metrics_url: str) -> dict[str, float]:
    import urllib.request

    with urllib.request.urlopen(metrics_url, timeout=5) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(("batchpilot_batch_size_rows_sum", "batchpilot_batch_size_rows_count")):
            name = line.split("{")[0]
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def measure(
    name: str,
    url: str,
    body: str,
    shapes: list[str],
    start_rate: float,
    duration: float,
    max_trials: int,
    saturation_concurrency: int | None,
    metrics_url: str | None = None,
    min_samples: int = 300,
    search_budget: float = 180.0,
    threads: int = 1,
) -> dict[str, Any]:
    entry: dict[str, Any] = {}
    # warm-up: JIT paths, connection pools, allocator
    open_loop(url, body, "poisson", max(start_rate / 4, 5), min(duration, 2.0), min_samples=0)
    for shape in shapes:
        log(f"  {name}: goodput search, {shape} arrivals")

        def trial(rate: float, shape: str = shape) -> dict[str, Any]:
            return open_loop(url, body, shape, rate, duration, min_samples=min_samples)

        entry[f"goodput_{shape}"] = goodput_search(
            trial, start_rate, max_trials, floor=8.0, deadline=time.monotonic() + search_budget
        )
        # bursts make the trace much harder than Poisson: start the next search lower
        start_rate = max(entry[f"goodput_{shape}"]["goodput_rps"] * (0.4 if shape == "poisson" else 1.0), 8.0)
    if saturation_concurrency:
        log(f"  {name}: saturation, closed loop x{saturation_concurrency}")
        b = saturation_concurrency // 4
        ceiling_now = measure_ceiling([b], threads, 1.5)[str(b)]["rows_per_s"]
        before = scrape_batches(metrics_url) if metrics_url else {}
        sat = closed_loop(url, body, saturation_concurrency, duration)
        entry["saturation"] = {
            "concurrency": saturation_concurrency, "rows_per_s": sat["ok_per_s"], "errors": sat["errors"],
            "p50_ms": sat["latency_ms"]["p50"], "p99_ms": sat["latency_ms"]["p99"],
            "generator_cpu_frac": sat["generator_cpu_frac"],
            "ceiling_rows_per_s_just_before": ceiling_now,
            "fraction_of_ceiling_just_before": round(sat["ok_per_s"] / ceiling_now, 3),
            "machine_loadavg_1m": round(os.getloadavg()[0], 2),
        }  # fmt: skip
        if metrics_url:
            after = scrape_batches(metrics_url)
            n = after.get("batchpilot_batch_size_rows_count", 0) - before.get("batchpilot_batch_size_rows_count", 0)
            s = after.get("batchpilot_batch_size_rows_sum", 0) - before.get("batchpilot_batch_size_rows_sum", 0)
            entry["saturation"]["mean_batch_rows"] = round(s / n, 2) if n else None
    return entry


def measure_ceiling(sizes: list[int], threads: int, seconds: float) -> dict[str, Any]:
    """Bare forward pass rows/s per batch size, in a fresh process with the server's thread settings."""
    cmd = [
        sys.executable, "-c",
        "import json,sys; sys.path.insert(0, sys.argv[1]); from benchlib import model_ceiling; "
        "print(json.dumps(model_ceiling('builtin:mlp', json.loads(sys.argv[2]), int(sys.argv[3]), 'cpu', "
        "float(sys.argv[4]))))",
        str(Path(__file__).resolve().parent), json.dumps(sizes), str(threads), str(seconds),
    ]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    out: dict[str, Any] = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True, env=env).stdout)
    return out


def checkpoint(out: str, partial: dict[str, Any]) -> None:
    """Partial results survive an interrupted run."""
    path = Path(out).with_suffix(".partial.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(partial, indent=2) + "\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "runtime.json"))
    p.add_argument("--quick", action="store_true", help="short trials, fewer steps (development)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (server, ceiling, peers)")
    p.add_argument("--batch-sizes", default="16,32", help="max batch sizes to try for the batching server")
    p.add_argument("--window", default="2ms", help="batching window (maxQueueDelay) for the batching server")
    p.add_argument("--peers", default="ray,mlserver", help="comma list of ray,mlserver; empty for none")
    p.add_argument("--shapes", default="poisson,trace")
    p.add_argument("--duration", type=float, default=None, help="seconds per trial")
    args = p.parse_args()
    # SIGTERM unwinds like Ctrl-C, so the servers started here are stopped by the finally blocks.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    duration = args.duration or (3.0 if args.quick else 8.0)
    max_trials = 5 if args.quick else 8
    min_samples = 150 if args.quick else 300
    search_budget = 60.0 if args.quick else 180.0
    shapes = [s for s in args.shapes.split(",") if s]
    sizes = [int(s) for s in args.batch_sizes.split(",") if s]
    peers = [s for s in args.peers.split(",") if s]
    body = mlp_body()
    tmp = Path(tempfile.mkdtemp(prefix="bp-bench-"))
    t_start = time.time()

    result: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "loadavg_at_start": os.getloadavg()},
        "model": "builtin:mlp (512-4096-4096-512, 20,980,224 params, FP32, CPU)",
        "threads": args.threads,
        "slo": {"p99_ms": SLO_MS, "note": "p99 from scheduled send time; failed requests count as infinitely slow"},
        "trial_seconds": duration,
        "request": "1 row per request, OIP v2 JSON, 512 FP32 values",
        "quick": args.quick,
    }  # fmt: skip

    log("model-only ceiling")
    ceiling_sizes = sorted({1, 2, 4, 8, 16, 32, 64, *sizes})
    ceiling = measure_ceiling(ceiling_sizes, args.threads, 0.5 if args.quick else 1.5)
    result["ceiling"] = ceiling
    log(f"  {json.dumps(ceiling)}")

    runs: dict[str, Any] = {}
    configs = [(f"batchpilot_b{b}", b, args.window) for b in sizes] + [("batchpilot_b1", 1, "0s")]
    for name, b, window in configs:
        log(f"{name}: starting server (maxBatchSize {b}, window {window})")
        proc, url, metrics_url = start_runtime("builtin:mlp", b, window, args.threads, "cpu", tmp)
        try:
            start = 120.0 if b == 1 else 0.5 * ceiling[str(b)]["rows_per_s"]
            entry = measure(
                name,
                url,
                body,
                shapes,
                start,
                duration,
                max_trials,
                4 * b,
                metrics_url,
                min_samples,
                search_budget,
                args.threads,
            )
            entry["config"] = {"max_batch_size": b, "window": window, "max_queue_length": 4096}
            if "saturation" in entry:
                entry["saturation"]["fraction_of_ceiling"] = round(
                    entry["saturation"]["rows_per_s"] / ceiling[str(b)]["rows_per_s"], 3
                )
            runs[name] = entry
        finally:
            stop_process(proc)
        checkpoint(args.out, {**result, "batchpilot": runs})
    result["batchpilot"] = runs

    peer_runs: dict[str, Any] = {}
    if peers:
        from peer_servers import STARTERS

        best_b = max(sizes, key=lambda b: runs[f"batchpilot_b{b}"][f"goodput_{shapes[0]}"]["goodput_rps"])
        wait_s = float(args.window.rstrip("ms")) / 1000 if args.window.endswith("ms") else 0.002
        for peer in peers:
            log(f"peer {peer}: installing/starting (max batch {best_b}, wait {wait_s}s)")
            try:
                proc, url = STARTERS[peer](best_b, wait_s, args.threads, tmp / f"{peer}.log")
            except Exception as exc:
                peer_runs[peer] = {"error": f"{type(exc).__name__}: {exc}"}
                log(f"  {peer} failed to start: {exc}")
                continue
            try:
                entry = measure(
                    peer,
                    url,
                    body,
                    shapes,
                    100.0,
                    duration,
                    max_trials,
                    4 * best_b,
                    None,
                    min_samples,
                    search_budget,
                    args.threads,
                )
                entry["config"] = {"max_batch_size": best_b, "batch_wait_s": wait_s}
                entry["saturation"]["fraction_of_ceiling"] = round(
                    entry["saturation"]["rows_per_s"] / ceiling[str(best_b)]["rows_per_s"], 3
                )
                peer_runs[peer] = entry
            except Exception as exc:
                peer_runs[peer] = {"error": f"{type(exc).__name__}: {exc}"}
            finally:
                stop_process(proc, grace=30)
            checkpoint(args.out, {**result, "batchpilot": runs, "peers": peer_runs})
    result["peers"] = peer_runs

    # Summary
    summary: dict[str, Any] = {}
    b1 = runs["batchpilot_b1"]
    for shape in shapes:
        best_name = max(
            (n for n in runs if n != "batchpilot_b1"), key=lambda n: runs[n][f"goodput_{shape}"]["goodput_rps"]
        )
        best = runs[best_name][f"goodput_{shape}"]["goodput_rps"]
        one = b1[f"goodput_{shape}"]["goodput_rps"]
        peer_best = max(
            (v[f"goodput_{shape}"]["goodput_rps"] for v in peer_runs.values() if f"goodput_{shape}" in v),
            default=None,
        )
        # a goodput of 0 means even the lowest rate tried failed: its ratio is a lower bound
        one_fail = b1[f"goodput_{shape}"]["first_failing_rps"]
        peer_fail = max(
            (v[f"goodput_{shape}"]["first_failing_rps"] or 1e9 for v in peer_runs.values()
             if f"goodput_{shape}" in v and not v[f"goodput_{shape}"]["goodput_rps"]),
            default=None,
        )  # fmt: skip
        summary[shape] = {
            "batching_goodput_rps": best, "batching_config": best_name, "batch1_goodput_rps": one,
            "batching_over_batch1": round(best / one, 2) if one else
            (f">= {best / one_fail:.2f} (batch-1 failed the SLO at every rate down to {one_fail}/s)"
             if one_fail else None),
            "best_peer_goodput_rps": peer_best,
            "batching_over_best_peer": round(best / peer_best, 2) if peer_best else
            (f">= {best / peer_fail:.2f} (every peer failed the SLO down to {peer_fail}/s)" if peer_fail else None),
        }  # fmt: skip
    # vs the ceiling measured right before the saturation run (same machine load), and vs the start ceiling
    sat = {
        n: {
            "vs_ceiling_just_before": runs[n]["saturation"]["fraction_of_ceiling_just_before"],
            "vs_ceiling_at_start": runs[n]["saturation"]["fraction_of_ceiling"],
        }
        for n in runs
        if "saturation" in runs[n]
    }
    summary["saturation_fraction_of_ceiling"] = sat
    summary["targets"] = {
        "batching_over_batch1 >= 8": {s: summary[s]["batching_over_batch1"] for s in shapes},
        "batching_over_best_peer >= 5": {s: summary[s]["batching_over_best_peer"] for s in shapes},
        "saturation >= 0.70 of ceiling": sat,
    }
    result["summary"] = summary
    result["elapsed_s"] = round(time.time() - t_start, 1)
    text = json.dumps(result, indent=2)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text + "\n")
    Path(args.out).with_suffix(".partial.json").unlink(missing_ok=True)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
