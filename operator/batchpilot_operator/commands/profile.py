"""`batchpilot profile`: measure a model's execution time by batch size on this device.

Loads the model in-process with the runtime's own loader (``batchpilot_runtime.models``:
same module, device, dtype, thread count and input path as a runtime pod, including the
numpy concatenation of single-row requests the batch worker does), times forward passes
at each batch size, and writes a :class:`~batchpilot_operator.tune.profile.LatencyProfile`.
Sizes are measured round-robin (one pass of every size, repeated), so a noisy neighbour
skews all sizes alike instead of one.

With ``--url`` it also measures the per-request overhead outside the model (HTTP, JSON,
event-loop hops) against a running runtime serving the same model: the median latency of
sequential single-row requests, minus the median single-row forward time. And the cost of its
HTTP front end (``frontEndCost``, the CPU its server process spends per request: the loop answers
one request at a time, so bursts above ``1 / frontEndCost`` per second queue before the batcher):
the runtime measures it itself (``/admin/profile``); the command gives it an idle spell and then a
concurrent flood of single-row requests to measure it on, and copies the runtime's figure.

torch is imported only when this command runs (the operator image has none; run it where
the runtime runs, on the target device).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from batchpilot_operator.commands import add_command
from batchpilot_operator.tune.profile import LatencyProfile, ProfiledModel, ProfilePoint
from batchpilot_runtime.config import parse_duration

DEFAULT_SIZES = "1,2,4,8,16,32,64,128,256"


def register(subparsers: Any) -> None:
    p = add_command(
        subparsers,
        "profile",
        "measure a model's execution time by batch size (a latency profile for `batchpilot tune`)",
        __doc__,
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--config", help="a runtime config (JSON/YAML): profile its model")
    src.add_argument("--source", help="model source, e.g. builtin:mlp")
    p.add_argument("--name", default=None, help="model name (default: from --config, else the source)")
    p.add_argument("--device", default=None, choices=["auto", "cpu", "cuda"], help="default: config's, else auto")
    p.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"])
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    p.add_argument("--batch-sizes", default=DEFAULT_SIZES, help=f"comma-separated (default {DEFAULT_SIZES})")
    p.add_argument("--iterations", type=int, default=50, help="timed passes per batch size (default 50)")
    p.add_argument("--warmup", type=int, default=5, help="untimed passes per batch size first (default 5)")
    p.add_argument("--max-seconds", type=float, default=120.0, help="stop timing after this long (default 120)")
    p.add_argument(
        "--gap", type=float, default=0.01, help="idle seconds before each timed pass, as in service (default 0.01)"
    )
    p.add_argument("--url", default=None, help="a running runtime (http://host:port) to measure request overhead")
    p.add_argument("--overhead-requests", type=int, default=200)
    p.add_argument(
        "--front-end-requests",
        type=int,
        default=2000,
        help="with --url: concurrent requests to measure the runtime's front-end cost on (0: skip)",
    )
    p.add_argument(
        "--quantile",
        default="p90",
        choices=["p50", "p90", "p99", "mean"],
        help="column `batchpilot tune` reads by default (default p90)",
    )
    p.add_argument("-o", "--output", default="-", help="file to write (default: stdout)")
    p.set_defaults(func=run)


def _percentile(sorted_values: list[float], q: float) -> float:
    k = max(0, min(len(sorted_values) - 1, round(q * (len(sorted_values) - 1))))
    return sorted_values[k]


def _model_config(args: argparse.Namespace) -> Any:
    from batchpilot_runtime.config import ModelConfig, load_config

    if args.config:
        base = load_config(args.config).model
        fields = base.model_dump()
    else:
        fields = {
            "name": args.name or args.source.split(":")[-1].replace("/", "-")[:63],
            "source": args.source,
        }
    if args.name:
        fields["name"] = args.name
    for key in ("device", "dtype", "threads"):
        value = getattr(args, key)
        if value is not None:
            fields[key] = value
    return ModelConfig.model_validate(fields)


def measure(
    cfg: Any,
    sizes: list[int],
    iterations: int,
    warmup: int,
    max_seconds: float,
    log: Any = None,
    gap: float = 0.0,
) -> tuple[list[ProfilePoint], str, int | None]:
    """Time ``LoadedModel.run`` at each size the way the batch worker calls it.

    ``gap`` seconds of idle time precede each timed pass (0: a hot back-to-back loop). In
    service batches arrive after idle gaps, and a pass after a gap is slower (caches and
    clocks cool down; 10-15% for builtin:mlp on a small CPU box), so the default of
    ``batchpilot profile`` is a gap.
    """
    log = log or sys.stderr
    import numpy as np
    import torch

    from batchpilot_runtime.models import LoadedModel

    model = LoadedModel(cfg)
    row = model.example(1)
    inputs = {b: [row] * b for b in sizes}

    def once(b: int) -> float:
        t0 = time.perf_counter()
        parts = inputs[b]
        x = parts[0] if b == 1 else np.concatenate(parts)
        model.run(x)
        return time.perf_counter() - t0

    for b in sizes:
        for _ in range(warmup):
            once(b)
    samples: dict[int, list[float]] = {b: [] for b in sizes}
    deadline = time.perf_counter() + max_seconds
    for it in range(iterations):
        for b in sizes:
            if gap > 0:
                time.sleep(gap)
            samples[b].append(once(b))
        if time.perf_counter() > deadline:
            print(f"profile: time limit reached after {it + 1} passes per size", file=log)
            break
    points = []
    for b in sizes:
        xs = sorted(samples[b])
        points.append(
            ProfilePoint(
                batch_size=b,
                p50=_percentile(xs, 0.5),
                p90=_percentile(xs, 0.9),
                p99=_percentile(xs, 0.99),
                mean=statistics.fmean(xs),
                samples=len(xs),
            )
        )
        print(f"profile: batch {b:5d}: p50 {xs[len(xs) // 2] * 1e3:8.3f} ms  ({len(xs)} samples)", file=log)
    device = model.device_name
    if device == "cuda":
        device = f"cuda ({torch.cuda.get_device_name(model.device)})"
    return points, device, torch.get_num_threads() if model.device.type == "cpu" else None


def one_row_body(meta: dict[str, Any]) -> bytes:
    """An Open Inference Protocol v2 request with one all-zero row for the model's input."""
    spec = meta["inputs"][0]
    row_shape = [int(d) for d in spec["shape"][1:]]
    count = 1
    for d in row_shape:
        count *= d
    zero: float | int = 0.0 if str(spec["datatype"]).startswith("FP") else 0
    tensor = {
        "name": spec["name"],
        "datatype": spec["datatype"],
        "shape": [1, *row_shape],
        "data": [zero] * count,
    }
    return json.dumps({"inputs": [tensor]}).encode()


def measure_overhead(url: str, model_name: str, count: int) -> float:
    """Median end-to-end latency of sequential single-row requests against a running runtime."""
    base = f"{url.rstrip('/')}/v2/models/{model_name}"
    with urllib.request.urlopen(base, timeout=10) as resp:
        meta = json.loads(resp.read())
    body = one_row_body(meta)
    lat: list[float] = []
    for _ in range(count):
        req = urllib.request.Request(f"{base}/infer", data=body, headers={"Content-Type": "application/json"})
        t0 = time.perf_counter()
        with urllib.request.urlopen(req, timeout=10) as resp:
            resp.read()
        lat.append(time.perf_counter() - t0)
    return statistics.median(lat)


def _runtime_profile(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{url.rstrip('/')}/admin/profile", timeout=10) as resp:
        doc: dict[str, Any] = json.loads(resp.read())
    return doc


def measure_front_end(url: str, model_name: str, count: int, concurrency: int = 32, idle: float = 2.5) -> float | None:
    """The runtime's own frontEndCost after an idle spell (its idle CPU rate) and ``count``
    single-row requests from ``concurrency`` clients (its CPU per request at load); None when
    the runtime does not state one (an older runtime, or too few requests)."""
    base = f"{url.rstrip('/')}/v2/models/{model_name}"
    with urllib.request.urlopen(base, timeout=10) as resp:
        body = one_row_body(json.loads(resp.read()))
    _runtime_profile(url)  # opens a window; after the idle spell the next read closes it
    time.sleep(idle)
    _runtime_profile(url)

    def send(_: int) -> None:
        req = urllib.request.Request(f"{base}/infer", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as resp:
            resp.read()

    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(send, range(count)))
    time.sleep(1.1)  # past the runtime's window, so the read below closes the last busy one
    raw = _runtime_profile(url).get("frontEndCost")
    return parse_duration(raw) if isinstance(raw, str) else None


def run(args: argparse.Namespace) -> int:
    sizes = sorted({int(s) for s in args.batch_sizes.split(",") if s.strip()})
    if not sizes or sizes[0] < 1:
        print("profile: --batch-sizes must list positive integers", file=sys.stderr)
        return 2
    cfg = _model_config(args)
    points, device, threads = measure(cfg, sizes, args.iterations, args.warmup, args.max_seconds, gap=args.gap)
    overhead = 0.0
    front_end = 0.0
    note = (
        f"forward time via batchpilot_runtime.models.LoadedModel.run, in-process, {args.gap:g}s idle before each pass"
    )
    if args.url:
        e2e = measure_overhead(args.url, cfg.name, args.overhead_requests)
        overhead = max(0.0, e2e - points[0].p50)
        note += f"; requestOverhead = median HTTP latency at 1 row ({e2e * 1e3:.3f} ms) - p50 forward at 1 row"
        if args.front_end_requests > 0:
            cost = measure_front_end(args.url, cfg.name, args.front_end_requests)
            if cost is not None:
                front_end = cost
                note += (
                    f"; frontEndCost = the runtime's CPU per request over {args.front_end_requests} "
                    "concurrent requests, beyond its idle rate"
                )
    profile = LatencyProfile(
        model=ProfiledModel(
            name=cfg.name,
            source=cfg.source,
            device=device,
            dtype=cfg.dtype,
            threads=threads,
            host=platform.node() or None,
        ),
        quantile=args.quantile,
        request_overhead=overhead,
        front_end_cost=front_end,
        points=points,
        measured_at=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        note=note,
    )
    text = profile.to_yaml()
    if args.output == "-":
        sys.stdout.write(text)
    else:
        Path(args.output).write_text(text)
        print(f"profile: wrote {args.output}", file=sys.stderr)
    return 0
