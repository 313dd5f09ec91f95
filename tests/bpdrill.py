"""The drill report's row, and the writer of its JSON and Markdown forms (pure)."""

from __future__ import annotations

import json
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class Drill:
    name: str
    fault: str = ""
    expected: str = ""
    observed: str = ""
    time_to_detect_s: float | None = None
    time_to_recover_s: float | None = None
    requests_sent: int | None = None
    requests_failed: int | None = None
    requests_lost: int | None = None
    figures: dict[str, float | int | str] = field(default_factory=dict)
    passed: bool | None = None
    failure: str = ""

    def detected(self, seconds: float) -> None:
        self.time_to_detect_s = round(seconds, 2)

    def recovered(self, seconds: float) -> None:
        self.time_to_recover_s = round(seconds, 2)


def _cell(value: object) -> str:
    if value is None:
        return "-"
    return str(value).replace("|", "\\|").replace("\n", " ")


def write_report(drills: list[Drill], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    meta = {
        "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": platform.node(),
        "loadavg": Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else None,
    }
    (out / "drills.json").write_text(json.dumps({"meta": meta, "drills": [asdict(d) for d in drills]}, indent=2) + "\n")
    lines = [
        "# Drill report",
        "",
        f"Written {meta['written']} (load average {' '.join(meta['loadavg'] or [])}).",
        "",
        "| drill | fault | expected | observed | time to detect (s) | time to recover (s) | requests sent / failed / lost | result |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for d in drills:
        result = "pass" if d.passed else ("FAIL: " + d.failure if d.passed is False else "not run")
        requests = f"{_cell(d.requests_sent)} / {_cell(d.requests_failed)} / {_cell(d.requests_lost)}"
        lines.append(
            f"| {_cell(d.name)} | {_cell(d.fault)} | {_cell(d.expected)} | {_cell(d.observed)} | "
            f"{_cell(d.time_to_detect_s)} | {_cell(d.time_to_recover_s)} | {requests} | {_cell(result)} |"
        )
    (out / "drills.md").write_text("\n".join(lines) + "\n")
