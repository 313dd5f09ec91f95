"""Sub-commands of the `batchpilot` CLI (see cli.py)."""

from __future__ import annotations

import argparse
from typing import Any


def add_command(subparsers: Any, name: str, summary: str, doc: str | None) -> argparse.ArgumentParser:
    """Sub-command ``name`` (``summary`` in the command list), whose ``--help`` shows ``doc``, its
    module's docstring, as written."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        name, help=summary, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    return parser
