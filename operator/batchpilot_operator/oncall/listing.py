"""What `kubectl batchpilot list` and `status -w` show: every policy in a row, and the frames of a
live status view.

Pure: no Kubernetes client, time passed in. :func:`list_rows` returns JSON-ready rows (the
``-o json|yaml`` output) and :func:`list_view` the table; :class:`StatusFrames` turns a stream
of watch events of one policy into the frames to draw, one per change of what the view shows.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from batchpilot_operator.oncall import render


def human_duration(seconds: float) -> str:
    """An age as kubectl prints it (``k8s.io/apimachinery/pkg/util/duration.HumanDuration``)."""
    s = int(seconds)
    if s < -1:
        return "<invalid>"
    if s < 0:
        return "0s"
    if s < 120:
        return f"{s}s"
    minutes = s // 60
    if minutes < 10:
        return f"{minutes}m" if s % 60 == 0 else f"{minutes}m{s % 60}s"
    if minutes < 180:
        return f"{minutes}m"
    hours = s // 3600
    if hours < 8:
        return f"{hours}h" if minutes % 60 == 0 else f"{hours}h{minutes % 60}m"
    if hours < 48:
        return f"{hours}h"
    if hours < 24 * 8:
        return f"{hours // 24}d" if hours % 24 == 0 else f"{hours // 24}d{hours % 24}h"
    if hours < 24 * 365 * 2:
        return f"{hours // 24}d"
    if hours < 24 * 365 * 8:
        years, days = hours // 24 // 365, (hours // 24) % 365
        return f"{years}y" if days == 0 else f"{years}y{days}d"
    return f"{hours // 24 // 365}y"


def _parse_time(value: str | None) -> datetime | None:
    if not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


def _age(value: str | None, now: datetime) -> str | None:
    when = _parse_time(value)
    return None if when is None else human_duration((now - when).total_seconds())


def list_row(obj: dict[str, Any], now: datetime) -> dict[str, Any]:
    """One policy as a row of ``kubectl batchpilot list``."""
    s = render.summary(obj, decisions=0)
    meta = obj.get("metadata") or {}
    step = s["step"]
    last = s["lastAnalysis"]
    return {
        "namespace": s["namespace"],
        "name": s["name"],
        "phase": s["phase"],
        "upToDate": s["upToDate"],
        "paused": s["paused"],
        "stableRevision": s["stableRevision"],
        "canaryRevision": s["canaryRevision"],
        "canaryWeight": s["canaryWeight"] if s["canaryRevision"] else None,
        "step": None if step is None else f"{step['index']}/{step['of']}",
        "lastAnalysis": None
        if last is None
        else {"outcome": last["outcome"], "revision": last["revision"], "time": last["time"]},
        "lastAnalysisAge": None if last is None else _age(last["time"], now),
        "age": _age(meta.get("creationTimestamp"), now),
    }


def list_rows(objs: Iterable[dict[str, Any]], now: datetime) -> list[dict[str, Any]]:
    """Rows sorted by namespace, then name (as kubectl lists)."""
    rows = [list_row(o, now) for o in objs]
    return sorted(rows, key=lambda r: (r["namespace"] or "", r["name"] or ""))


def list_view(rows: list[dict[str, Any]], all_namespaces: bool) -> RenderableType:
    table = Table(box=None, pad_edge=False, header_style="bold")
    columns = ["NAME", "PHASE", "STABLE", "CANARY", "WEIGHT/STEP", "LAST ANALYSIS", "AGE"]
    for col in ["NAMESPACE", *columns] if all_namespaces else columns:
        table.add_column(col, no_wrap=True)
    for r in rows:
        phase = r["phase"] or "-"
        phase_text = Text(phase, style=render.PHASE_STYLE.get(phase, ""))
        if r["phase"] is not None and not r["upToDate"]:
            phase_text.append("*", style="yellow")  # the operator has not observed the latest spec yet
        weight = "-"
        if r["canaryRevision"]:
            weight = f"{r['canaryWeight']}%" + (f" {r['step']}" if r["step"] else "")
        last = r["lastAnalysis"]
        analysis = Text("-")
        if last is not None:
            analysis = Text(last["outcome"], style=render.OUTCOME_STYLE.get(last["outcome"], ""))
            analysis.append(f" {r['lastAnalysisAge']} ago" if r["lastAnalysisAge"] else "")
        cells: list[str | Text] = [
            r["name"] or "-",
            phase_text,
            r["stableRevision"] or "-",
            r["canaryRevision"] or "-",
            weight,
            analysis,
            r["age"] or "-",
        ]
        table.add_row(*([r["namespace"] or "-", *cells] if all_namespaces else cells))
    return table


def no_policies_message(namespace: str | None) -> str:
    if namespace is None:
        return "No BatchingPolicies found."
    return f"No BatchingPolicies found in namespace {namespace}."


# --------------------------------------------------------------------------- status -w


@dataclass
class StatusFrames:
    """The frames of ``kubectl batchpilot status NAME -w``, from the policy's watch events.

    :meth:`on_event` returns a frame to draw when what the view shows changed (a status write
    that changes nothing visible, e.g. the operator's own resync, draws nothing) and ``None``
    otherwise. It also tracks the resourceVersion to resume the watch from.
    """

    name: str
    decisions: int = 8
    resource_version: str | None = None
    _last: dict[str, Any] | None = field(default=None, repr=False)
    deleted: bool = False

    def on_event(self, kind: str, obj: dict[str, Any]) -> RenderableType | None:
        meta = obj.get("metadata") or {}
        if meta.get("resourceVersion"):
            self.resource_version = meta["resourceVersion"]
        if kind == "BOOKMARK":
            return None
        if kind == "DELETED":
            self.deleted, self._last = True, None
            return Text(f'batchingpolicy "{self.name}" was deleted; waiting for it to come back', style="yellow")
        self.deleted = False
        summary = render.summary(obj, decisions=self.decisions)
        if summary == self._last:
            return None
        self._last = summary
        return render.status_view(summary)

    def with_footer(self, frame: RenderableType, footer: str) -> RenderableType:
        return Group(frame, Text(footer, style="dim"))
