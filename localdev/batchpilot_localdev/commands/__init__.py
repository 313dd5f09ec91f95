"""Sub-commands the development stack adds to the `batchpilot` CLI (entry points: see
``batchpilot_operator.cli.PLUGINS``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from batchpilot_localdev import checkout


def checkout_or_register_why(sub: Any, commands: Sequence[tuple[str, str]]) -> Path | None:
    """The checkout the commands' defaults live in; where there is none (the package installed
    from a wheel), registers each of ``commands`` (name, help) as one that fails saying why, so
    that ``--help`` still works and ``batchpilot demo`` explains itself."""
    try:
        return checkout()
    except RuntimeError as exc:
        why = str(exc)

    def fail(_: argparse.Namespace) -> int:
        sys.stderr.write(f"error: {why}\n")
        return 2

    for name, text in commands:
        sub.add_parser(name, help=f"{text} (needs a checkout)").set_defaults(func=fail)
    return None


def add_trace_argument(p: argparse.ArgumentParser, root: Path) -> None:
    """``--trace``: the arrival trace the stack replays (default: the shared code trace)."""
    p.add_argument(
        "--trace",
        type=Path,
        default=root.parent / "shared" / "traces" / "azure-llm-2023-code.csv",
        help="arrival trace CSV (TIMESTAMP,...) or one timestamp per line",
    )


def add_real_node_argument(p: argparse.ArgumentParser) -> None:
    """``--real-node``: pods run by a real kubelet instead of kwok and the runtime harness."""
    p.add_argument(
        "--real-node",
        action="store_true",
        help="run the pods on a real node (kubelet + containerd, the images of `make images`) instead of kwok "
        "and the runtime harness; needs root (a bridge, network namespaces, cgroups)",
    )
