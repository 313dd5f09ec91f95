"""`batchpilot` command line: one sub-command per module under ``batchpilot_operator.commands``
(and the development stack's, when a checkout installed it: see :data:`PLUGINS`).

Each command module exposes ``register(subparsers)``, which adds its parser and sets
``func`` (taking the parsed namespace, returning an exit code). Commands import their heavy
dependencies lazily so ``batchpilot validate`` in a CI job stays quick.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import sys
from collections.abc import Sequence

# Sub-command modules, in the order `--help` lists them.
COMMANDS = ("run", "validate", "profile", "tune")
PLUGINS = "batchpilot.commands"
"""Entry-point group of command modules from other packages of the distribution, listed after
ours: the development stack's ``demo`` and ``up`` (``batchpilot_localdev.commands``), which a
checkout installs and no image carries."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="batchpilot", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    modules = [f"batchpilot_operator.commands.{name}" for name in COMMANDS]
    modules += [ep.value for ep in sorted(importlib.metadata.entry_points(group=PLUGINS), key=lambda ep: ep.name)]
    for path in modules:
        try:
            module = importlib.import_module(path)
        except ModuleNotFoundError as exc:  # a command whose package or optional deps are not installed
            if exc.name and path.startswith(exc.name):
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
