"""Cost of the runtime's arrival capture: memory, per-request time, and saturation throughput A/B.

    .venv/bin/python bench/capture_overhead.py [--rounds 3] [--duration 6] [--out F]

* memory: bytes of the rings of a runtime with the default bounds (measured with
  tracemalloc around building a ``Capture``, and as the rings' own buffer sizes);
* per request: ns per ``Capture.record`` call (at admission) plus per ``Capture.record_outcome``
  call (at the answer): what the event loop does per admitted request, timed over 10^6 calls
  each, next to ns per a bare loop iteration;
* saturation A/B: the same runtime (``builtin:tiny-mlp``, the cheapest model, so per-request
  overhead weighs most; max batch 16, 1 torch thread) with capture off
  (``BATCHPILOT_ARRIVAL_CAPACITY=0``) and on (default bounds), closed loop at 64 outstanding
  requests (bench/loadgen.mjs). Rounds alternate off/on/off/on... in fresh processes, so drift
  in the machine's load hits both alike; each round records the 1-minute load average.

Prints one JSON document (also written to --out).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchlib import REPO, closed_loop, mlp_body, start_runtime_server, stop_process

sys.path.insert(0, str(REPO / "runtime"))

from batchpilot_runtime.capture import DEFAULT_CAPACITY, DEFAULT_MAX_AGE, Capture
from batchpilot_runtime.config import RuntimeConfig


def config(max_batch: int) -> dict[str, Any]:
    return {
        "revision": "capture-bench",
        "model": {"name": "m", "source": "builtin:tiny-mlp", "device": "cpu", "threads": 1},
        "lanes": [
            {"name": "default", "maxBatchSize": max_batch, "maxQueueDelay": "1ms", "maxQueueLength": 4096,
             "requestTimeout": "5s"}
        ],
        "drainTimeout": "10s",
    }  # fmt: skip


def memory_and_cost() -> dict[str, Any]:
    cfg = RuntimeConfig.model_validate(config(16))
    tracemalloc.start()
    snap0 = tracemalloc.take_snapshot()
    cap = Capture(cfg, "stable")
    snap1 = tracemalloc.take_snapshot()
    tracemalloc.stop()
    traced = sum(s.size_diff for s in snap1.compare_to(snap0, "filename"))
    n = 1_000_000
    record = cap.record
    t0 = time.perf_counter()
    for k in range(n):
        record(0, float(k), 1)
    per_call = (time.perf_counter() - t0) / n
    outcome = cap.record_outcome
    t0 = time.perf_counter()
    for k in range(n):
        outcome(0, float(k), 0.01, 0.002, 0.005, 0.0003)  # latency, queue wait, pass, hand-off
    per_outcome = (time.perf_counter() - t0) / n
    t0 = time.perf_counter()
    for _k in range(n):
        pass
    per_iter = (time.perf_counter() - t0) / n
    return {
        "ring_capacity_per_lane": DEFAULT_CAPACITY,
        "ring_max_age_s": DEFAULT_MAX_AGE,
        "ring_bytes_per_lane": cap.nbytes,
        "tracemalloc_bytes_for_capture_of_1_lane": traced,
        # Per admitted request: its arrival (at admission) and its outcome (at the answer).
        "record_ns_per_request": round((per_call + per_outcome - 2 * per_iter) * 1e9, 1),
        "record_arrival_ns": round((per_call - per_iter) * 1e9, 1),
        "record_outcome_ns": round((per_outcome - per_iter) * 1e9, 1),
        "bare_loop_ns_per_iteration": round(per_iter * 1e9, 1),
    }


def process_cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


def run_round(capture_on: bool, duration: float, concurrency: int, tmp: Path, body: str) -> dict[str, Any]:
    # capture off: a ring of 0 arrivals; on: the default ring (the variable unset)
    capacity = None if capture_on else "0"
    proc, base = start_runtime_server(
        config(16), tmp, f"runtime-{'on' if capture_on else 'off'}", 1, {"BATCHPILOT_ARRIVAL_CAPACITY": capacity}
    )
    try:
        url = base + "/v2/models/m/infer"
        closed_loop(url, body, concurrency, 1.5)  # warm-up
        cpu0 = process_cpu_seconds(proc.pid)
        res = closed_loop(url, body, concurrency, duration)
        cpu1 = process_cpu_seconds(proc.pid)
        held = None
        if capture_on:
            import urllib.request

            with urllib.request.urlopen(base + "/admin/arrivals", timeout=10) as r:
                doc = json.loads(r.read())
            held = doc["lanes"][0]["held"]
    finally:
        stop_process(proc)
    return {
        "capture": "on" if capture_on else "off",
        "rows_per_s": res["ok_per_s"],
        # Server CPU per request: less sensitive than throughput to the other tenants' load.
        "server_cpu_us_per_request": round((cpu1 - cpu0) / max(1, res["ok"]) * 1e6, 2),
        "errors": res["errors"],
        "p50_ms": res["latency_ms"]["p50"],
        "p99_ms": res["latency_ms"]["p99"],
        "generator_cpu_frac": res["generator_cpu_frac"],
        "arrivals_held": held,
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3, help="off/on pairs")
    p.add_argument("--duration", type=float, default=6.0, help="seconds per measurement")
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "capture_overhead.json"))
    args = p.parse_args()
    result: dict[str, Any] = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "loadavg_at_start": os.getloadavg()},
        "model": "builtin:tiny-mlp, max batch 16, window 1ms, 1 torch thread, 1 row per request",
    }
    result["micro"] = memory_and_cost()
    body = mlp_body()
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bp-capture-") as d:
        for _ in range(args.rounds):
            for capture_on in (False, True):
                r = run_round(capture_on, args.duration, args.concurrency, Path(d), body)
                print(json.dumps(r), file=sys.stderr, flush=True)
                rounds.append(r)
    off = [r["rows_per_s"] for r in rounds if r["capture"] == "off"]
    on = [r["rows_per_s"] for r in rounds if r["capture"] == "on"]
    pairs = [b / a - 1 for a, b in zip(off, on, strict=True)]
    cpu_off = [r["server_cpu_us_per_request"] for r in rounds if r["capture"] == "off"]
    cpu_on = [r["server_cpu_us_per_request"] for r in rounds if r["capture"] == "on"]
    result["rounds"] = rounds
    result["saturation"] = {
        "off_rows_per_s_median": statistics.median(off),
        "on_rows_per_s_median": statistics.median(on),
        "change_of_medians": round(statistics.median(on) / statistics.median(off) - 1, 4),
        "paired_changes": [round(x, 4) for x in pairs],
        "paired_change_median": round(statistics.median(pairs), 4),
        "within_2_percent": abs(statistics.median(pairs)) <= 0.02,
        "server_cpu_us_per_request_off_median": statistics.median(cpu_off),
        "server_cpu_us_per_request_on_median": statistics.median(cpu_on),
        "cpu_per_request_change_of_medians": round(statistics.median(cpu_on) / statistics.median(cpu_off) - 1, 4),
        "record_share_of_server_cpu_per_request": round(
            result["micro"]["record_ns_per_request"] / 1e3 / statistics.median(cpu_off), 5
        ),
    }
    result["machine"]["loadavg_at_end"] = os.getloadavg()
    text = json.dumps(result, indent=2)
    print(text)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
