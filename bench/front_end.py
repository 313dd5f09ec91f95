"""The pod's HTTP front end: its CPU per request, and the time requests wait before the handler.

The simulator queues every request through the pod's HTTP loop at ``frontEndCost`` (the CPU
seconds its server process spends per request beyond its idle rate, which the runtime measures on
itself and states in ``/admin/profile``). This measures, on this machine:

1. **cost**: for each ``--floods`` setting B (``maxBatchSize``), a fresh runtime under a closed
   loop of ``2 B`` (and of 8) clients for a few seconds; the server process's CPU from
   ``/proc/<pid>/stat`` against the requests served, beyond its idle rate measured just before
   (the CPU per request at that batch fill: per-request and per-batch costs together), beside
   the runtime's own ``frontEndCost`` after the flood (its per-request part alone, split from
   the per-batch part over windows of different batch fill: the warm-up's batches of one and the
   flood's);
2. **wait before the handler**: for each ``--replays`` row (B, window, rate), a fresh runtime
   serves the code trace slice (the latency grid's: 600 arrivals from the 2000th) open-loop; the
   handler start times the runtime recorded (``/admin/arrivals``) against the scheduled send
   times give each request's wait before the handler (relative to the first request's; the
   load generator's lateness is in it, and its own send-lag p99 is beside it), against the FIFO
   model of the loop at the cost the runtime measured over the warm-up and the replay
   (:func:`front_end`). With ``--nice``
   ``10,0`` every row runs with the loop at each niceness (``BATCHPILOT_LOOP_NICE``; 10 is the
   default, below the model process).

Usage: .venv/bin/python bench/front_end.py --out bench/results/front_end.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import benchlib  # noqa: E402
import latency_model_grid as grid  # noqa: E402
import tune_validation as tv  # noqa: E402
from batchpilot_operator.tune.simulator import LaneSettings, front_end  # noqa: E402
from batchpilot_runtime.config import parse_duration  # noqa: E402


def log(msg: str) -> None:
    print(f"[front_end {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def process_cpu(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def flood(tmp: Path, b: int, seconds: float, body: str) -> list[dict[str, Any]]:
    rt = tv.Runtime(tmp, "builtin:mlp", 1, LaneSettings(b, 0.002, 100_000, 30.0))
    rows = []
    try:
        tv.replay(rt, [k * 0.02 for k in range(50)], body)
        time.sleep(1.0)
        c0, t0 = process_cpu(rt.proc.pid), time.monotonic()
        time.sleep(3.0)
        idle = (process_cpu(rt.proc.pid) - c0) / (time.monotonic() - t0)
        for clients in (2 * b, 8):
            c0, t0 = process_cpu(rt.proc.pid), time.monotonic()
            res = benchlib.closed_loop(rt.infer_url, body, max(4, clients), seconds)
            wall = time.monotonic() - t0
            cpu = process_cpu(rt.proc.pid) - c0
            served = res["ok_per_s"] * res["wall_s"]
            time.sleep(1.1)  # past the runtime's window, so the read below closes the busy one
            stated = tv.fetch_json(f"{rt.url}/admin/profile").get("frontEndCost")
            rows.append(
                {
                    "maxBatchSize": b,
                    "clients": max(4, clients),
                    "ok_per_s": res["ok_per_s"],
                    "server_cpu_per_s": round(cpu / wall, 3),
                    "idle_cpu_per_s": round(idle, 4),
                    "cpu_per_request_ms": round(1e3 * (cpu - idle * wall) / max(served, 1), 4),
                    "runtime_front_end_cost": stated,
                    "generator_cpu_frac": res.get("generator_cpu_frac"),
                }
            )
            log(f"flood B={b}: {rows[-1]}")
    finally:
        rt.stop()
    return rows


def replay_row(tmp: Path, b: int, window: float, rate: float, offsets: list[float], body: str) -> dict[str, Any]:
    rt = tv.Runtime(tmp, "builtin:mlp", 1, LaneSettings(b, window, 100_000, 30.0))
    try:
        tv.replay(rt, [k * 0.02 for k in range(300)], body)  # warm-up: batches of one
        started = time.time()
        res = tv.replay(rt, [round(t, 6) for t in offsets], body)
        doc = tv.fetch_json(f"{rt.url}/admin/arrivals?since={time.time() - started + 0.5:.1f}s")
        time.sleep(1.1)  # past the runtime's window: the read below closes the replay's last one
        cost_text = tv.fetch_json(f"{rt.url}/admin/profile").get("frontEndCost")
    finally:
        rt.stop()
    lane = doc["lanes"][0]
    handled = sorted(lane["times"])[-len(offsets) :]
    outcomes = [x for x in lane["outcomes"]["latency"][-len(offsets) :] if x >= 0]
    waits = [(handled[i] - handled[0]) - (offsets[i] - offsets[0]) for i in range(len(offsets))]
    cost = parse_duration(cost_text) if isinstance(cost_text, str) else 0.0
    fifo = front_end(offsets, cost)
    modelled = [fifo[i] - offsets[i] for i in range(len(offsets))]
    return {
        "maxBatchSize": b,
        "window_ms": window * 1e3,
        "rate_rps": rate,
        "front_end_cost": cost_text,
        "client_p99_ms": res["slo_p99_ms"],
        "server_p99_ms": round(1e3 * quantile(outcomes, 0.99), 2) if outcomes else None,
        "send_lag_p99_ms": res["send_lag_ms"]["p99"],
        "generator_cpu_frac": res.get("generator_cpu_frac"),
        "wait_before_handler_ms": {
            "p50": round(1e3 * statistics.median(waits), 2),
            "p99": round(1e3 * quantile(waits, 0.99), 2),
        },
        "fifo_model_wait_ms": {
            "p50": round(1e3 * statistics.median(modelled), 2),
            "p99": round(1e3 * quantile(modelled, 0.99), 2),
        },
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--floods", default="1,16,64", help="maxBatchSize of each flood")
    ap.add_argument("--flood-seconds", type=float, default=5.0)
    ap.add_argument("--replays", default="64:20ms:1000,32:10ms:709,16:5ms:459", help="B:window:rate,...")
    ap.add_argument("--nice", default="10,0", help="loop niceness per replay run (BATCHPILOT_LOOP_NICE)")
    ap.add_argument("--out")
    args = ap.parse_args()
    started = time.time()
    body = benchlib.mlp_body(1)
    code = grid.traces(600, 2000)["code"]
    out: dict[str, Any] = {
        "command": " ".join(sys.argv),
        "machine": {"cores": os.cpu_count()},
        "floods": [],
        "replays": [],
    }
    with tempfile.TemporaryDirectory(prefix="bp-front-end-") as tmpdir:
        tmp = Path(tmpdir)
        for b in [int(x) for x in args.floods.split(",")]:
            out["floods"] += flood(tmp, b, args.flood_seconds, body)
        for nice in args.nice.split(","):
            os.environ["BATCHPILOT_LOOP_NICE"] = nice
            for spec in args.replays.split(","):
                b, w, rate = spec.split(":")
                row = replay_row(tmp, int(b), parse_duration(w), float(rate), code.scaled_arrivals(float(rate)), body)
                row["loop_nice"] = int(nice)
                out["replays"].append(row)
                log(f"replay {spec} nice {nice}: {row}")
    out["elapsed_s"] = round(time.time() - started, 1)
    out["loadavg_1m_end"] = round(os.getloadavg()[0], 2)
    text = json.dumps(out, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
