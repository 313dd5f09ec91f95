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
