"""Stopping what the development stack (and the tests and benchmarks) started: SIGTERM, a grace
period, then SIGKILL.

A process that starts children of its own (a control-plane component, Envoy, a runtime "pod",
containerd, the kubelet) runs in a session of its own (``start_new_session=True``), so that a
signal to its process group reaches them too: :func:`stop_group`, :func:`stop_groups`. One that
does not (the operator, Prometheus, Toxiproxy) is signalled alone: :func:`stop_process`.

By pid, as ``batchpilot up`` / ``down`` find what a stack left running: :func:`pid_alive`,
:func:`cmdline`, :func:`processes_using` (every process naming a work directory) and
:func:`stop_pids`. And what keeps two of them from starting over each other: :func:`try_lock`.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any


def try_lock(path: Path) -> IO[str] | None:
    """An exclusive ``flock`` on ``path`` (created if missing), held while the returned file stays
    open (the kernel releases it when the process ends, however it ends); None while another
    process holds it."""
    lock = path.open("w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        return None
    return lock


def stop_process(proc: subprocess.Popen[Any], timeout: float) -> None:
    """Stop a running ``proc`` (alone): SIGTERM, then SIGKILL when it has not exited ``timeout``
    seconds later."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def signal_group(proc: subprocess.Popen[Any], sig: int) -> None:
    """``sig`` to the process group of ``proc`` (one that is gone already needs nothing)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)


def stop_group(proc: subprocess.Popen[Any], timeout: float, sig: int = signal.SIGTERM) -> None:
    """Stop a running ``proc``: ``sig`` to its group, then SIGKILL to the group when it has not
    exited ``timeout`` seconds later."""
    if proc.poll() is not None:
        return
    signal_group(proc, sig)
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        signal_group(proc, signal.SIGKILL)
        proc.wait()


def stop_groups(procs: Iterable[subprocess.Popen[Any]], timeout: float) -> None:
    """Stop them all, in parallel: SIGTERM to every running one's group first, in the given order,
    so that each drains on its own; SIGKILL to the group of each still running ``timeout``
    seconds after that."""
    procs = list(procs)
    for proc in procs:
        if proc.poll() is None:
            signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            signal_group(proc, signal.SIGKILL)
            proc.wait()


def pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not yet reaped by its parent) is not running.
    with contextlib.suppress(OSError):
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    return True


def cmdline(pid: int) -> str | None:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    return " ".join(a.decode(errors="replace") for a in argv if a)


def processes_using(workdir: Path) -> list[tuple[int, str]]:
    """Running processes (not this one) whose command line names ``workdir``.

    Every part of the stack has the work directory in its arguments (configs, data, logs,
    kubeconfig), so after ``down`` this list is empty; the tests check exactly that.
    """
    needle = str(workdir.resolve())
    found: list[tuple[int, str]] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        cmd = cmdline(int(entry.name))
        if cmd is not None and needle in cmd and pid_alive(int(entry.name)):
            found.append((int(entry.name), cmd))
    return found


def stop_pids(procs: list[tuple[int, str]], grace: float = 15.0) -> None:
    """SIGTERM to each of ``procs`` (pid, command line), then SIGKILL to those still running
    ``grace`` seconds later."""
    for pid, _ in procs:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(pid_alive(pid) for pid, _ in procs):
        time.sleep(0.1)
    for pid, _ in procs:
        if pid_alive(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
