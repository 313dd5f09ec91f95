"""`batchpilot up|down|load`: the local stack left running to try things by hand (localdev.stack)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from batchpilot_localdev.commands import add_real_node_argument, add_trace_argument, checkout_or_register_why

HELP = {
    "up": "start the local stack and leave it running: control plane, Prometheus, operator, runtimes, load",
    "down": "stop the local stack started by `batchpilot up`",
    "load": "change the trace replay rate of the running local stack",
}


def register(sub: Any) -> None:
    root = checkout_or_register_why(sub, list(HELP.items()))
    if root is None:
        return
    workdir = root / ".cache" / "up"
    p: argparse.ArgumentParser = sub.add_parser(
        "up",
        help=HELP["up"],
        description="Start the local stack in the background and print how to use it. Run again: says it is "
        "already up and reports any part that crashed (exit code 1 then).",
    )
    p.add_argument("--workdir", type=Path, default=workdir, help=f"state, logs and data (default {workdir})")
    p.add_argument("-n", "--namespace", default="default", help="namespace the runtime harness and load serve")
    p.add_argument("--rate", type=float, default=10.0, help="trace replay rate per policy, req/s (0: no load)")
    add_trace_argument(p, root)
    p.add_argument(
        "--runtime-device",
        default="auto",
        help="device for every runtime process (kwok's GPU nodes are fake; auto: CUDA if present, else CPU); "
        "'policy' keeps each policy's own",
    )
    add_real_node_argument(p)
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for the stack to come up")
    p.set_defaults(func=run_up)

    p = sub.add_parser("down", help=HELP["down"])
    p.add_argument("--workdir", type=Path, default=workdir)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds to wait for a clean stop")
    p.set_defaults(func=run_down)

    p = sub.add_parser("load", help=HELP["load"])
    p.add_argument("--workdir", type=Path, default=workdir)
    p.add_argument("--rate", type=float, required=True, help="req/s per policy (0: stop the load)")
    p.add_argument("--timeout", type=float, default=120.0)
    p.set_defaults(func=run_load)


def _say(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


def _guard(fn: Any) -> int:
    from batchpilot_localdev.stack import StackError

    try:
        code: int = fn()
    except StackError as exc:
        sys.stderr.write(f"error: {exc}\n")
        return 1
    return code


def run_up(args: argparse.Namespace) -> int:
    from batchpilot_localdev.stack import up

    if args.rate < 0:
        raise SystemExit("error: --rate must be >= 0")
    device = None if args.runtime_device == "policy" else args.runtime_device
    if device not in (None, "auto", "cpu", "cuda"):
        raise SystemExit("error: --runtime-device must be auto, cpu, cuda or policy")
    return _guard(
        lambda: up(args.workdir, args.namespace, args.rate, args.trace, device, args.timeout, _say, args.real_node)
    )


def run_down(args: argparse.Namespace) -> int:
    from batchpilot_localdev.stack import down

    return _guard(lambda: down(args.workdir, args.timeout, _say))


def run_load(args: argparse.Namespace) -> int:
    from batchpilot_localdev.stack import set_rate

    if args.rate < 0:
        raise SystemExit("error: --rate must be >= 0")
    return _guard(lambda: set_rate(args.workdir, args.rate, args.timeout, _say))
