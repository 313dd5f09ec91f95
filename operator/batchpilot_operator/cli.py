"""`batchpilot` command line: one sub-command per module under ``batchpilot_operator.commands``.

Each command module exposes ``register(subparsers)``, which adds its parser and sets
``func`` (taking the parsed namespace, returning an exit code). Commands import their heavy
dependencies lazily so ``batchpilot validate`` in a CI job stays quick.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# Sub-command modules, in the order `--help` lists them.
COMMANDS = ("run", "demo", "up", "validate", "profile", "tune")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="batchpilot", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"batchpilot_operator.commands.{name}")
        except ModuleNotFoundError as exc:  # a command whose optional deps are missing
            if exc.name and exc.name.startswith("batchpilot_operator.commands"):
                continue
            raise
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
