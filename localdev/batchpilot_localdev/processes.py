"""Stopping what the development stack (and the tests and benchmarks) started: SIGTERM, a grace
period, then SIGKILL.

A process that starts children of its own (a control-plane component, Envoy, a runtime "pod",
containerd, the kubelet) runs in a session of its own (``start_new_session=True``), so that a
signal to its process group reaches them too: :func:`stop_group`, :func:`stop_groups`. One that
does not (the operator, Prometheus, Toxiproxy) is signalled alone: :func:`stop_process`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterable
from typing import Any


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
