"""The drill report writer: every row reaches both forms, with its outcome."""

from __future__ import annotations

import json
from pathlib import Path

from bpdrill import Drill, write_report


def test_report_has_every_drill_in_both_forms(tmp_path: Path) -> None:
    ok = Drill(name="prom_down", fault="Prometheus | stopped", expected="held", observed="held 300 s", passed=True)
    ok.detected(1.234)
    ok.recovered(40.0)
    bad = Drill(name="crash", fault="SIGKILL", passed=False, failure="AssertionError: two ledger entries")
    write_report([ok, bad], tmp_path)
    data = json.loads((tmp_path / "drills.json").read_text())
    assert [d["name"] for d in data["drills"]] == ["prom_down", "crash"]
    assert data["drills"][0]["time_to_detect_s"] == 1.23
    md = (tmp_path / "drills.md").read_text().splitlines()
    rows = [line for line in md if line.startswith("| prom_down") or line.startswith("| crash")]
    assert len(rows) == 2
    assert "Prometheus \\| stopped" in rows[0] and rows[0].endswith("| pass |")
    assert "FAIL: AssertionError: two ledger entries" in rows[1]
