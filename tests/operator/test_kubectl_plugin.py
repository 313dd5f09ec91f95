"""`kubectl batchpilot` against the real control plane and a real operator process, invoked the
way on-call does: `kubectl batchpilot ...`, found by kubectl's plugin lookup on PATH.

Without Prometheus a canary's analysis reports Error, and under onMetricsUnavailable Hold the
canary stays put (Stalled/MetricsUnavailable): a steady canary to act on.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from batchpilot_operator.status import ANALYSIS_LIMIT, DECISION_LIMIT
from bptest import INTERACTIVE_LANE, Kube, OperatorProcess, Plugin, policy, policy_status, wait_policy_status

pytestmark = pytest.mark.cluster

POLICY: dict[str, Any] = policy(
    "ranker",
    lanes=[
        dict(INTERACTIVE_LANE),
        {
            "name": "background",
            "maxBatchSize": 64,
            "maxQueueDelay": "20ms",
            "maxQueueLength": 1024,
            "requestTimeout": "5s",
            "slo": {"p99Latency": "1s", "maxQueueAge": "500ms"},
        },
    ],
    rollout={
        "steps": [{"weight": 25, "pause": "1h"}, {"weight": 50, "pause": "1h"}],
        "analysisInterval": "1s",
        "onMetricsUnavailable": {"action": "Hold"},
    },
)


def stalled(st: dict[str, Any]) -> bool:
    return any(c["type"] == "Stalled" and c["status"] == "True" for c in st.get("conditions", []))


def test_on_call_walks_a_rollout(
    kube: Kube, namespace: str, operator_without_prometheus: OperatorProcess, tmp_path: Path
) -> None:
    ns, plugin = namespace, Plugin(kube, namespace)
    kube.apply(POLICY, "-n", ns)
    first = wait_policy_status(
        kube, ns, "ranker", lambda s: s.get("phase") == "Healthy", "Healthy", operator_without_prometheus
    )["stableRevision"]

    # status and history of a Healthy policy
    table = plugin.run("status", "ranker").stdout
    assert "Healthy" in table and first in table and "Last decisions" in table
    s = plugin.json("status", "ranker")
    assert s["phase"] == "Healthy" and s["stableRevision"] == first and s["upToDate"] is True
    assert [d["kind"] for d in s["decisions"]] == ["Initial"]
    h = yaml.safe_load(plugin.run("history", "ranker", "-o", "yaml").stdout)
    assert [(r["revision"], r["outcome"]) for r in h["revisions"]] == [(first, "Promoted")]
    assert "Revisions of" in plugin.run("history", "ranker").stdout

    # a change: a canary that holds (no Prometheus)
    changed = copy.deepcopy(POLICY)
    changed["spec"]["lanes"][0]["maxQueueDelay"] = "3ms"
    kube.apply(changed, "-n", ns)
    canary = wait_policy_status(
        kube,
        ns,
        "ranker",
        lambda s: s.get("canaryRevision") and stalled(s),
        "a held canary",
        operator_without_prometheus,
    )
    rev = canary["canaryRevision"]
    s = plugin.json("status", "ranker")
    assert s["phase"] == "Progressing" and s["canaryRevision"] == rev
    assert s["step"] == {"index": 1, "of": 2, "weight": 25, "pause": "1h"}
    assert s["why"].startswith("Stalled (MetricsUnavailable)")
    assert {lane["lane"]: lane["outcome"] for lane in s["lanes"]} == {"interactive": "Error", "background": "Error"}
    assert {lane["lane"]: lane["p99LatencySlo"] for lane in s["lanes"]} == {"interactive": 0.05, "background": 1.0}

    # pause -> Paused, with who in the ledger
    out = plugin.json("pause", "ranker", "--wait", "60")
    assert out["phase"] == "Paused" and out["by"].startswith("admin@")
    paused = policy_status(kube, ns, "ranker")["ledger"][-1]
    assert paused["kind"] == "Paused" and paused["evidence"] == out["by"]
    # resume -> continues (held again on metrics)
    out = plugin.json("resume", "ranker", "--wait", "60")
    assert out["phase"] == "Progressing"
    annotations = (kube.get("batchingpolicy", "ranker", ns) or {})["metadata"].get("annotations", {})
    assert "batchpilot.dev/pause" not in annotations and annotations["batchpilot.dev/resume"] == out["by"]
    resumed = next(e for e in reversed(policy_status(kube, ns, "ranker")["ledger"]) if e["kind"] == "Resumed")
    assert resumed["evidence"].startswith(f"by {out['by']};") and out["by"].startswith("admin@")

    # abort -> RolledBack; the ledger and an Event name the user
    out = plugin.json("abort", "ranker", "--wait", "60")
    assert out["phase"] == "RolledBack"
    st = policy_status(kube, ns, "ranker")
    command = next(e for e in reversed(st["ledger"]) if e["kind"] == "Command")
    assert command["reason"] == "abort" and command["evidence"] == out["by"] and out["by"].startswith("admin@")
    assert st["history"][-1]["outcome"] == "Aborted" and out["by"] in st["history"][-1]["evidence"]

    def aborted_event() -> bool:
        events = yaml.safe_load(
            kube.kubectl(
                "get", "events", "-n", ns, "--field-selector", "involvedObject.name=ranker", "-o", "yaml"
            ).stdout
        )["items"]
        return any(e["reason"] == "Aborted" and out["by"] in e["message"] for e in events)

    kube.wait_for(aborted_event, 10, "the Aborted Event naming who aborted")

    rolled = plugin.run("status", "ranker").stdout
    assert "RolledBack" in rolled and out["by"] in rolled
    report = os.environ.get("BATCHPILOT_PLUGIN_REPORT")
    if report:
        Path(report).write_text(rolled)
    sys.stderr.write("\n[kubectl batchpilot status, rolled back]\n" + rolled)
    h = plugin.json("history", "ranker")
    assert [r["outcome"] for r in h["revisions"]] == ["Promoted", "Aborted"]
    assert [f["revision"] for f in h["failedRevisions"]] == [rev]

    # retry -> the same revision canaries again; promote -> stable
    out = plugin.json("retry", "ranker", "--wait", "60")
    again = wait_policy_status(
        kube, ns, "ranker", lambda s: s.get("canaryRevision") == rev, "the retried canary", operator_without_prometheus
    )
    assert again["phase"] in ("Progressing",)
    out = plugin.json("promote", "ranker", "--wait", "60")
    done = wait_policy_status(
        kube, ns, "ranker", lambda s: s.get("stableRevision") == rev, "promoted", operator_without_prometheus
    )
    assert done["history"][-1]["outcome"] == "Promoted" and out["by"] in done["history"][-1]["evidence"]


def test_history_keeps_every_decision_after_status_has_moved_on(
    kube: Kube, namespace: str, operator_without_prometheus: OperatorProcess
) -> None:
    """More decisions than status holds (pauses and resumes of a held canary, analysed every
    second meanwhile): ``history`` still shows every one, in order, from the ledger ConfigMap."""
    ns, op = namespace, operator_without_prometheus
    kube.apply(POLICY, "-n", ns)
    seen: list[str] = []  # every decision, as status showed it (it holds far more than one step adds)

    def record(st: dict[str, Any]) -> dict[str, Any]:
        for e in st.get("ledger", []):
            line = json.dumps(e, sort_keys=True)
            if e["kind"] != "Analysis" and line not in seen:
                seen.append(line)
        return st

    record(wait_policy_status(kube, ns, "ranker", lambda s: s.get("phase") == "Healthy", "Healthy", op))
    changed = copy.deepcopy(POLICY)
    changed["spec"]["lanes"][0]["maxQueueDelay"] = "3ms"
    kube.apply(changed, "-n", ns)
    rev = record(wait_policy_status(kube, ns, "ranker", lambda s: stalled(s), "a held canary", op))["canaryRevision"]

    def analyses(s: dict[str, Any]) -> int:
        return sum(e["kind"] == "Analysis" for e in s.get("ledger", []))

    record(wait_policy_status(kube, ns, "ranker", lambda s: analyses(s) >= ANALYSIS_LIMIT, "analyses fill status", op))
    cycles = DECISION_LIMIT // 2 + 2
    for i in range(cycles):
        kube.kubectl("annotate", "batchingpolicy", "ranker", "-n", ns, "--overwrite", f"batchpilot.dev/pause=a@{i}")
        record(wait_policy_status(kube, ns, "ranker", lambda s: s.get("paused") is True, "paused", op))
        kube.kubectl(
            "annotate", "batchingpolicy", "ranker", "-n", ns, "--overwrite",
            "batchpilot.dev/pause-", f"batchpilot.dev/resume=a@{i}",
        )  # fmt: skip
        record(wait_policy_status(kube, ns, "ranker", lambda s: not s.get("paused"), "resumed", op))
    st = policy_status(kube, ns, "ranker")
    record(st)
    in_status = [e for e in st["ledger"] if e["kind"] != "Analysis"]
    assert len(seen) > len(in_status) == DECISION_LIMIT, "status no longer holds them all"
    assert analyses(st) == ANALYSIS_LIMIT

    h = Plugin(kube, ns).json("history", "ranker")
    assert "archiveError" not in h
    assert [json.dumps(e, sort_keys=True) for e in h["decisions"]] == seen
    kinds = [(e["kind"], e["revision"]) for e in h["decisions"]]
    assert kinds[0][0] == "Initial" and ("CanaryStarted", rev) in kinds
    assert kinds.count(("Paused", rev)) == kinds.count(("Resumed", rev)) == cycles
    # The archive is a ConfigMap the policy owns, one key per revision, readable with kubectl.
    lines = kube.kubectl("get", "configmap", "ranker-ledger", "-n", ns, "-o", f"jsonpath={{.data.{rev}}}").stdout
    assert json.loads(lines.splitlines()[0])["kind"] == "CanaryStarted"


def test_errors_are_one_line(kube: Kube, namespace: str) -> None:
    result = Plugin(kube, namespace).run("status", "nope", check=False)
    assert result.returncode == 1
    assert f'batchingpolicy "nope" not found in namespace "{namespace}"' in " ".join(result.stderr.split())


@pytest.mark.parametrize("case", sorted(p.stem for p in (Path(__file__).parent / "fixtures" / "status").glob("*.json")))
def test_views_render_every_captured_status(case: str) -> None:
    from rich.console import Console

    from batchpilot_operator.oncall import render

    obj = json.loads((Path(__file__).parent / "fixtures" / "status" / f"{case}.json").read_text())["object"]
    summary = render.summary(obj)
    assert json.loads(json.dumps(summary)) == summary
    assert summary["phase"] == obj["status"]["phase"] and summary["upToDate"] is True
    console = Console(width=120, record=True)
    console.print(render.status_view(summary))
    console.print(render.history_view(render.history(obj)))
    text = console.export_text()
    assert obj["status"]["phase"] in text and obj["status"]["desiredRevision"] in text


def test_plugin_help_lists_the_commands() -> None:
    exe = shutil.which("kubectl-batchpilot", path=str(Path(sys.executable).parent))
    assert exe is not None
    out = subprocess.run([exe, "--help"], capture_output=True, text=True, check=True, timeout=30).stdout
    for verb in ("status", "history", "promote", "abort", "pause", "resume", "retry", "recommend"):
        assert verb in out
