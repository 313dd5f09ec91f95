"""GPU check: the runtime serving ``builtin:transformer`` on CUDA under trace-replayed load.

    python bench/gpu_check.py                      # on a machine with one NVIDIA GPU
    python bench/gpu_check.py --device cpu --quick # smoke run anywhere

Needs PyTorch plus the runtime's small dependencies (aiohttp, orjson, prometheus-client,
pydantic, pyyaml, numpy); no network. Uses Node.js for the load generator when present, else
the Python generator (bench/pyloadgen.py). Prints one JSON document within about 5 minutes:

* ``ceiling``: rows/s of a bare forward pass per batch size (host->device copy included);
* ``batching``: goodput (highest trace-replayed rate with p99 <= 50 ms) with dynamic batching,
  max batch = the largest size whose forward takes <= 10 ms (SLO / 5);
* ``batch1``: the same server with max batch size 1;
* ``saturation``: rows/s with a closed loop, and its fraction of the ceiling.

Model: token ids INT64 [-1, 64] -> 4-layer d=256 encoder -> FP32 [-1, 256] (see models.py).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(REPO / "runtime"))

REQUIRED = ["torch", "numpy", "aiohttp", "orjson", "prometheus_client", "pydantic", "yaml"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--out", default=None)
    p.add_argument("--budget", type=float, default=270.0, help="seconds for the whole check")
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t_start = time.monotonic()

    missing = []
    for mod in REQUIRED:
        try:
            importlib.import_module(mod)
        except ImportError:
            missing.append(mod)
    if missing:
        print(json.dumps({"error": f"missing Python modules: {missing}; pip install them (offline: from wheels)"}))
        return 2

    import torch

    from benchlib import (
        closed_loop,
        free_port,
        goodput_search,
        loadgen_command,
        model_ceiling,
        open_loop,
        stop_process,
        transformer_body,
        wait_http,
    )

    if args.device == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"error": "CUDA is not available; use --device cpu for a smoke run"}))
        return 2

    quick = args.quick
    sizes = [1, 2, 4, 8, 16] if (quick and args.device == "cpu") else [1, 2, 4, 8, 16, 32, 64, 128, 256]
    result: dict[str, Any] = {
        "model": "builtin:transformer (INT64 ids [-1, 64], d256 x 4 layers, FP32 out [-1, 256])",
        "device": args.device,
        "device_name": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "slo_p99_ms": 50.0,
        "arrivals": "Azure LLM code trace 2023 (CC-BY 4.0), inter-arrival gaps scaled to each rate",
        "generator": Path(loadgen_command()[-1]).name,
        "quick": quick,
    }
    ceiling = model_ceiling("builtin:transformer", sizes, args.threads, args.device, 0.3 if quick else 1.0)
    result["ceiling"] = ceiling
    fitting = [b for b in sizes if ceiling[str(b)]["ms_per_batch"] <= 10.0] or [1]
    max_batch = max(fitting)
    body = transformer_body()
    duration = 2.0 if quick else 4.0
    min_samples = 100 if quick else 300
    max_trials = 4 if quick else 7
    tmp = Path(tempfile.mkdtemp(prefix="bp-gpu-check-"))

    def serve(b: int, window: str) -> tuple[subprocess.Popen[Any], str]:
        port = free_port()
        cfg = {
            "revision": f"gpu-check-b{b}",
            "model": {"name": "m", "source": "builtin:transformer", "device": args.device,
                      **({"threads": args.threads} if args.threads else {})},
            "lanes": [{"name": "default", "maxBatchSize": b, "maxQueueDelay": window, "maxQueueLength": 8192,
                       "requestTimeout": "5s"}],
        }  # fmt: skip
        path = tmp / f"b{b}.json"
        path.write_text(json.dumps(cfg))
        env = dict(os.environ, PYTHONPATH=str(REPO / "runtime"))
        proc = subprocess.Popen(
            [sys.executable, "-m", "batchpilot_runtime.server", "--config", str(path), "--port", str(port),
             "--log-level", "WARNING"],
            env=env, stdout=(tmp / f"b{b}.log").open("w"), stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        wait_http(f"http://127.0.0.1:{port}/v2/health/ready", 180, proc)
        return proc, f"http://127.0.0.1:{port}/v2/models/m/infer"

    def run(b: int, window: str, start: float, share: float) -> dict[str, Any]:
        proc, url = serve(b, window)
        try:
            open_loop(url, body, "poisson", max(start / 4, 5.0), 1.0, min_samples=0)

            def trial(rate: float) -> dict[str, Any]:
                return open_loop(url, body, "trace", rate, duration, min_samples=min_samples)

            # half of what is left for the batching search, the rest for batch-1
            left = args.budget - (time.monotonic() - t_start)
            out = goodput_search(trial, start, max_trials, deadline=time.monotonic() + left * share)
            sat = closed_loop(url, body, 4 * b, duration)
            out["saturation_rows_per_s"] = sat["ok_per_s"]
            out["saturation_fraction_of_ceiling"] = round(sat["ok_per_s"] / ceiling[str(b)]["rows_per_s"], 3)
            out["max_batch_size"] = b
            out["window"] = window
            return out
        finally:
            stop_process(proc)

    result["batching"] = run(max_batch, "2ms", 0.5 * ceiling[str(max_batch)]["rows_per_s"], 0.45)
    result["batch1"] = run(1, "0s", 0.5 * ceiling["1"]["rows_per_s"], 0.8)
    g, g1 = result["batching"].get("goodput_rps"), result["batch1"].get("goodput_rps")
    result["batching_over_batch1"] = round(g / g1, 2) if g and g1 else None
    result["elapsed_s"] = round(time.monotonic() - t_start, 1)
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
