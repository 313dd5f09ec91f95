"""`kubectl batchpilot list [-A]` and `kubectl batchpilot status NAME -w` against the real control
plane and a real operator process, run as on-call runs them (kubectl's plugin lookup), plus the
pure pieces (kubectl's age format, rows of captured objects, which watch events draw a frame).

The watch is checked both through a pipe (a new frame per change) and on a pseudo-terminal
(redrawn in place by rich's Live), and ends with exit code 0 on SIGINT, as Ctrl-C sends it.
"""

from __future__ import annotations

import copy
import fcntl
import json
import os
import pty
import signal
import struct
import subprocess
import termios
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from batchpilot_operator.oncall.listing import StatusFrames, human_duration, list_rows
from bptest import INTERACTIVE_LANE, Kube, OperatorProcess, Plugin, policy, wait_policy_status

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "status"

# ---- pure ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (-5, "<invalid>"),
        (-1, "0s"),
        (0, "0s"),
        (119, "119s"),
        (120, "2m"),
        (125, "2m5s"),
        (600, "10m"),
        (179 * 60, "179m"),
        (3 * 3600 + 5 * 60, "3h5m"),
        (8 * 3600, "8h"),
        (47 * 3600, "47h"),
        (50 * 3600, "2d2h"),
        (9 * 86400, "9d"),
        (800 * 86400, "2y70d"),
        (9 * 365 * 86400, "9y"),
    ],
)
def test_ages_read_as_kubectl_prints_them(seconds: int, text: str) -> None:
    assert human_duration(seconds) == text


def fixture(case: str) -> dict[str, Any]:
    obj: dict[str, Any] = json.loads((FIXTURES / f"{case}.json").read_text())["object"]
    return obj


def test_rows_of_captured_policies() -> None:
    objs = [fixture(c) for c in ("rolled-back", "canary-stalled", "healthy")]
    for i, obj in enumerate(objs):
        obj["metadata"]["name"] = f"p{2 - i}"
        obj["metadata"]["creationTimestamp"] = "2026-11-30T10:00:00Z"
    now = datetime(2026, 11, 30, 10, 5, 30, tzinfo=UTC)
    rows = {r["name"]: r for r in list_rows(objs, now)}
    assert [r["name"] for r in list_rows(objs, now)] == ["p0", "p1", "p2"], "sorted by name"
    canary = rows["p1"]
    st = objs[1]["status"]
    assert canary["phase"] == "Progressing" and canary["canaryRevision"] == st["canaryRevision"]
    assert canary["canaryWeight"] == st["canaryWeight"]
    assert canary["step"] == f"{st['currentStepIndex'] + 1}/{st['stepCount']}"
    assert canary["lastAnalysis"]["outcome"] == st["lastAnalysis"]["outcome"]
    assert canary["age"] == "5m30s"
    healthy = rows["p0"]
    assert healthy["canaryRevision"] is None and healthy["canaryWeight"] is None and healthy["step"] is None


def test_frames_draw_only_on_visible_change() -> None:
    obj = fixture("canary-stalled")
    frames = StatusFrames("ranker")
    assert frames.on_event("ADDED", obj) is not None
    same = copy.deepcopy(obj)
    same["metadata"]["resourceVersion"] = "999"
    assert frames.on_event("MODIFIED", same) is None, "nothing visible changed"
    assert frames.resource_version == "999"
    assert frames.on_event("BOOKMARK", {"metadata": {"resourceVersion": "1000"}}) is None
    assert frames.resource_version == "1000"
    paused = copy.deepcopy(same)
    paused["status"]["phase"] = "Paused"
    assert frames.on_event("MODIFIED", paused) is not None
    assert frames.on_event("DELETED", paused) is not None and frames.deleted
    assert frames.on_event("ADDED", paused) is not None, "drawn again when it comes back"


# ---- the real control plane and operator --------------------------------------------------------

POLICY: dict[str, Any] = policy(
    "ranker",
    lanes=[dict(INTERACTIVE_LANE)],
    rollout={
        "steps": [{"weight": 25, "pause": "1h"}, {"weight": 50, "pause": "1h"}],
        "analysisInterval": "1s",
        "onMetricsUnavailable": {"action": "Hold"},
    },
)


@pytest.fixture
def other_namespace(kube: Kube) -> Iterator[str]:
    name = f"t-{uuid.uuid4().hex[:8]}"
    kube.kubectl("create", "namespace", name)
    yield name
    kube.kubectl("delete", "namespace", name, "--wait=false", check=False)


class Output:
    """Collects what a process writes to one file descriptor, on a thread."""

    def __init__(self, fd: int) -> None:
        self.fd, self.chunks, self.lock = fd, [b""], threading.Lock()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self.fd, 65536)
            except OSError:  # a pty's master reads EIO once the child side is closed
                return
            if not data:
                return
            with self.lock:
                self.chunks.append(data)

    @property
    def text(self) -> str:
        with self.lock:
            return b"".join(self.chunks).decode(errors="replace")

    def wait_for(self, needle: str, after: int = 0, timeout: float = 60) -> int:
        """Wait until ``needle`` appears at or after offset ``after``; its offset."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pos = self.text.find(needle, after)
            if pos >= 0:
                return pos
            time.sleep(0.05)
        raise AssertionError(f"{needle!r} not shown within {timeout}s; output:\n{self.text[-4000:]}")


def watch_cmd(kube: Kube, ns: str) -> list[str]:
    return [kube.kubectl_bin, "batchpilot", "status", "ranker", "-w", "-n", ns, "--kubeconfig", str(kube.kubeconfig)]


def default_sigint() -> None:
    """Ctrl-C's disposition of a terminal session. A shell starts background jobs with SIGINT
    ignored and the watch would inherit that (CI or `make test &`); a user at a terminal has
    the default."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def stop(proc: subprocess.Popen[bytes]) -> int:
    proc.send_signal(signal.SIGINT)  # what Ctrl-C sends
    return proc.wait(timeout=20)


@pytest.mark.cluster
def test_list_and_watch_follow_a_rollout(
    kube: Kube, namespace: str, other_namespace: str, operator_without_prometheus: OperatorProcess, tmp_path: Path
) -> None:
    ns, plugin = namespace, Plugin(kube, namespace)
    assert "No BatchingPolicies found in namespace" in plugin.run("list").stderr
    kube.apply(POLICY, "-n", ns)
    first = wait_policy_status(
        kube, ns, "ranker", lambda s: s.get("phase") == "Healthy", "Healthy", operator_without_prometheus
    )["stableRevision"]
    other = copy.deepcopy(POLICY)
    other["metadata"]["name"] = "elsewhere"
    kube.apply(other, "-n", other_namespace)  # outside the operator's namespace: never reconciled

    table = plugin.run("list").stdout.splitlines()
    assert table[0].split() == ["NAME", "PHASE", "STABLE", "CANARY", "WEIGHT/STEP", "LAST", "ANALYSIS", "AGE"]
    assert table[1].split()[:5] == ["ranker", "Healthy", first, "-", "-"]
    assert len(table) == 2, "only this namespace"
    everywhere = plugin.run("list", "-A").stdout.splitlines()
    assert everywhere[0].split()[0] == "NAMESPACE"
    # (other tests of the session may have left policies in their own namespaces)
    ours = {tuple(line.split()[:3]) for line in everywhere[1:] if line.split()[0] in (ns, other_namespace)}
    assert ours == {(ns, "ranker", "Healthy"), (other_namespace, "elsewhere", "-")}

    # the watch, through a pipe: one frame per change
    piped = subprocess.Popen(
        watch_cmd(kube, ns), stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=plugin.env, preexec_fn=default_sigint
    )
    assert piped.stdout is not None and piped.stderr is not None
    out, err = Output(piped.stdout.fileno()), Output(piped.stderr.fileno())
    # ... and on a terminal: redrawn in place
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 60, 200, 0, 0))
    tty = subprocess.Popen(
        watch_cmd(kube, ns),
        stdin=slave,
        stdout=slave,
        stderr=subprocess.PIPE,
        env=plugin.env,
        preexec_fn=default_sigint,
    )
    os.close(slave)
    screen = Output(master)
    try:
        at = out.wait_for("Healthy")
        screen.wait_for("Healthy")

        changed = copy.deepcopy(POLICY)
        changed["spec"]["lanes"][0]["maxQueueDelay"] = "3ms"
        kube.apply(changed, "-n", ns)
        st = wait_policy_status(
            kube,
            ns,
            "ranker",
            lambda s: s.get("canaryRevision") and s.get("lastAnalysis"),
            "analysed",
            operator_without_prometheus,
        )
        rev = st["canaryRevision"]
        at = out.wait_for(rev, at)
        out.wait_for("Progressing", at)
        screen.wait_for(rev)

        row = next(line for line in plugin.run("list").stdout.splitlines() if line.startswith("ranker"))
        assert row.split()[:6] == ["ranker", "Progressing", first, rev, f"{st['canaryWeight']}%", "1/2"]
        assert "Error" in row, "the last analysis outcome (no Prometheus)"
        rows = plugin.json("list")["items"]
        assert [(r["name"], r["phase"], r["step"]) for r in rows] == [("ranker", "Progressing", "1/2")]

        mark = len(screen.text)
        plugin.run("pause", "ranker", "--wait", "60")
        out.wait_for("Paused", at)
        screen.wait_for("Paused", mark)
        assert "\x1b[" in screen.text[mark:], "the terminal view is redrawn in place (cursor control)"
        frames_piped = out.text.count("ranker at ")
        assert frames_piped >= 3, out.text
        assert "\x1b[" not in out.text, "no cursor control into a pipe"
    finally:
        codes = (stop(piped), stop(tty))
    assert codes == (0, 0), (err.text, out.text[-2000:])
    piped.stderr.close()
    assert "Traceback" not in err.text and "KeyboardInterrupt" not in err.text
    screen.thread.join(5)
    assert screen.text.rstrip().endswith("\x1b[?25h") or "\x1b[?25h" in screen.text[-200:], "cursor shown again"
    os.close(master)


@pytest.mark.cluster
def test_watch_of_a_missing_policy_is_a_one_line_error(kube: Kube, namespace: str) -> None:
    result = Plugin(kube, namespace).run("status", "nope", "-w", check=False)
    assert result.returncode == 1
    assert f'batchingpolicy "nope" not found in namespace "{namespace}"' in " ".join(result.stderr.split())


def test_list_view_marks_an_unobserved_generation() -> None:
    from rich.console import Console

    from batchpilot_operator.oncall.listing import list_view

    obj = fixture("healthy")
    obj["metadata"]["generation"] = obj["status"]["observedGeneration"] + 1
    now = datetime.now(UTC) + timedelta(seconds=1)
    console = Console(width=160, record=True)
    console.print(list_view(list_rows([obj], now), all_namespaces=False))
    assert "Healthy*" in console.export_text()
