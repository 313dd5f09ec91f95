"""`kubectl batchpilot list [-A]`, `status NAME [-w]` and `history NAME`: read and draw.

The rows, tables and frames come from :mod:`batchpilot_operator.oncall` (``listing`` and
``render``, pure); this module reads, lists and watches BatchingPolicies through
:class:`~batchpilot_operator.kubectl.cluster.Cluster` and draws.

``status -w`` draws the status view, then follows a watch on the one policy (a field selector
on its name, resumed from the last resourceVersion, relisted when the API says it is too old)
and redraws whenever what the view shows changed: in place on a terminal (rich ``Live``), as a
new frame under a time rule when the output is a pipe or a file. Ctrl-C (SIGINT) ends it with
exit code 0 and the terminal as it was.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any, cast

import yaml
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.rule import Rule
from rich.text import Text

from batchpilot_operator.kubectl.cluster import Cluster, PluginError, emit
from batchpilot_operator.oncall import render
from batchpilot_operator.oncall.listing import StatusFrames, list_rows, list_view, no_policies_message
from batchpilot_operator.spec import GROUP, PLURAL, VERSION


def cmd_list(cluster: Cluster, args: argparse.Namespace, console: Console) -> int:
    from kubernetes.client.exceptions import ApiException

    everywhere = bool(args.all_namespaces)
    try:
        if everywhere:
            result = cluster.custom.list_cluster_custom_object(GROUP, VERSION, PLURAL)
        else:
            result = cluster.custom.list_namespaced_custom_object(GROUP, VERSION, cluster.namespace, PLURAL)
    except ApiException as exc:
        where = "all namespaces" if everywhere else f"namespace {cluster.namespace!r}"
        raise PluginError(f"listing batchingpolicies in {where}: {exc.status} {exc.reason}") from exc
    rows = list_rows(cast(dict[str, Any], result).get("items") or [], datetime.now(UTC))
    if args.output == "json":
        sys.stdout.write(json.dumps({"items": rows}, indent=2) + "\n")
    elif args.output == "yaml":
        sys.stdout.write(yaml.safe_dump({"items": rows}, sort_keys=False))
    elif not rows:
        Console(stderr=True).print(no_policies_message(None if everywhere else cluster.namespace))
    else:
        console.print(list_view(rows, everywhere))
    return 0


def cmd_status(cluster: Cluster, args: argparse.Namespace, console: Console) -> int:
    if not getattr(args, "watch", False):
        data = render.summary(cluster.get(args.name), decisions=args.decisions)
        return emit(data, args.output, console, render.status_view)
    if args.output != "table":
        raise PluginError("status -w draws the table view; -o json|yaml is not supported with -w")
    return watch_status(cluster, args.name, console, args.decisions)


def cmd_history(cluster: Cluster, args: argparse.Namespace, console: Console) -> int:
    obj = cluster.get(args.name)
    archive, error = cluster.ledger_archive(args.name)
    data = render.history(obj, archive, error)
    return emit(data, args.output, console, render.history_view)


def _events(cluster: Cluster, name: str, frames: StatusFrames) -> Iterator[tuple[str, dict[str, Any]]]:
    """Watch events of one policy, forever: resumed from the last resourceVersion, relisted on 410."""
    from kubernetes import watch
    from kubernetes.client.exceptions import ApiException

    selector = f"metadata.name={name}"
    while True:
        w = watch.Watch()  # type: ignore[no-untyped-call]
        try:
            for event in w.stream(  # type: ignore[no-untyped-call]
                cluster.custom.list_namespaced_custom_object,
                GROUP,
                VERSION,
                cluster.namespace,
                PLURAL,
                field_selector=selector,
                resource_version=frames.resource_version,
                allow_watch_bookmarks=True,
            ):
                yield str(event["type"]), cast(dict[str, Any], event["object"])
        except ApiException as exc:
            if exc.status != 410:
                raise PluginError(
                    f"watching batchingpolicy {cluster.namespace}/{name}: {exc.status} {exc.reason}"
                ) from exc
            # Our resourceVersion is too old: list again and carry on from there.
            listed = cast(
                dict[str, Any],
                cluster.custom.list_namespaced_custom_object(
                    GROUP, VERSION, cluster.namespace, PLURAL, field_selector=selector
                ),
            )
            frames.resource_version = listed["metadata"]["resourceVersion"]
            for item in listed.get("items") or []:
                yield "MODIFIED", item
        finally:
            w.stop()  # type: ignore[no-untyped-call]


def watch_status(cluster: Cluster, name: str, console: Console, decisions: int) -> int:
    frames = StatusFrames(name, decisions)
    first = frames.on_event("ADDED", cluster.get(name))  # not found: a one-line error, exit 1
    assert first is not None
    where = f"{cluster.namespace}/{name}"

    def footer() -> Text:
        return Text(
            f"watching {where}: redrawn on change, last at {datetime.now(UTC):%H:%M:%S}Z. Ctrl-C to exit.",
            style="dim",
        )

    live: Live | None = None
    try:
        with contextlib.ExitStack() as stack:
            if console.is_terminal:
                live = stack.enter_context(
                    Live(Group(first, footer()), console=console, auto_refresh=False, redirect_stderr=False)
                )
                live.refresh()
            else:
                _print_frame(console, first, where)
            for kind, obj in _events(cluster, name, frames):
                frame = frames.on_event(kind, obj)
                if frame is None:
                    continue
                if live is not None:
                    live.update(Group(frame, footer()), refresh=True)
                else:
                    _print_frame(console, frame, where)
    except KeyboardInterrupt:
        return 0
    return 0


def _print_frame(console: Console, frame: RenderableType, where: str) -> None:
    console.print(Rule(f"{where} at {datetime.now(UTC):%Y-%m-%dT%H:%M:%S}Z", style="dim"))
    console.print(frame)
    console.file.flush()
