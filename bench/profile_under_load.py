"""Service time as the pods see it: /admin/profile under load against an isolated profile.

The tuner's predictions rest on the forward time per batch size. In production it comes from
the pods (``/admin/profile``: warm-up passes timed in the model's own process and the last 256
live batches per size, timed by the server's worker around its round trip to that process);
offline from ``batchpilot profile``. If the pods' figure under
load drifted from the isolated one (the model sharing cores with the HTTP loop), every
prediction made from either would be off. This measures how far, on this machine:

1. an isolated profile, twice (``batchpilot profile``'s measurement in this process, nothing
   else running, 10 ms idle before each pass as its default ``--gap``): the second run against
   the first is the noise floor; and once hot (``--gap 0``: passes back to back, as a busy pod
   runs them);
2. for each ``--batch`` B: a runtime with ``maxBatchSize`` B serves a closed loop for a few
   seconds (its saturation throughput), then Poisson arrivals at ``--load`` (85%) of it for
   ``--seconds``; then its ``/admin/profile``;
3. per batch size the runtime measured from live batches (at least ``--min-samples``) and the
   isolated profile also has: the ratio of p50 and of p99, live / isolated, against each.

Target (issue 21, part 3): within 15% (ratios in 0.85..1.15) for p50 and p99.

Usage: .venv/bin/python bench/profile_under_load.py --out bench/results/profile_under_load.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import benchlib  # noqa: E402
import tune_validation as tv  # noqa: E402
from batchpilot_operator.tune.profile import LatencyProfile  # noqa: E402

SIZES = [1, 2, 4, 8, 16, 32]


def log(msg: str) -> None:
    print(f"[profile_under_load {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def points(profile: LatencyProfile) -> dict[int, dict[str, float]]:
    return {p.batch_size: {"p50": p.p50, "p99": p.p99, "samples": float(p.samples or 0)} for p in profile.points}


def compare(
    live: dict[int, dict[str, float]], ref: dict[int, dict[str, float]], min_samples: int
) -> list[dict[str, Any]]:
    rows = []
    for size in sorted(set(live) & set(ref)):
        if live[size]["samples"] < min_samples:
            continue
        rows.append(
            {
                "batch_size": size,
                "samples": int(live[size]["samples"]),
                "p50_ms": [round(live[size]["p50"] * 1e3, 3), round(ref[size]["p50"] * 1e3, 3)],
                "p99_ms": [round(live[size]["p99"] * 1e3, 3), round(ref[size]["p99"] * 1e3, 3)],
                "p50_ratio": round(live[size]["p50"] / ref[size]["p50"], 3),
                "p99_ratio": round(live[size]["p99"] / ref[size]["p99"], 3),
            }
        )
    return rows


def within(rows: list[dict[str, Any]], tol: float = 0.15) -> dict[str, Any]:
    ok = [r for r in rows if abs(r["p50_ratio"] - 1) <= tol and abs(r["p99_ratio"] - 1) <= tol]
    return {"points": len(rows), "within_15pct": len(ok)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", default="builtin:mlp")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--batch", default="1,8,32", help="maxBatchSize of each loaded runtime")
    ap.add_argument("--load", type=float, default=0.85, help="fraction of the runtime's saturation throughput")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--iterations", type=int, default=200, help="isolated passes per batch size")
    ap.add_argument("--min-samples", type=int, default=50)
    ap.add_argument("--out")
    args = ap.parse_args()

    log("isolated profile, twice")
    iso = [tv.measure_profile(args.source, args.threads, SIZES, args.iterations) for _ in range(2)]
    hot = tv.measure_profile(args.source, args.threads, SIZES, args.iterations, gap=0.0)
    ref = points(iso[0])
    floor = compare(points(iso[1]), ref, 0)
    body = benchlib.mlp_body(1)
    runs = []
    with tempfile.TemporaryDirectory(prefix="bp-profile-load-") as tmpdir:
        tmp = Path(tmpdir)
        for b in [int(x) for x in args.batch.split(",")]:
            cfg = {
                "policy": "profile-under-load",
                "revision": f"b{b}",
                "model": {"name": "mlp", "source": args.source, "device": "cpu", "threads": args.threads},
                "lanes": [{"name": "interactive", "maxBatchSize": b, "maxQueueDelay": "2ms",
                           "maxQueueLength": 100_000, "requestTimeout": "30s"}],
            }  # fmt: skip
            proc, base = benchlib.start_runtime_server(cfg, tmp, f"b{b}", args.threads)
            url = f"{base}/v2/models/mlp/infer"
            try:
                sat = benchlib.closed_loop(url, body, max(4, 2 * b), 8.0)
                saturation = float(sat["ok_per_s"])
                rate = args.load * saturation
                log(f"B={b}: saturation {saturation:.1f} req/s; Poisson at {rate:.1f} req/s for {args.seconds:g}s")
                res = benchlib.open_loop(url, body, "poisson", rate, args.seconds)
                live = LatencyProfile.model_validate(tv.fetch_json(f"{base}/admin/profile"))
            finally:
                benchlib.stop_process(proc)
            rows = compare(points(live), ref, args.min_samples)
            hot_rows = compare(points(live), points(hot), args.min_samples)
            runs.append(
                {
                    "max_batch_size": b,
                    "saturation_rps": round(saturation, 1),
                    "offered_rps": round(rate, 1),
                    "served_rps": res.get("ok_per_s"),
                    "client_p99_ms": res.get("slo_p99_ms"),
                    "loadavg_1m": round(os.getloadavg()[0], 2),
                    "points": rows,
                    "summary": within(rows),
                    "against_hot": {"points": hot_rows, "summary": within(hot_rows)},
                }
            )
            log(json.dumps(runs[-1]["summary"]) + " " + json.dumps(rows))
    all_rows = [r for run in runs for r in run["points"]]
    all_hot = [r for run in runs for r in run["against_hot"]["points"]]
    noise = within(floor)
    out: dict[str, Any] = {
        "command": " ".join(sys.argv),
        "machine": {"cores": os.cpu_count()},
        "isolated": [p.model_dump(mode="json", by_alias=True, exclude_none=True) for p in iso],
        "noise_floor": {"points": floor, "summary": noise},
        "runs": runs,
        "isolated_hot": hot.model_dump(mode="json", by_alias=True, exclude_none=True),
        "summary": within(all_rows),
        "summary_against_hot": within(all_hot),
    }
    print(
        json.dumps(
            {"noise_floor": noise, "under_load": out["summary"], "under_load_vs_hot": out["summary_against_hot"]},
            indent=2,
        )
    )
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
