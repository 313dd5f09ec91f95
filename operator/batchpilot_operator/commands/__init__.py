"""Sub-commands of the `batchpilot` CLI (see cli.py)."""
