"""The drills: real faults injected into the real local stack, each one a test that also
writes a row of the drill report.

A drill test takes the ``drill`` fixture and fills in what it injected and what it saw::

    def test_prometheus_down(drill: Drill) -> None:
        drill.fault = "Prometheus stopped for 5 minutes mid-canary"
        drill.expected = "analyses Error, canary held (Stalled), resumes after"
        ...
        drill.detected(seconds)          # fault injected -> operator/alert noticed
        drill.recovered(seconds)         # fault removed -> back to normal
        drill.observed = "held 300 s, promoted 41 s after Prometheus came back"

Pass/fail in the report is the test's own outcome. Drills marked ``long_drill`` run only
under ``make drills`` (``BATCHPILOT_DRILLS=all``); the rest run in ``make test`` as well.
With ``BATCHPILOT_DRILL_REPORT=DIR`` the session writes DIR/drills.json and DIR/drills.md.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from bpdrill import Drill, write_report

_RECORDS: list[Drill] = []


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("BATCHPILOT_DRILLS") == "all":
        return
    skip = pytest.mark.skip(reason="long drill: runs under `make drills` (BATCHPILOT_DRILLS=all)")
    for item in items:
        if item.get_closest_marker("long_drill"):
            item.add_marker(skip)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    report: pytest.TestReport = yield
    record = getattr(item, "_bp_drill", None)
    if isinstance(record, Drill) and report.when == "call":
        record.passed = report.passed
        if report.failed:
            record.failure = str(report.longrepr).strip().splitlines()[-1][:300] if report.longrepr else "failed"
    return report


@pytest.fixture
def drill(request: pytest.FixtureRequest) -> Drill:
    record = Drill(name=request.node.name)
    request.node._bp_drill = record
    _RECORDS.append(record)
    return record


def pytest_sessionfinish(session: pytest.Session) -> None:
    out = os.environ.get("BATCHPILOT_DRILL_REPORT")
    if out and _RECORDS:
        write_report(_RECORDS, Path(out))
