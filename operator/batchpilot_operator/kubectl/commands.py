"""`kubectl batchpilot promote|abort|retry|pause|resume NAME`: the on-call commands.

They never edit the spec (Git stays the source of truth): each sets the annotation the operator
watches to ``<user>@<RFC 3339 time>`` and, with ``--wait``, follows ``status.handledCommands``
until the operator has acted on that value.
"""

from __future__ import annotations

import argparse
import time
from datetime import UTC, datetime
from typing import Any

from rich.console import Console

from batchpilot_operator.kubectl.cluster import Cluster, PluginError, emit
from batchpilot_operator.rollout import (
    ABORT_ANNOTATION,
    PAUSE_ANNOTATION,
    PROMOTE_ANNOTATION,
    RESUME_ANNOTATION,
    RETRY_ANNOTATION,
)

COMMAND_ANNOTATIONS = {"promote": PROMOTE_ANNOTATION, "abort": ABORT_ANNOTATION, "retry": RETRY_ANNOTATION}


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def cmd_command(cluster: Cluster, args: argparse.Namespace, console: Console) -> int:
    """promote / abort / retry / pause / resume."""
    verb: str = args.command
    obj = cluster.get(args.name)
    status = obj.get("status") or {}
    user = cluster.whoami()
    value = f"{user}@{now_rfc3339()}"
    if verb in COMMAND_ANNOTATIONS:
        if verb in ("promote", "abort") and not status.get("rollout"):
            console.print(
                f"[yellow]warning:[/] no canary in flight ({status.get('phase')}); the operator will ignore {verb}"
            )
        if verb == "retry" and status.get("phase") != "RolledBack":
            console.print(
                f"[yellow]warning:[/] phase is {status.get('phase')}, not RolledBack; the operator will ignore retry"
            )
        cluster.annotate(args.name, {COMMAND_ANNOTATIONS[verb]: value})
        handled_key, expected = verb, value
    elif verb == "pause":
        cluster.annotate(args.name, {PAUSE_ANNOTATION: value})
        handled_key, expected = "pause", value
    else:  # resume
        if PAUSE_ANNOTATION not in ((obj.get("metadata") or {}).get("annotations") or {}):
            console.print("[yellow]warning:[/] the policy is not paused")
        cluster.annotate(args.name, {PAUSE_ANNOTATION: None, RESUME_ANNOTATION: value})
        handled_key, expected = "pause", ""
    result: dict[str, Any] = {"command": verb, "policy": args.name, "namespace": cluster.namespace, "by": value}
    if args.wait > 0:
        obj = wait_handled(cluster, args.name, handled_key, expected, args.wait)
        st = obj.get("status") or {}
        result |= {"handled": True, "phase": st.get("phase"), "message": st.get("message")}
    if args.output == "table":
        console.print(f"{verb} requested for {cluster.namespace}/{args.name} by {value}")
        if "phase" in result:
            console.print(f"phase {result['phase']}: {result['message']}")
        return 0
    return emit(result, args.output, console, None)


def wait_handled(cluster: Cluster, name: str, key: str, expected: str, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        obj = cluster.get(name)
        handled = ((obj.get("status") or {}).get("handledCommands") or {}).get(key, "")
        if handled == expected:
            return obj
        if time.monotonic() >= deadline:
            raise PluginError(f"the operator has not handled the command within {timeout:g}s (is it running?)")
        time.sleep(0.5)
