"""The main job on one machine (`make demo` / `batchpilot demo`).

Brings up the real local control plane, a real Prometheus, the operator and the runtime
harness (one runtime server process per pod), the local Gateway API data plane (Contour and
Envoy, ``localdev/gateway.py``) with the policy's HTTPRoute, applies the demo policy (its canary
weights set on that route), replays the real arrival trace through Envoy, then applies two changes the way a GitOps pipeline would
(server-side apply under Argo CD's field manager): a good one, promoted through every step,
and a bad one, rolled back by the operator. It prints progress as it goes, ends with
``kubectl batchpilot status``, ``history`` and ``recommend``, and writes a report (PNG plot of p99 latency
and queue age per revision over time with the rollout events marked, plus the ledger).
Everything runs under one work directory that is wiped at the start: safe to re-run.

The scenario itself (what runs, what is applied, what it waits for) is :class:`.scenario.Demo`;
this module runs it (:func:`run_demo`) and writes its report (:func:`write_report`).
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import shutil
import signal
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import IO, Any

import yaml
from rich.console import Console

from batchpilot_localdev.load import TrackStats
from batchpilot_localdev.modelcheck import window_rows, window_table
from batchpilot_localdev.processes import try_lock
from batchpilot_localdev.scenario import CHANGES, NAMESPACE, POLICY, Demo
from batchpilot_operator.spec import parse_spec


@dataclass
class ReportData:
    """What the report shows, gathered from Prometheus and the final status (plotting is pure)."""

    start: float
    end: float
    panels: dict[str, list[dict[str, Any]]]
    """panel title -> Prometheus range-query series (``metric`` labels, ``values`` [[t, "v"], ...])."""
    slo: dict[str, float]
    """panel title -> SLO line, seconds (panels without one are absent)."""
    events: list[tuple[float, str, str]]
    """(seconds since start, ledger kind, revision), in time order."""
    summary: list[dict[str, Any]] = field(default_factory=list)
    """per revision and track: served req/s, mean batch rows, p99 latency and queue age over the run."""
    tenants: list[dict[str, Any]] = field(default_factory=list)
    """per revision, track and tenant: requests and p99 latency over the run (the slices the
    canary analysis judges)."""


LATENCY, QUEUE_AGE, THROUGHPUT, BATCH = "p99 latency", "p99 queue age", "throughput", "mean batch size"
PANEL_UNITS = {LATENCY: "ms", QUEUE_AGE: "ms", THROUGHPUT: "req/s", BATCH: "rows"}
EVENT_STYLE = {
    "CanaryStarted": ("orange", "canary"),
    "StepAdvanced": ("grey", "step"),
    "Promoted": ("green", "promoted"),
    "RolledBack": ("red", "rolled back"),
    "Aborted": ("red", "aborted"),
}
_REVISION = re.compile(r"\b([0-9a-f]{10})\b")


def _epoch(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def rollout_events(
    ledger: list[dict[str, Any]], k8s_events: list[dict[str, Any]], start: float
) -> list[tuple[float, str, str]]:
    """The rollout's events, (seconds since start, kind, revision) in time order.

    The ledger is bounded (its oldest entries give way to analyses on a long run), so the
    policy's Kubernetes Events (the operator posts one per decision, the message naming the
    revision first) fill in what it no longer holds; an event both have counts once.
    """
    events = [(_epoch(e["time"]) - start, e["kind"], e["revision"]) for e in ledger if e.get("kind") in EVENT_STYLE]
    for item in k8s_events:
        kind = item.get("reason")
        when = item.get("lastTimestamp") or item.get("eventTime") or item.get("firstTimestamp")
        found = _REVISION.search(item.get("message") or "")
        if kind not in EVENT_STYLE or not when or found is None:
            continue
        t = _epoch(when) - start
        if not any(k == kind and r == found.group(1) and abs(t - u) <= 3 for u, k, r in events):
            events.append((t, kind, found.group(1)))
    return sorted(events)


def _demo_slo() -> tuple[float, float]:
    """The p99 latency and queue age SLO of the demo policy's first lane (from its manifest)."""
    doc = yaml.safe_load(CHANGES[0][1].read_text())
    spec = parse_spec(doc["spec"])
    slo = spec.lane_slo(spec.lanes[0].name)
    return slo.p99_latency, slo.max_queue_age


def collect_report(demo: Demo, final_status: dict[str, Any]) -> ReportData:
    assert demo.prom is not None
    start, end = demo.started, time.time()
    sel = f'namespace="{NAMESPACE}",policy="{POLICY}"'
    by = "revision, track"
    queries = {
        LATENCY: f"histogram_quantile(0.99, sum by (le, {by}) (rate(batchpilot_request_latency_seconds_bucket{{{sel}}}[10s])))",
        QUEUE_AGE: f"histogram_quantile(0.99, sum by (le, {by}) (rate(batchpilot_queue_age_seconds_bucket{{{sel}}}[10s])))",
        THROUGHPUT: f'sum by ({by}) (rate(batchpilot_requests_total{{{sel},outcome="ok"}}[10s]))',
        BATCH: f"sum by ({by}) (rate(batchpilot_batch_size_rows_sum{{{sel}}}[10s])) "
        f"/ sum by ({by}) (rate(batchpilot_batch_size_rows_count{{{sel}}}[10s]))",
    }
    panels = {title: demo.prom.query_range(promql, start, end, step=2.0) for title, promql in queries.items()}
    window = f"{max(10, round(end - start))}s"
    run_p99 = {
        title: demo.prom.query(
            f"histogram_quantile(0.99, sum by (le, {by}) (increase({metric}_bucket{{{sel}}}[{window}])))"
        )
        for title, metric in (
            (LATENCY, "batchpilot_request_latency_seconds"),
            (QUEUE_AGE, "batchpilot_queue_age_seconds"),
        )
    }
    k8s_events: list[dict[str, Any]] = []
    if demo.cluster is not None:
        out = demo.kubectl(
            "get", "events", "-n", NAMESPACE, "--field-selector", f"involvedObject.name={POLICY}", "-o", "json",
            check=False,
        )  # fmt: skip
        with contextlib.suppress(ValueError):
            k8s_events = json.loads(out).get("items", []) if out else []
    events = rollout_events(final_status.get("ledger", []), k8s_events, start)
    p99, queue_age = _demo_slo()
    data = ReportData(start, end, panels, {LATENCY: p99, QUEUE_AGE: queue_age}, events)
    data.summary = summarize(data, run_p99)
    per_tenant = f"{by}, tenant"
    latency = "batchpilot_request_latency_seconds"
    data.tenants = tenant_rows(
        demo.prom.query(
            f"histogram_quantile(0.99, sum by (le, {per_tenant}) (increase({latency}_bucket{{{sel}}}[{window}])))"
        ),
        demo.prom.query(f"sum by ({per_tenant}) (increase({latency}_count{{{sel}}}[{window}]))"),
        [rev for _, _, rev in data.events],
    )
    return data


def tenant_rows(p99: list[dict[str, Any]], counts: list[dict[str, Any]], order: list[str]) -> list[dict[str, Any]]:
    """Per (revision, track, tenant): served requests and p99 latency over the run."""
    rows: dict[tuple[str, str, str], dict[str, Any]] = {}
    for samples, key in ((p99, "p99Latency"), (counts, "requests")):
        for sample in samples:
            labels = sample["metric"]
            rev, track = _key(labels)
            tenant = labels.get("tenant", "?")
            value = float(sample["value"][1])
            if math.isfinite(value):
                rows.setdefault((rev, track, tenant), {"revision": rev, "track": track, "tenant": tenant})[key] = value
    rank = {rev: i for i, rev in enumerate(order)}
    served = [r for r in rows.values() if r.get("requests") or r.get("p99Latency") is not None]  # not an idle "default"
    return sorted(served, key=lambda r: (rank.get(r["revision"], -1), r["revision"], r["track"], r["tenant"]))


def _points(series: dict[str, Any], start: float) -> list[tuple[float, float]]:
    out = []
    for t, v in series["values"]:
        value = float(v)
        if math.isfinite(value):
            out.append((float(t) - start, value))
    return out


def _key(labels: dict[str, str]) -> tuple[str, str]:
    return labels.get("revision", "?"), labels.get("track", "?")


def summarize(data: ReportData, run_p99: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per (revision, track): mean served rate and mean batch size while it served, p99s over the run."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}

    def row(labels: dict[str, str]) -> dict[str, Any]:
        rev, track = _key(labels)
        return rows.setdefault((rev, track), {"revision": rev, "track": track})

    for series in data.panels.get(THROUGHPUT, []):
        serving = [v for _, v in _points(series, data.start) if v > 0]
        if serving:
            row(series["metric"])["throughput"] = sum(serving) / len(serving)
    for series in data.panels.get(BATCH, []):
        sizes = [v for _, v in _points(series, data.start)]
        if sizes:
            row(series["metric"])["meanBatchRows"] = sum(sizes) / len(sizes)
    for title, key in ((LATENCY, "p99Latency"), (QUEUE_AGE, "p99QueueAge")):
        for sample in run_p99.get(title, []):
            value = float(sample["value"][1])
            if math.isfinite(value):
                row(sample["metric"])[key] = value
    order = {rev: i for i, (_, _, rev) in enumerate(data.events)}
    return sorted(rows.values(), key=lambda r: (order.get(r["revision"], -1), r["revision"], r["track"]))


def stack_labels(spans: list[tuple[float, float]], gap: float) -> list[int]:
    """Rows for labels occupying [start, end] (in time order) so that no two in a row overlap.

    Greedy interval packing: each label takes the lowest row whose last label ends ``gap``
    before it starts.
    """
    ends: list[float] = []
    rows = []
    for start, end in spans:
        for i, last in enumerate(ends):
            if last + gap <= start:
                ends[i] = end
                rows.append(i)
                break
        else:
            ends.append(end)
            rows.append(len(ends) - 1)
    return rows


# Figure geometry, fixed so that label widths can be laid out before drawing.
FIG_WIDTH_IN, LEFT, RIGHT = 13.0, 0.07, 0.985
LABEL_FONT_PT, ROW_IN = 7.0, 0.16


def draw_report(data: ReportData) -> tuple[Any, list[Any]]:
    """The report figure and its event label artists (pure: no I/O)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.font_manager import FontProperties
    from matplotlib.textpath import TextToPath

    duration = max(1.0, data.end - data.start)
    labels = [f"{EVENT_STYLE[kind][1]} {rev}" for _, kind, rev in data.events]
    prop = FontProperties(size=LABEL_FONT_PT)
    measure = TextToPath()
    axis_pt = FIG_WIDTH_IN * (RIGHT - LEFT) * 72
    spans, centers = [], []
    for (t, _, _), text in zip(data.events, labels, strict=True):
        width_pt = measure.get_text_width_height_descent(text, prop, ismath=False)[0]
        half = (width_pt + 4) * duration / axis_pt / 2  # 2pt padding each side
        center = min(max(t, half), duration - half)  # near an edge the label moves inward, not out
        centers.append(center)
        spans.append((center - half, center + half))
    order = sorted(range(len(spans)), key=lambda i: spans[i][0])
    packed = stack_labels([spans[i] for i in order], gap=0.0)
    rows = [0] * len(spans)
    for i, row in zip(order, packed, strict=True):
        rows[i] = row
    n_rows = max(rows, default=0) + 1
    strip_in = ROW_IN * n_rows + 0.12
    panel_in = [2.4, 1.8, 1.8, 1.8]
    height = strip_in + sum(panel_in) + 1.1
    fig = plt.figure(figsize=(FIG_WIDTH_IN, height))
    grid = fig.add_gridspec(
        5, 1, height_ratios=[strip_in, *panel_in], hspace=0.08, left=LEFT, right=RIGHT,
        top=1 - 0.45 / height, bottom=0.55 / height,
    )  # fmt: skip
    strip = fig.add_subplot(grid[0])
    axes = [fig.add_subplot(grid[i + 1], sharex=strip) for i in range(4)]
    strip.set_xlim(0, duration)
    strip.set_ylim(n_rows - 0.5, -0.5)
    strip.axis("off")

    colors: dict[str, Any] = {}
    cycle = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for rev in [r for _, _, r in data.events] + [
        _key(s["metric"])[0] for series in data.panels.values() for s in series
    ]:
        colors.setdefault(rev, cycle[len(colors) % len(cycle)])
    for ax, title in zip(axes, (LATENCY, QUEUE_AGE, THROUGHPUT, BATCH), strict=True):
        scale = 1e3 if PANEL_UNITS[title] == "ms" else 1.0
        for series in sorted(data.panels.get(title, []), key=lambda s: _key(s["metric"])):
            points = _points(series, data.start)
            if not points:
                continue
            rev, track = _key(series["metric"])
            xs, ys = zip(*points, strict=True)
            ax.plot(
                xs, [y * scale for y in ys], color=colors[rev], ls="--" if track == "canary" else "-", lw=1.3,
                label=f"{rev} ({track})",
            )  # fmt: skip
        if title in data.slo:
            ax.axhline(data.slo[title] * scale, color="red", ls=":", lw=1.2, label="SLO")
        if PANEL_UNITS[title] == "ms":
            ax.set_yscale("log")
        ax.set_ylabel(f"{title} ({PANEL_UNITS[title]})", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(loc="upper left", fontsize=7, ncol=3)
        for t, kind, _ in data.events:
            ax.axvline(t, color=EVENT_STYLE[kind][0], lw=0.9, alpha=0.6)
    for ax in axes[:-1]:
        ax.tick_params(labelbottom=False)
    axes[-1].set_xlabel("seconds since the demo started")
    artists = []
    for (t, kind, _), text, row, center in zip(data.events, labels, rows, centers, strict=True):
        color = EVENT_STYLE[kind][0]
        strip.plot([t, t], [row, n_rows - 0.5], color=color, lw=0.6, alpha=0.5)
        artists.append(
            strip.text(center, row, text, ha="center", va="center", fontsize=LABEL_FONT_PT, color=color,
                       bbox={"boxstyle": "square,pad=0.1", "fc": "white", "ec": "none"})
        )  # fmt: skip
    fig.suptitle(
        f"batchpilot demo: {POLICY}: p99, throughput and batch size per revision (dashed: canary), "
        "with the rollout's events",
        fontsize=11,
    )
    return fig, artists


def summary_table(rows: list[dict[str, Any]]) -> str:
    """The per-revision story in a few lines of text (the console and report/summary.txt)."""

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1e3:.1f}ms"

    lines = [
        f"{'revision':<12}{'track':<8}{'served req/s':>13}{'mean batch':>12}{'p99 latency':>13}{'p99 queue age':>15}"
    ]
    for r in rows:
        lines.append(
            f"{r['revision']:<12}{r['track']:<8}"
            f"{r.get('throughput', 0.0):>13.1f}{r.get('meanBatchRows', 0.0):>12.2f}"
            f"{ms(r.get('p99Latency')):>13}{ms(r.get('p99QueueAge')):>15}"
        )
    return "\n".join(lines)


def tenant_table(rows: list[dict[str, Any]]) -> str:
    """Per-tenant p99 per revision and track (what each client felt; the canary is judged per tenant)."""
    lines = [f"{'revision':<12}{'track':<8}{'tenant':<10}{'requests':>10}{'p99 latency':>13}"]
    for r in rows:
        p99 = r.get("p99Latency")
        lines.append(
            f"{r['revision']:<12}{r['track']:<8}{r['tenant']:<10}{r.get('requests', 0.0):>10.0f}"
            f"{'-' if p99 is None else f'{p99 * 1e3:.1f}ms':>13}"
        )
    return "\n".join(lines)


def client_line(stats: Iterable[TrackStats]) -> str:
    """What the replay's clients got over the whole run (through the gateway: every request,
    pods starting, scaled away and rolled included): sent, answered 200, and every other answer
    by its HTTP status or the client's exception."""
    sent = ok = 0
    failures: Counter[str] = Counter()
    for s in stats:
        sent += s.sent
        ok += s.ok
        failures += s.failures
    unanswered = sent - ok - sum(failures.values())  # still in flight when the replay stopped
    rest = ", ".join(f"{n} x {kind}" for kind, n in failures.most_common())
    return (
        (
            f"the clients: {sent} requests sent, {ok} answered 200 ({ok / sent:.2%})"
            if sent
            else "the clients: no request sent"
        )
        + (f"; the others: {rest}" if rest else "")
        + (f"; {unanswered} in flight at the end" if unanswered > 0 else "")
    )


def write_report(demo: Demo, final_status: dict[str, Any], out: Path) -> Path:
    """PNG plot per revision/track over time (p99 latency and queue age against the SLO,
    throughput, mean batch size) with the rollout's events labelled, plus the ledger and a
    per-revision summary."""
    data = collect_report(demo, final_status)
    out.mkdir(parents=True, exist_ok=True)
    fig, _ = draw_report(data)
    png = out / "report.png"
    fig.savefig(png, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    (out / "ledger.json").write_text(json.dumps(final_status.get("ledger", []), indent=2))
    (out / "history.json").write_text(json.dumps(final_status.get("history", []), indent=2))
    (out / "series.json").write_text(json.dumps(data.panels))
    (out / "summary.json").write_text(json.dumps(data.summary, indent=2))
    (out / "tenants.json").write_text(json.dumps(data.tenants, indent=2))
    model_rows: list[dict[str, Any]] = []
    if demo.collector is not None:
        demo.collector.poll()
        ledger = sorted(demo.analyses.values(), key=lambda e: str(e.get("time")))
        model_rows = window_rows(demo.collector, ledger, data.start)
        # What the rows were computed from, so that a change to the model can be replayed on a run
        # already made: every pod's arrivals and outcomes, settings and profile, and the analyses.
        (out / "captures.json").write_text(
            json.dumps(demo.collector.dump() | {"analyses": ledger, "start": data.start})
        )
    (out / "model.json").write_text(json.dumps(model_rows, indent=2, default=str))
    (out / "summary.txt").write_text(
        summary_table(data.summary)
        + "\n\nper tenant:\n"
        + tenant_table(data.tenants)
        + "\n\nlatency model, predicted vs observed p99 per analysis window:\n"
        + window_table(model_rows, _demo_slo()[0])
        + "\n"
    )
    return png


def hold_workdir(workdir: Path) -> IO[str] | None:
    """The demo's lock on ``workdir`` (a file beside it: the run deletes the directory), or None
    while another run holds it. A second demo on the same directory deleted the first one's
    cluster, TSDB and report under it (the first then failed writing report.png)."""
    workdir.parent.mkdir(parents=True, exist_ok=True)
    return try_lock(workdir.parent / f".{workdir.name}.lock")


def run_demo(workdir: Path, rate: float, trace: Path, real_node: bool = False) -> int:
    console = Console(soft_wrap=True)
    lock = hold_workdir(workdir)
    if lock is None:
        console.print(f"another demo runs in {workdir}: wait for it to finish (or stop it), then run this again")
        return 2
    with lock:
        return _run_demo(console, workdir, rate, trace, real_node)


def _run_demo(console: Console, workdir: Path, rate: float, trace: Path, real_node: bool) -> int:
    t0 = time.monotonic()
    if workdir.exists():
        shutil.rmtree(workdir)  # a previous run's cluster, TSDB and logs: start clean
    workdir.mkdir(parents=True)
    demo = Demo(workdir, rate, trace, console, real_node)

    def terminate(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)  # unwinds through demo.running(): everything is stopped

    signal.signal(signal.SIGTERM, terminate)
    with demo.running():
        final = demo.run()
        console.rule("kubectl batchpilot status")
        console.print(demo.plugin("status"), markup=False, highlight=False)
        console.rule("kubectl batchpilot history")
        console.print(demo.plugin("history"), markup=False, highlight=False)
        # The loop closed: what the pods' own traffic says about the settings now in Git.
        console.rule("kubectl batchpilot recommend")
        console.print(demo.plugin("recommend", "--since", "10m"), markup=False, highlight=False)
        png = write_report(demo, demo.status() or final, workdir / "report")
        console.rule("p99 latency per tenant (report/tenants.json)")
        console.print(tenant_table(json.loads((workdir / "report" / "tenants.json").read_text())), markup=False)
        console.rule("latency model: predicted vs observed p99 per analysis window (report/model.json)")
        rows = json.loads((workdir / "report" / "model.json").read_text())
        console.print(window_table(rows, _demo_slo()[0]), markup=False)
        if demo.replay is not None:
            console.print(client_line(demo.replay.stats.values()), markup=False, highlight=False)
    console.rule("done")
    console.print(f"report: {png} (ledger.json and history.json beside it)")
    console.print(f"scenario finished in {time.monotonic() - t0:.0f}s; everything it started has been stopped")
    return 0
