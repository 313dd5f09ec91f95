"""Shared fixtures of the operator tests.

Prometheus: ``prometheus_factory`` (function scope; call it with a list of
``ScrapeTarget`` or ``(address, labels)`` pairs and keyword arguments of
``start_prometheus``; everything it started is stopped at teardown) and ``prometheus`` (one
server with no targets yet: add them with ``set_targets``). Tests using them are marked
``@pytest.mark.prometheus``; they fail when the binary is missing (hack/setup.sh installs it).
The implementation lives in ``batchpilot_localdev.prometheus`` (the demo uses it too).

``operator_without_prometheus``: the operator process watching the test's namespace, with a
Prometheus URL nothing listens on, so a canary's analysis reports Error and, under ``Hold``,
the canary stays put for the test to drive.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from batchpilot_localdev.prometheus import PROMETHEUS_BIN, PrometheusServer, ScrapeTarget, start_prometheus
from bptest import NO_PROMETHEUS, Kube, OperatorProcess, start_operator


def _require_prometheus() -> None:
    if not os.access(PROMETHEUS_BIN, os.X_OK):
        pytest.fail(f"prometheus binary not found ({PROMETHEUS_BIN}): run hack/setup.sh (apt-get install prometheus)")


def _target(t: ScrapeTarget | tuple[str, dict[str, str]]) -> ScrapeTarget:
    return t if isinstance(t, ScrapeTarget) else ScrapeTarget(t[0], dict(t[1]))


@pytest.fixture
def prometheus_factory(tmp_path: Path) -> Iterator[Callable[..., PrometheusServer]]:
    _require_prometheus()
    started: list[PrometheusServer] = []

    def factory(targets: Sequence[ScrapeTarget | tuple[str, dict[str, str]]] = (), **kwargs: Any) -> PrometheusServer:
        server = start_prometheus(tmp_path / f"p{len(started)}", [_target(t) for t in targets], **kwargs)
        started.append(server)
        return server

    yield factory
    for server in started:
        server.stop()


@pytest.fixture
def prometheus(prometheus_factory: Callable[..., PrometheusServer]) -> PrometheusServer:
    return prometheus_factory()


@pytest.fixture
def operator_without_prometheus(kube: Kube, namespace: str, tmp_path: Path) -> Iterator[OperatorProcess]:
    op = start_operator(kube, namespace, tmp_path, prometheus_url=NO_PROMETHEUS)
    yield op
    op.stop()
