"""What `kubectl batchpilot status|history` shows, built from the policy object (and, for
``history``, the policy's ledger ConfigMap: ``ledger.py``).

Pure: no Kubernetes client. :func:`summary` and :func:`history` return JSON-ready dicts
(the ``-o json|yaml`` output); :func:`status_view` and :func:`history_view` turn them into
rich renderables for the terminal.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any, get_args

from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from batchpilot_operator import ledger
from batchpilot_operator.analysis import format_value
from batchpilot_operator.status import LedgerEntry, LedgerKind, Status

PHASE_STYLE = {
    "Healthy": "bold green",
    "Progressing": "bold cyan",
    "Pending": "bold cyan",
    "Paused": "bold yellow",
    "RolledBack": "bold red",
    "Degraded": "bold red",
}
OUTCOME_STYLE = {
    "Successful": "green",
    "Promoted": "green",
    "Failed": "red",
    "RolledBack": "red",
    "Aborted": "red",
    "Error": "magenta",
    "Inconclusive": "yellow",
    "Superseded": "yellow",
}
DECISION_KINDS = set(get_args(LedgerKind)) - {"Analysis"}


def _ts(value: datetime | None) -> str | None:
    return None if value is None else value.strftime("%Y-%m-%dT%H:%M:%SZ")


_FRACTION = re.compile(r"\.\d+(?=Z|[+-]\d\d:\d\d$)")


def _t(value: str | None) -> str:
    """An RFC 3339 time without its fraction of a second, for the terminal."""
    return _FRACTION.sub("", value) if value else "-"


def _ms(seconds: float | None) -> str:
    if seconds is None:
        return "n/a"
    return f"{seconds * 1000:.3g}ms" if seconds < 1 else f"{seconds:.3g}s"


def _entry(e: LedgerEntry) -> dict[str, Any]:
    data: dict[str, Any] = e.model_dump(mode="json", by_alias=True, exclude_none=True)
    return data


def _why(status: Status) -> str:
    """The reason for the current phase: the Stalled condition when it holds, else the message."""
    stalled = status.condition("Stalled")
    if status.phase is not None and status.phase.value == "RolledBack":
        return status.message
    if stalled is not None and stalled.status == "True":
        return f"Stalled ({stalled.reason}): {stalled.message}"
    return status.message


def summary(obj: dict[str, Any], decisions: int = 8) -> dict[str, Any]:
    """The rollout at a glance, JSON-ready (``kubectl batchpilot status -o json``)."""
    meta = obj.get("metadata", {})
    spec = obj.get("spec", {})
    status = Status.from_dict(obj.get("status"))
    rollout = status.rollout
    steps = (spec.get("rollout") or {}).get("steps") or []
    step = None
    if status.current_step_index is not None and status.step_count:
        step = {
            "index": status.current_step_index + 1,
            "of": status.step_count,
            "weight": status.step_weight,
            "pause": (
                steps[status.current_step_index].get("pause") if status.current_step_index < len(steps) else None
            ),
        }
    lanes: list[dict[str, Any]] = []
    la = status.last_analysis
    if la is not None:
        for lane in la.lanes:
            extra: dict[str, Any] = {}
            if lane.rejected is not None or lane.stable_rejected is not None:
                extra |= {"rejected": lane.rejected, "stableRejected": lane.stable_rejected}
            if lane.tenants:
                extra["tenants"] = [t.model_dump(mode="json", by_alias=True) for t in lane.tenants]
            if lane.model is not None:
                extra |= {
                    "predictedP99Latency": lane.predicted_p99_latency,
                    "stablePredictedP99Latency": lane.stable_predicted_p99_latency,
                    "model": lane.model,
                }
            lanes.append(
                extra
                | {
                    "lane": lane.lane,
                    "outcome": lane.outcome,
                    "p99Latency": lane.p99_latency,
                    "p99LatencySlo": lane.p99_latency_slo,
                    "queueAge": lane.queue_age,
                    "maxQueueAge": lane.max_queue_age,
                    "errorRate": lane.error_rate,
                    "maxErrorRate": lane.max_error_rate,
                    "samples": lane.samples,
                    "requests": lane.requests,
                    "stableP99Latency": lane.stable_p99_latency,
                    "stableQueueAge": lane.stable_queue_age,
                    "stableErrorRate": lane.stable_error_rate,
                    "detectableP99Regression": lane.detectable_p99_regression,
                    "detectableErrorRate": lane.detectable_error_rate,
                    "detects": lane.detects,
                }
            )
    recent = [e for e in status.ledger if e.kind in DECISION_KINDS][-decisions:]
    last_analyses = [e for e in status.ledger if e.kind == "Analysis"][-4:]
    generation = meta.get("generation")
    return {
        "name": meta.get("name"),
        "namespace": meta.get("namespace"),
        "generation": generation,
        "observedGeneration": status.observed_generation,
        "upToDate": generation is not None and status.observed_generation == generation,
        "phase": status.phase.value if status.phase else None,
        "message": status.message,
        "why": _why(status),
        "paused": status.paused,
        "desiredRevision": status.desired_revision,
        "stableRevision": status.stable_revision,
        "canaryRevision": status.canary_revision,
        "step": step,
        "canaryWeight": status.canary_weight,
        "replicas": {"stable": status.stable_replicas, "canary": status.canary_replicas},
        "rollout": None
        if rollout is None
        else {
            "revision": rollout.revision,
            "startedAt": _ts(rollout.started_at),
            "stepStartedAt": _ts(rollout.step_started_at),
            "failures": rollout.failures,
            "failureLimit": (spec.get("rollout") or {}).get("failureLimit", 2),
            "inconclusiveStreak": rollout.inconclusive_streak,
            "metricsErrorSince": _ts(rollout.metrics_error_since),
            "passedLanes": rollout.passed_lanes,
        },
        "lastAnalysis": None
        if la is None
        else {"time": _ts(la.time), "revision": la.revision, "outcome": la.outcome, "window": la.window},
        "lanes": lanes,
        "conditions": [c.model_dump(mode="json", by_alias=True) for c in status.conditions],
        "decisions": [_entry(e) for e in recent],
        "lastMeasurements": [_entry(e) for e in last_analyses],
        "failedRevisions": [f.model_dump(mode="json", by_alias=True) for f in status.failed_revisions],
    }


def history(
    obj: dict[str, Any], archive: Sequence[LedgerEntry] = (), archive_error: str | None = None
) -> dict[str, Any]:
    """Revisions with outcome and evidence, plus every decision of the ledger: status's and
    the older ones the ledger ConfigMap (``archive``) keeps, oldest first."""
    meta = obj.get("metadata", {})
    status = Status.from_dict(obj.get("status"))
    data = {
        "name": meta.get("name"),
        "namespace": meta.get("namespace"),
        "stableRevision": status.stable_revision,
        "canaryRevision": status.canary_revision,
        "revisions": [h.model_dump(mode="json", by_alias=True) for h in status.history],
        "failedRevisions": [f.model_dump(mode="json", by_alias=True) for f in status.failed_revisions],
        "decisions": [_entry(e) for e in ledger.merged(archive, status.ledger)],
    }
    if archive_error is not None:
        data["archiveError"] = archive_error
    return data


# --------------------------------------------------------------------------- rich


def _styled(value: str | None, styles: dict[str, str]) -> Text:
    return Text(value or "-", style=styles.get(value or "", ""))


def _pct(value: float | None) -> str:
    return "n/a" if value is None else format_value("errorRate", value)


def _vs(value: float | None, limit: float | None, fmt: Callable[[float | None], str] | None = None) -> Text:
    show = fmt or _ms
    text = f"{show(value)} / {show(limit)}"
    if value is None or limit is None:
        return Text(text, style="dim")
    return Text(text, style="red" if value > limit else "green")


def status_view(s: dict[str, Any]) -> RenderableType:
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    head.add_row("Policy", f"{s['namespace']}/{s['name']}")
    head.add_row("Phase", Text(s["phase"] or "(not reconciled yet)", style=PHASE_STYLE.get(s["phase"] or "", "")))
    head.add_row("Why", s["why"] or "-")
    gen = f"{s['observedGeneration']} of {s['generation']}"
    head.add_row("Generation", gen if s["upToDate"] else Text(gen + " (operator has not caught up)", style="yellow"))
    head.add_row("Stable", s["stableRevision"] or "-")
    head.add_row("Canary", s["canaryRevision"] or "-")
    if s["desiredRevision"] and s["desiredRevision"] not in (s["stableRevision"], s["canaryRevision"]):
        head.add_row("Desired", s["desiredRevision"])
    if s["step"]:
        st = s["step"]
        head.add_row(
            "Step",
            f"{st['index']}/{st['of']}  weight {st['weight']}% asked, {s['canaryWeight']}% effective"
            + (f", pause {st['pause']}" if st.get("pause") else ""),
        )
    reps = s["replicas"]
    head.add_row("Replicas", f"stable {reps['stable'] if reps['stable'] is not None else '-'}, canary {reps['canary']}")
    r = s["rollout"]
    if r:
        head.add_row(
            "Canary run",
            f"since {r['startedAt']}, step clock {r['stepStartedAt'] or 'waiting for pods'}, "
            f"failures {r['failures']}/{r['failureLimit']}, passed lanes {', '.join(r['passedLanes']) or 'none'}",
        )
    if s["paused"]:
        head.add_row("Paused", Text("yes (kubectl batchpilot resume to continue)", style="yellow"))
    parts: list[RenderableType] = [Panel(head, title=f"BatchingPolicy {s['name']}", expand=False)]

    if s["lanes"]:
        la = s["lastAnalysis"]
        t = Table(title=f"Last analysis {_t(la['time'])} of {la['revision']} over {la['window']}: {la['outcome']}")
        for col in (
            "lane",
            "outcome",
            "p99 / SLO",
            "queue age / max",
            "errors / max",
            "samples",
            "stable p99",
            "stable queue age",
            "stable errors",
        ):
            t.add_column(col)
        for lane in s["lanes"]:
            t.add_row(
                lane["lane"],
                _styled(lane["outcome"], OUTCOME_STYLE),
                _vs(lane["p99Latency"], lane["p99LatencySlo"]),
                _vs(lane["queueAge"], lane["maxQueueAge"]),
                _vs(lane["errorRate"], lane["maxErrorRate"], _pct),
                "n/a" if lane["samples"] is None else f"{lane['samples']:.0f}",
                _ms(lane["stableP99Latency"]),
                _ms(lane["stableQueueAge"]),
                _pct(lane["stableErrorRate"]),
            )
        parts.append(t)
        sees = [
            f"lane {lane['lane']}: this rollout detects {lane['detects']}" for lane in s["lanes"] if lane["detects"]
        ]
        sees += [f"lane {lane['lane']}: {lane['model']}" for lane in s["lanes"] if lane.get("model")]
        if sees:
            parts.append(Text("\n".join(sees)))
        tenant_rows = [(lane, t) for lane in s["lanes"] for t in lane.get("tenants") or []]
        if tenant_rows:
            t = Table(title="Tenant slices (thin: too few requests to judge, counted for nothing)")
            for col in (
                "lane",
                "tenant",
                "outcome",
                "p99 / SLO",
                "stable p99",
                "rejected 4xx",
                "stable 4xx",
                "requests",
            ):
                t.add_column(col)
            t.add_column("evidence", overflow="fold")
            for lane, ten in tenant_rows:
                t.add_row(
                    lane["lane"],
                    ten["tenant"],
                    "thin" if ten.get("thin") else _styled(ten["outcome"], OUTCOME_STYLE),
                    _vs(ten.get("p99Latency"), lane["p99LatencySlo"]),
                    _ms(ten.get("stableP99Latency")),
                    _pct(ten.get("rejected")),
                    _pct(ten.get("stableRejected")),
                    "n/a" if ten.get("requests") is None else f"{ten['requests']:.0f}",
                    ten.get("evidence") or "",
                )
            parts.append(t)

    if s["conditions"]:
        t = Table(title="Conditions")
        for col in ("type", "status", "reason", "since", "message"):
            t.add_column(col)
        for c in s["conditions"]:
            t.add_row(c["type"], c["status"], c["reason"], _t(c["lastTransitionTime"]), c.get("message") or "")
        parts.append(t)

    if s["decisions"]:
        parts.append(_decisions_table("Last decisions (ledger)", s["decisions"]))
    return Group(*parts)


def _decisions_table(title: str, entries: list[dict[str, Any]]) -> Table:
    table = Table(title=title)
    for col in ("time", "kind", "revision", "reason", "evidence"):
        table.add_column(col)
    for e in entries:
        table.add_row(
            _t(e["time"]),
            _styled(e["kind"], OUTCOME_STYLE),
            e["revision"],
            e.get("reason") or "",
            e.get("evidence") or "",
        )
    return table


def history_view(h: dict[str, Any]) -> RenderableType:
    parts: list[RenderableType] = []
    t = Table(title=f"Revisions of {h['namespace']}/{h['name']} (stable {h['stableRevision'] or '-'})")
    for col in ("time", "revision", "outcome", "reason", "evidence"):
        t.add_column(col)
    for e in h["revisions"]:
        t.add_row(
            _t(e["time"]),
            e["revision"],
            _styled(e["outcome"], OUTCOME_STYLE),
            e.get("reason", ""),
            e.get("evidence", ""),
        )
    if h["canaryRevision"]:
        t.add_row("now", h["canaryRevision"], Text("canary in flight", style="cyan"), "", "")
    parts.append(t)
    if h["failedRevisions"]:
        f = Table(title="Failed revisions (not canaried again until the spec changes or `retry`)")
        for col in ("time", "revision", "reason", "evidence"):
            f.add_column(col)
        for e in h["failedRevisions"]:
            f.add_row(_t(e["time"]), e["revision"], e["reason"], e.get("evidence", ""))
        parts.append(f)
    if h["decisions"]:
        parts.append(_decisions_table("Rollout decisions (ledger)", h["decisions"]))
    if h.get("archiveError"):
        parts.append(Text(f"older decisions not shown: {h['archiveError']}", style="yellow"))
    return Group(*parts)
