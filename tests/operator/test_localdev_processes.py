"""Stopping the development stack's processes (batchpilot_localdev/processes.py): the signal reaches
the children of the process group too, and one that ignores SIGTERM is killed after the grace."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

from batchpilot_localdev.processes import stop_group, stop_groups, stop_process


def spawn(tmp_path: Path, name: str, trap_term: bool = False) -> tuple[subprocess.Popen[bytes], Path]:
    """A shell in a session of its own with a child ``sleep``; the child's pid lands in a file."""
    pidfile = tmp_path / f"{name}.pid"
    trap = "trap '' TERM; " if trap_term else ""
    script = f"{trap}sleep 60 & echo $! > {pidfile}; wait"
    proc = subprocess.Popen(["sh", "-c", script], start_new_session=True)
    deadline = time.monotonic() + 10
    while not (pidfile.exists() and pidfile.read_text().strip()):
        assert time.monotonic() < deadline, "the shell did not start its child"
        time.sleep(0.02)
    return proc, pidfile


def gone(pidfile: Path) -> bool:
    pid = int(pidfile.read_text())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        # a zombie of a group leader already reaped counts as gone too
        stat = Path(f"/proc/{pid}/stat")
        if stat.exists() and stat.read_text().split()[2] == "Z":
            return True
        time.sleep(0.05)
    return False


def test_stop_group_reaches_the_children_and_kills_what_ignores_sigterm(tmp_path: Path) -> None:
    polite, polite_child = spawn(tmp_path, "polite")
    stop_group(polite, timeout=10)
    assert polite.returncode is not None and gone(polite_child)

    stubborn, stubborn_child = spawn(tmp_path, "stubborn", trap_term=True)
    started = time.monotonic()
    stop_group(stubborn, timeout=0.5)
    assert stubborn.returncode is not None and gone(stubborn_child)
    assert time.monotonic() - started < 5
    stop_group(stubborn, timeout=10)  # stopped already: nothing to do


def test_stop_groups_signals_all_first_and_shares_one_grace(tmp_path: Path) -> None:
    procs = [spawn(tmp_path, f"s{i}", trap_term=True) for i in range(3)]
    started = time.monotonic()
    stop_groups((p for p, _ in procs), timeout=1.0)
    assert time.monotonic() - started < 3, "one grace period for all, not one each"
    assert all(p.returncode is not None and gone(child) for p, child in procs)


def test_stop_process_terminates_then_kills_what_ignores_sigterm() -> None:
    polite = subprocess.Popen(["sleep", "60"])
    stop_process(polite, timeout=10)
    assert polite.returncode == -15
    stubborn = subprocess.Popen(["sh", "-c", "trap '' TERM; while :; do sleep 0.05; done"])
    time.sleep(0.2)  # the trap is set
    stop_process(stubborn, timeout=0.5)
    assert stubborn.returncode == -9
    stop_process(stubborn, timeout=10)  # stopped already: nothing to do
