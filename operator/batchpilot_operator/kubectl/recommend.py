"""`kubectl batchpilot recommend NAME`: batching settings from the pods' own traffic.

Gathers the recent arrivals and the measured latency profile of every ready pod of the policy
through the apiserver's pod proxy (``/admin/arrivals``, ``/admin/profile`` of the runtime),
merges them, and runs the tuner (``batchpilot tune``'s search and simulator) for each lane
against the lane's SLO. Prints the observed traffic (rate, burstiness), the current setting's
predicted p99 / queue age / capacity at the observed traffic and at a planned growth (the p99
now also with every pass ``PASS_DRIFT`` slower: how far it moves when the passes do), the
recommended setting with the same predictions, the model's measured error (its p99 for the
window's own arrivals against the pods' recorded p99, after the operator's earlier checks in
``status.recommendation.calibration``), and an RFC 6902 patch ready for Git. It never
edits the policy: commit the patch, and the canary checks the prediction on real traffic.

RBAC: ``get`` on ``batchingpolicies.batchpilot.dev``, ``list`` on ``pods`` and ``get`` on
``pods/proxy`` in the policy's namespace (``manifests/rbac/recommend-role.yaml``, the ClusterRole ``batchpilot-recommend`` to bind per namespace).
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import yaml
from rich.console import Console, Group, RenderableType
from rich.table import Table
from rich.text import Text

from batchpilot_operator.kubectl.cluster import Cluster, PluginError, emit
from batchpilot_operator.livedata import gather
from batchpilot_operator.spec import KIND, parse_spec
from batchpilot_operator.tune.calibration import calibrations_from_status
from batchpilot_operator.tune.live import PASS_DRIFT, recommend_policy
from batchpilot_runtime.config import parse_duration

HELP = "recommend batching settings from the pods' own traffic (a patch for Git)"


def register(sub: Any, common: argparse.ArgumentParser) -> None:
    """Add the ``recommend`` subcommand, run by :func:`cmd_recommend`."""
    p = sub.add_parser("recommend", parents=[common], help=HELP, description=__doc__)
    p.add_argument("name")
    p.add_argument("--since", default="1h", help="how far back to read arrivals (default 1h; the runtime keeps <= 1h)")
    p.add_argument(
        "--rate", type=float, help="plan for this many requests/s (all replicas) instead of observed x growth"
    )
    p.add_argument(
        "--growth", type=float, help="plan for observed traffic x this (default: spec.tuning.growth, else 2)"
    )
    p.add_argument("--margin", type=float, help="safety margin under the SLO (default: spec.tuning.margin, else 0.2)")
    p.add_argument("--lane", action="append", help="only this lane (repeatable; default all)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per pod request (default 10)")
    p.set_defaults(func=cmd_recommend)


def cmd_recommend(cluster: Cluster, args: argparse.Namespace, console: Console) -> int:
    obj = cluster.get(args.name)
    try:
        spec = parse_spec(obj.get("spec") or {})
        since = parse_duration(args.since)
    except ValueError as exc:
        raise PluginError(str(exc)) from exc
    tuning = (obj.get("spec") or {}).get("tuning") or {}
    growth = args.growth if args.growth is not None else float(tuning.get("growth", 2.0))
    margin = args.margin if args.margin is not None else float(tuning.get("margin", 0.2))
    got = gather(cluster.api, cluster.namespace, args.name, since=since, timeout=args.timeout)
    try:
        result = recommend_policy(
            spec,
            got.arrivals,
            got.profiles,
            growth=growth,
            margin=margin,
            rate=args.rate,
            lanes=args.lane,
            pod_errors=got.errors,
            # The operator's checks so far (spec.tuning); this window's is added, not saved.
            calibration=calibrations_from_status((obj.get("status") or {}).get("recommendation")),
        )
    except ValueError as exc:
        raise PluginError(str(exc)) from exc
    data: dict[str, Any] = {
        "policy": args.name,
        "namespace": cluster.namespace,
        "since": args.since,
        "growth": growth,
        "margin": margin,
    } | result.to_dict()
    data["patchYAML"] = patch_yaml(args.name, result.patch, data)
    code = emit(data, args.output, console, view)
    return code if result.lanes else 1


def patch_yaml(name: str, ops: list[dict[str, Any]], data: dict[str, Any]) -> str:
    if not ops:
        return "# no change recommended\n"
    head = [f"# kubectl batchpilot recommend {name}: RFC 6902 patch for {KIND}/{name}"]
    for lane in data["lanes"]:
        if lane["current"] != lane["recommended"]:
            rec = lane["recommended"]
            head.append(
                f"# lane {lane['lane']}: capacity {lane['current']['capacity']} -> {rec['capacity']} rows/s; "
                f"planned {lane['plannedRowRate']} rows/s: p99 {rec['atPlanned']['p99Latency'] or 'inf'}"
            )
    head.append("# apply in Git (kustomize patches: / kubectl patch --type json), the canary checks it")
    return "\n".join(head) + "\n" + yaml.safe_dump(ops, sort_keys=False)


def _num(x: Any, unit: str = "") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "n/a"
    return f"{x:g}{unit}"


def view(d: dict[str, Any]) -> RenderableType:
    parts: list[RenderableType] = []
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    head.add_row("Policy", f"{d['namespace']}/{d['policy']}")
    head.add_row("Pods", ", ".join(d["pods"]) or "none")
    if d["profile"]:
        p = d["profile"]
        head.add_row("Profile", f"{p['model']} on {p['device']}, measured in the pods at sizes {p['batchSizes']}")
    head.add_row("Plan", f"growth x{d['growth']:g}, margin {d['margin']:.0%}, arrivals since {d['since']}")
    for err in d["podErrors"]:
        head.add_row("Pod error", Text(err, style="yellow"))
    parts.append(head)
    for lane in d["lanes"]:
        t = lane["traffic"]
        slo = lane["slo"]
        title = Text(f"\nlane {lane['lane']}", style="bold")
        verdict = (
            Text(f"  STALE: {', '.join(lane['reasons'])}", style="bold red")
            if lane["stale"]
            else Text("  current setting holds", style="green")
        )
        parts.append(Text.assemble(title, verdict))
        parts.append(
            Text(
                f"observed: {t['requests']} requests over {t['windowSeconds']:g}s from {len(t['pods'])} pod(s): "
                f"{_num(t['rate'])} req/s, {_num(t['rowRate'])} rows/s, gap CV {_num(t['gapCV'])}, "
                f"peak/mean (1s) {_num(t['peakToMean1s'])}, batch cut delay p50 "
                f"{_num(None if t['batchCutDelayP50'] is None else t['batchCutDelayP50'] * 1e3, 'ms')}"
            )
        )
        parts.append(
            Text(
                f"SLO: p99 {slo['p99Latency']}, queue age {slo['maxQueueAge']} (targets less {slo['margin']:.0%}); "
                f"replicas {lane['replicas']}; planned {_num(lane['plannedRowRate'])} rows/s"
            )
        )
        table = Table(show_edge=False, pad_edge=False)
        for col in (
            "setting",
            "maxBatchSize",
            "maxQueueDelay",
            "capacity rows/s",
            "p99 now",
            f"p99 now, passes +{PASS_DRIFT:.0%}",
            "queue age now",
            f"p99 x{lane['growth']:.3g}",
            f"queue age x{lane['growth']:.3g}",
        ):
            table.add_column(col)
        for label in ("current", "recommended"):
            s = lane[label]
            now, planned = s["atObserved"], s["atPlanned"]
            table.add_row(
                label,
                str(s["maxBatchSize"]),
                s["maxQueueDelay"],
                _num(s["capacity"]),
                Text(now["p99Latency"] or "inf", style="" if now["meetsTargets"] else "red"),
                now.get("p99AtSlowerPasses", "-") or "inf",  # "-": a recommendation from before the what-if
                now["p99QueueAge"] or "inf",
                Text(planned["p99Latency"] or "inf", style="" if planned["meetsTargets"] else "red"),
                planned["p99QueueAge"] or "inf",
            )
        parts.append(table)
        model = lane.get("model") or {}
        if model.get("summary"):
            within = model.get("withinTolerance")
            style = "dim" if within is None else "green" if within else "bold yellow"
            parts.append(Text(model["summary"], style=style))
        for note in lane["notes"]:
            parts.append(Text(f"note: {note}", style="dim"))
    for lane_name, why in d["failed"].items():
        parts.append(Text(f"lane {lane_name}: no recommendation: {why}", style="yellow"))
    parts.append(Text("\n" + d["patchYAML"]))
    return Group(*parts)
