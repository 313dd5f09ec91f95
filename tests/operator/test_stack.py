"""`batchpilot up` / `load` / `down` as a user runs them: the real local stack, left running between
commands, the examples applied with kubectl, a crash reported, and nothing left running after
`down` (no process with the work directory in its command line, the apiserver's port closed)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import bptest
from batchpilot_localdev.processes import pid_alive, processes_using
from batchpilot_localdev.stack import read_json
from bptest import REPO

pytestmark = pytest.mark.slow


def batchpilot(*args: str, timeout: float = 420) -> subprocess.CompletedProcess[str]:
    return bptest.batchpilot(*args, timeout=timeout)


def wait_for(pred: Any, timeout: float, what: str) -> Any:
    return bptest.wait_until(pred, timeout, what, interval=0.5)


@pytest.fixture
def workdir(tmp_path: Path) -> Iterator[Path]:
    work = tmp_path / "stack"
    yield work
    if processes_using(work):  # the test failed half way: leave nothing behind
        batchpilot("down", f"--workdir={work}", timeout=180)


def test_up_with_a_missing_trace_is_a_clear_error(workdir: Path) -> None:
    result = batchpilot("up", f"--workdir={workdir}", "--trace=/nonexistent/trace.csv")
    assert result.returncode == 1
    assert "arrival trace /nonexistent/trace.csv not found" in result.stderr
    assert not processes_using(workdir)


def test_up_apply_examples_healthy_crash_reported_down(workdir: Path) -> None:
    result = batchpilot("up", f"--workdir={workdir}", "--rate=1")
    assert result.returncode == 0, result.stdout + result.stderr
    kubeconfig = re.search(r"^export KUBECONFIG=(\S+)$", result.stdout, re.M)
    prom = re.search(r"^Prometheus: (http://127\.0\.0\.1:\d+)$", result.stdout, re.M)
    assert kubeconfig and prom, result.stdout
    state = read_json(workdir / "state.json")
    assert state is not None and state["phase"] == "up"

    again = batchpilot("up", f"--workdir={workdir}")
    assert again.returncode == 0 and again.stdout.startswith("already up"), again.stdout
    assert read_json(workdir / "state.json")["pid"] == state["pid"], "the same stack, not a second one"

    # what the user does next: kubectl apply of the examples, as they are
    env = {**os.environ, "KUBECONFIG": kubeconfig.group(1)}
    kubectl = state["kubectl"]
    subprocess.run([kubectl, "apply", "-k", str(REPO / "manifests" / "examples")], env=env, check=True, timeout=60)

    def phases() -> dict[str, str]:
        out = subprocess.run([kubectl, "get", "bp", "-o", "json"], env=env, capture_output=True, text=True, timeout=60)
        items = json.loads(out.stdout)["items"] if out.returncode == 0 else []
        return {i["metadata"]["name"]: (i.get("status") or {}).get("phase") for i in items}

    wait_for(lambda: set(phases().values()) == {"Healthy"} and len(phases()) == 3, 180, "every example Healthy")

    # the trace replay reaches the runtime processes, and Prometheus scrapes what they served
    def served() -> float:
        q = urllib.parse.quote('sum(batchpilot_requests_total{outcome="ok",policy="chat-embedder"})')
        with urllib.request.urlopen(f"{prom.group(1)}/api/v1/query?query={q}", timeout=10) as resp:
            result = json.loads(resp.read())["data"]["result"]
        return float(result[0]["value"][1]) if result else 0.0

    wait_for(lambda: served() > 0, 300, "load served by chat-embedder's runtimes, seen by Prometheus")

    changed = batchpilot("load", f"--workdir={workdir}", "--rate=2", timeout=180)
    assert changed.returncode == 0, changed.stdout + changed.stderr
    assert read_json(workdir / "state.json")["rate"] == 2.0

    # a part that dies is reported, not silent
    operator_pid = next(p["pid"] for p in read_json(workdir / "state.json")["parts"] if p["name"] == "operator")
    os.kill(operator_pid, signal.SIGKILL)
    wait_for(
        lambda: any(p["part"] == "operator" for p in (read_json(workdir / "state.json") or {}).get("problems", [])),
        30,
        "the crash in the state file",
    )
    crashed = batchpilot("up", f"--workdir={workdir}")
    assert crashed.returncode == 1
    assert re.search(r"^CRASHED: operator exited with -9 at \S+ \(log: .*operator\.log\)$", crashed.stdout, re.M)

    api_port = int(re.search(r"server: https://127\.0\.0\.1:(\d+)", Path(kubeconfig.group(1)).read_text()).group(1))  # type: ignore[union-attr]
    stopped = batchpilot("down", f"--workdir={workdir}", timeout=180)
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr
    assert processes_using(workdir) == [], "nothing of the stack is left running"
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", api_port), timeout=2):
        pass
    assert read_json(workdir / "state.json")["phase"] == "down"
    assert "no local stack is up" in batchpilot("down", f"--workdir={workdir}").stdout


def test_a_killed_supervisor_is_reported_and_its_parts_cleaned_up(workdir: Path) -> None:
    first = batchpilot("up", f"--workdir={workdir}", "--rate=0")
    assert first.returncode == 0, first.stdout + first.stderr
    state = read_json(workdir / "state.json")
    assert state is not None
    old_parts = {p["pid"] for p in state["parts"]}
    os.kill(state["pid"], signal.SIGKILL)  # the supervisor dies; its parts are orphaned, still running
    wait_for(lambda: not pid_alive(state["pid"]), 10, "the supervisor to die")
    assert any(pid in old_parts for pid, _ in processes_using(workdir))

    again = batchpilot("up", f"--workdir={workdir}", "--rate=0")
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"CRASHED: the previous stack's supervisor (pid {state['pid']}) is gone" in again.stdout
    assert "processes left over from an earlier stack" in again.stdout
    assert not old_parts & {pid for pid, _ in processes_using(workdir)}, "the orphans were stopped"
    assert read_json(workdir / "state.json")["pid"] != state["pid"]

    assert batchpilot("down", f"--workdir={workdir}", timeout=180).returncode == 0
    assert processes_using(workdir) == []
