"""The demo report's drawing and summary (pure: synthetic series shaped as Prometheus returns them).

The labels of rollout events close in time must not overlap in the rendered figure, and the
batching story (throughput and mean batch size per revision) sits next to the p99 panels.
"""

from __future__ import annotations

import itertools
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from rich.console import Console

from batchpilot_localdev.demo import (
    BATCH,
    LATENCY,
    QUEUE_AGE,
    THROUGHPUT,
    ReportData,
    draw_report,
    hold_workdir,
    run_demo,
    stack_labels,
    summarize,
    summary_table,
)
from batchpilot_localdev.scenario import CHANGES, REAL_NODE_RESOURCES, Demo
from batchpilot_operator.spec import parse_spec

START = 1_800_000_000.0


def series(rev: str, track: str, fn: Any, t0: float = 0, t1: float = 200) -> dict[str, Any]:
    values = [[START + t, str(fn(t))] for t in range(int(t0), int(t1), 2)]
    return {"metric": {"revision": rev, "track": track}, "values": values}


def report(events: list[tuple[float, str, str]]) -> ReportData:
    panels = {
        LATENCY: [series("aaa", "stable", lambda t: 0.04), series("bbb", "canary", lambda t: "NaN", 50, 90)],
        QUEUE_AGE: [series("aaa", "stable", lambda t: 0.01)],
        THROUGHPUT: [series("aaa", "stable", lambda t: 30 if t < 100 else 0), series("bbb", "canary", lambda t: 10)],
        BATCH: [series("aaa", "stable", lambda t: 2.0), series("bbb", "canary", lambda t: 6.0)],
    }
    return ReportData(START, START + 200, panels, {LATENCY: 0.12, QUEUE_AGE: 0.06}, events)


def overlaps(a: Any, b: Any) -> bool:
    return bool(a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1)


def test_stack_labels_packs_rows_greedily() -> None:
    assert stack_labels([(0, 2), (1, 3), (2.5, 4), (3.5, 5)], gap=0.0) == [0, 1, 0, 1]
    assert stack_labels([(0, 1), (2, 3)], gap=0.5) == [0, 0]
    assert stack_labels([], gap=0.0) == []


@pytest.mark.parametrize(("crowd", "at"), [(1, 40.0), (3, 40.0), (9, 40.0), (2, 0.0), (2, 196.0)])
def test_event_labels_do_not_overlap(crowd: int, at: float, tmp_path: Path) -> None:
    # A canary, its steps, a promotion and a rollback within seconds of each other, `crowd` times,
    # in the middle of the run or at either edge of it.
    kinds = ["CanaryStarted", "StepAdvanced", "StepAdvanced", "Promoted", "CanaryStarted", "RolledBack"]
    events = [
        (at + i * 0.6 + j * 0.3, kind, f"rev{j}{i:02d}abcd") for j in range(crowd) for i, kind in enumerate(kinds)
    ]
    fig, labels = draw_report(report(sorted(events)))
    assert len(labels) == len(events)
    fig.savefig(tmp_path / "report.png", dpi=110)  # as written: the extents below are the saved layout
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
    boxes = [t.get_window_extent(renderer) for t in labels]
    for (i, a), (j, b) in itertools.combinations(enumerate(boxes), 2):
        assert not overlaps(a, b), f"{labels[i].get_text()!r} overlaps {labels[j].get_text()!r}"
    figure_box = fig.bbox
    assert all(figure_box.x0 <= b.x0 and b.x1 <= figure_box.x1 for b in boxes), "labels stay inside the figure"
    panels = [ax.get_ylabel() for ax in fig.axes if ax.get_ylabel()]
    assert panels == ["p99 latency (ms)", "p99 queue age (ms)", "throughput (req/s)", "mean batch size (rows)"]


def test_events_come_from_the_ledger_and_from_what_it_no_longer_holds() -> None:
    from batchpilot_localdev.demo import rollout_events

    ledger = [
        {"time": "2027-01-15T08:00:30Z", "kind": "RolledBack", "revision": "37126e2fc4"},
        {"time": "2027-01-15T08:00:31Z", "kind": "Analysis", "revision": "37126e2fc4"},
    ]
    k8s = [
        {"reason": "CanaryStarted", "lastTimestamp": "2027-01-15T08:00:05Z",
         "message": "canary 37126e2fc4 started at step 1/2: weight 25% (effective 25%: 1 canary + 3 stable)"},
        {"reason": "RolledBack", "lastTimestamp": "2027-01-15T08:00:31Z",
         "message": "canary 37126e2fc4 rolled back (AnalysisFailed): ...; stable 9b944bf289 serves"},
        {"reason": "AnalysisFailed", "lastTimestamp": "2027-01-15T08:00:20Z", "message": "canary 37126e2fc4 failed 1/2"},
    ]  # fmt: skip
    start = datetime(2027, 1, 15, 8, 0, 0, tzinfo=UTC).timestamp()
    expected = [(5.0, "CanaryStarted", "37126e2fc4"), (30.0, "RolledBack", "37126e2fc4")]
    assert rollout_events(ledger, k8s, start) == expected


def test_summary_per_revision_tells_the_batching_story() -> None:
    data = report([(40.0, "CanaryStarted", "bbb")])
    run_p99 = {
        LATENCY: [{"metric": {"revision": "aaa", "track": "stable"}, "value": [0, "0.045"]}],
        QUEUE_AGE: [{"metric": {"revision": "bbb", "track": "canary"}, "value": [0, "NaN"]}],
    }
    rows = {(r["revision"], r["track"]): r for r in summarize(data, run_p99)}
    stable, canary = rows[("aaa", "stable")], rows[("bbb", "canary")]
    assert stable["throughput"] == pytest.approx(30.0), "mean while serving: zeros after it stopped do not count"
    assert stable["meanBatchRows"] == pytest.approx(2.0) and canary["meanBatchRows"] == pytest.approx(6.0)
    assert stable["p99Latency"] == pytest.approx(0.045) and "p99QueueAge" not in canary
    text = summary_table(list(rows.values()))
    assert "served req/s" in text and "45.0ms" in text


@pytest.mark.prometheus
def test_report_queries_on_a_real_runtime_and_prometheus(tmp_path: Path, prometheus_factory: Any) -> None:
    """collect_report's PromQL against a real runtime process scraped by a real Prometheus."""
    import json
    import os
    import subprocess
    import sys
    import time
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor
    from datetime import UTC, datetime
    from types import SimpleNamespace

    from batchpilot_localdev import free_port
    from batchpilot_localdev.demo import collect_report
    from batchpilot_localdev.prometheus import ScrapeTarget
    from bptest import REPO

    config = tmp_path / "config.json"
    lane = {"name": "interactive", "maxBatchSize": 8, "maxQueueDelay": "5ms", "maxQueueLength": 256}
    config.write_text(
        json.dumps(
            {
                "revision": "aaa",
                "model": {"name": "mlp", "source": "builtin:tiny-mlp", "device": "cpu", "threads": 1},
                "lanes": [lane | {"requestTimeout": "5s"}],
            }
        )
    )
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "runtime"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "batchpilot_runtime.server", "--config", str(config), "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:

        def ready() -> bool:
            try:
                with urllib.request.urlopen(f"{url}/v2/health/ready", timeout=1) as r:
                    return bool(r.status == 200)
            except OSError:
                assert proc.poll() is None, "runtime exited"
                return False

        deadline = time.monotonic() + 60
        while not ready():
            assert time.monotonic() < deadline, "runtime not ready"
            time.sleep(0.1)
        labels = {"namespace": "demo", "policy": "demo-embedder", "revision": "aaa", "track": "stable"}
        prom = prometheus_factory([ScrapeTarget(f"127.0.0.1:{port}", labels)])
        prom.wait_for_targets_up(1)  # scraped before the load, however long Prometheus took to start
        started = time.time()
        body = json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 512], "data": [0.5] * 512}]})

        def client(_: int) -> set[int]:
            # Paced, so that the runtime still answers its 1 s scrapes on a busy machine.
            codes = set()
            end = time.monotonic() + 8
            while time.monotonic() < end:
                req = urllib.request.Request(f"{url}/v2/models/mlp/infer", data=body.encode(), method="POST")
                with urllib.request.urlopen(req, timeout=10) as r:
                    codes.add(int(r.status))
                time.sleep(0.02)
            return codes

        with ThreadPoolExecutor(4) as pool:  # 4 clients at once: batches of more than one row form
            assert set().union(*pool.map(client, range(4))) == {200}
        prom.wait_for(
            'sum(rate(batchpilot_requests_total{policy="demo-embedder",outcome="ok"}[10s])) > 0',
            lambda r: len(r) == 1,
            timeout=30,
        )
        when = datetime.fromtimestamp(started + 1, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        demo = SimpleNamespace(prom=prom, started=started, cluster=None)
        data = collect_report(demo, {"ledger": [{"kind": "CanaryStarted", "time": when, "revision": "aaa"}]})  # type: ignore[arg-type]
    finally:
        proc.terminate()
        proc.wait(20)
    assert data.events == [(pytest.approx(1.0, abs=1.0), "CanaryStarted", "aaa")]
    assert data.slo[LATENCY] == pytest.approx(0.12), "from the demo manifest"
    for title in (LATENCY, QUEUE_AGE, THROUGHPUT, BATCH):
        assert [s["metric"] for s in data.panels[title]] == [{"revision": "aaa", "track": "stable"}], title
    (row,) = data.summary
    assert row["throughput"] > 1 and row["meanBatchRows"] >= 1
    assert 0 < row["p99Latency"] < 5 and row["p99QueueAge"] >= 0
    # Per tenant (issue 12): this runtime declares none, so every request is tenant "default".
    (tenant,) = data.tenants
    assert (tenant["revision"], tenant["track"], tenant["tenant"]) == ("aaa", "stable", "default")
    assert 0 < tenant["p99Latency"] < 5 and tenant["requests"] >= 1


def test_client_line_counts_every_answer() -> None:
    from collections import Counter

    from batchpilot_localdev.demo import client_line
    from batchpilot_localdev.load import TrackStats

    clean = TrackStats(sent=100, ok=100)
    assert client_line([clean]) == "the clients: 100 requests sent, 100 answered 200 (100.00%)"
    rough = TrackStats(sent=50, ok=45, errors=4, failures=Counter({"503": 3, "ClientConnectorError": 1}))
    assert client_line([clean, rough]) == (
        "the clients: 150 requests sent, 145 answered 200 (96.67%); the others: 3 x 503, 1 x ClientConnectorError; "
        "1 in flight at the end"
    )
    assert client_line([]) == "the clients: no request sent"


def test_tenant_table_shows_each_clients_p99() -> None:
    from batchpilot_localdev.demo import tenant_rows, tenant_table

    def sample(rev: str, track: str, tenant: str, value: float) -> dict[str, Any]:
        return {"metric": {"revision": rev, "track": track, "tenant": tenant}, "value": [0, str(value)]}

    rows = tenant_rows(
        [
            sample("bbb", "canary", "web", 0.03),
            sample("bbb", "canary", "mobile", 0.2),
            sample("aaa", "stable", "web", 0.02),
        ],
        [
            sample("bbb", "canary", "web", 900),
            sample("bbb", "canary", "mobile", 100),
            sample("aaa", "stable", "web", 5000),
            sample("aaa", "stable", "default", 0),  # no request named no tenant: not a row
        ],
        ["aaa", "bbb"],
    )
    assert [(r["revision"], r["tenant"], r["requests"]) for r in rows] == [
        ("aaa", "web", 5000),
        ("bbb", "mobile", 100),
        ("bbb", "web", 900),
    ]
    text = tenant_table(rows)
    assert "mobile" in text and "200.0ms" in text and "30.0ms" in text


def test_the_demo_applies_what_git_holds_and_on_the_real_node_only_smaller_pods(tmp_path: Path) -> None:
    # kwok's pods cost nothing; on the real node the demo's 8 pods must fit 2 cores and the
    # machine's memory, so only spec.resources changes there (a revision of its own).
    def revisions(real_node: bool) -> list[str]:
        demo = Demo(tmp_path, 24.0, tmp_path / "trace.csv", Console(), real_node=real_node)
        return [parse_spec(demo.manifest(path)["spec"]).revision() for _, path in CHANGES]

    for _, path in CHANGES:
        as_in_git = yaml.safe_load(path.read_text())
        kwok = Demo(tmp_path, 24.0, tmp_path / "trace.csv", Console()).manifest(path)
        real = Demo(tmp_path, 24.0, tmp_path / "trace.csv", Console(), real_node=True).manifest(path)
        assert kwok == as_in_git
        assert real["spec"]["resources"] == {**as_in_git["spec"].get("resources", {}), **REAL_NODE_RESOURCES}
        assert {k: v for k, v in real["spec"].items() if k != "resources"} == {
            k: v for k, v in as_in_git["spec"].items() if k != "resources"
        }
    on_kwok, on_node = revisions(False), revisions(True)
    assert len(set(on_kwok)) == len(set(on_node)) == len(CHANGES)  # three revisions either way
    assert not set(on_kwok) & set(on_node)


def test_a_second_demo_on_the_same_workdir_touches_nothing(tmp_path: Path) -> None:
    """While one demo holds its workdir, another on it says so and leaves the first's files."""
    workdir = tmp_path / "demo"
    first = hold_workdir(workdir)
    assert first is not None
    workdir.mkdir()
    (workdir / "report.png").write_text("the first run's")
    try:
        assert hold_workdir(workdir) is None
        assert run_demo(workdir, 24.0, tmp_path / "no-trace.csv") == 2
        assert (workdir / "report.png").read_text() == "the first run's"
    finally:
        first.close()
    again = hold_workdir(workdir)  # released with the first run
    assert again is not None
    again.close()
