"""Replay ``latency_model_grid.py --captures`` runs offline: where the live path's error comes from.

For every candidate run (a setting other than the current one) the model replays the arrivals
the server recorded, against the p99 it recorded (as the grid's server rows and the operator's
calibration do), with four profiles:

* ``own``: the run's own ``/admin/profile`` (in sample);
* ``current``: the profile of the current setting's run just before it (the live path);
* ``current_passes``: the current profile's passes with the run's own overheads
  (``requestOverhead``, ``dispatchDelay``, ``frontEndCost``);
* ``own_passes``: the run's own passes with the current profile's overheads.

If ``current_passes`` errs as ``current`` does and ``own_passes`` as ``own``, the live path's
error is in the passes, not in the overheads. ``band``: the live path's prediction with the current
profile's passes scaled to the quartiles of how the runs' passes differed from the current pods'
(the file's own spread, batch 1-8), and whether the server's p99 fell inside it: how wide a
prediction is once it carries the passes' noise. Beside each run: its request rate and the current
run's, and the ratio of its mean pass to the current profile's per batch size.

``elasticity``: how many percent the model's p99 moves per percent of pass time, on the run's
arrivals and setting with its own profile (passes x1.05 against x1): a property of the row, not of
the prediction. ``pass_drift``: how far the run's passes are from the current pods' (median over
batch sizes 1-8 of |ln(own p50 / current p50)|). A row whose p99 moves 4% per 1% of pass time
misses 20% on a 5% drift, whatever the model. Summary: rows within 20% per profile, and the live
path's count per elasticity band beside the in-sample one.

Usage: .venv/bin/python bench/grid_replay.py CAPTURES.jsonl[.gz] [--current 8:2ms] [--out F]
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import statistics
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from batchpilot_operator.tune.profile import LatencyProfile
from batchpilot_runtime.config import parse_duration
from latency_model_grid import model_check

OVERHEADS = ("request_overhead", "dispatch_delay", "front_end_cost")
SIZES = (1, 2, 4, 8, 16, 32, 64)


def read_runs(path: Path) -> Iterator[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def model_error(capture: dict[str, Any], profile: LatencyProfile) -> float | None:
    """The model's p99 / the server's p99 - 1 on the run's recorded arrivals."""
    got = model_check(capture, profile).last
    return None if got is None else round(got.raw_error, 3)


def rate(capture: dict[str, Any]) -> float | None:
    times = capture["lanes"][0]["outcomes"]["times"]
    return round((len(times) - 1) / (times[-1] - times[0]), 1) if len(times) > 1 and times[-1] > times[0] else None


def pass_ratios(own: dict[str, Any], current: dict[str, Any], column: str = "mean") -> dict[int, float]:
    mine = {p["batchSize"]: parse_duration(p[column]) for p in own["points"]}
    theirs = {p["batchSize"]: parse_duration(p[column]) for p in current["points"]}
    return {b: round(mine[b] / theirs[b], 2) for b in SIZES if b in mine and b in theirs and theirs[b] > 0}


def elasticity(
    capture: dict[str, Any], profile: LatencyProfile, base: float | None, step: float = 1.05
) -> float | None:
    """Percent the model's p99 moves per percent of pass time: passes x ``step`` against ``base``,
    the model's error with ``profile`` as it is."""
    up = model_error(capture, scaled_passes(profile, step))
    if base is None or up is None or base <= -1 or up <= -1:
        return None
    return round(math.log((1 + up) / (1 + base)) / math.log(step), 2)


def pass_drift(own: dict[str, Any], current: dict[str, Any]) -> float | None:
    """Median over batch sizes 1-8 of |ln(own p50 / current p50)| (p50: one stalled pass does
    not move it)."""
    logs = [abs(math.log(v)) for b, v in pass_ratios(own, current, "p50").items() if b <= 8 and v > 0]
    return round(statistics.median(logs), 3) if logs else None


def scaled_passes(profile: LatencyProfile, k: float) -> LatencyProfile:
    """The profile with every pass ``k`` times as long (its overheads as they are)."""
    points = [
        p.model_copy(update={q: getattr(p, q) * k for q in ("p50", "p90", "p99", "mean") if getattr(p, q) is not None})
        for p in profile.points
    ]
    return profile.model_copy(update={"points": points})


def quartiles(rows: list[dict[str, Any]]) -> tuple[float, float]:
    """The lower and upper quartile over the runs of their median pass ratio at batch 1-8."""
    ratios = sorted(
        statistics.median(small)
        for r in rows
        if (small := [v for b, v in r["pass_ratio_to_current"].items() if b <= 8])
    )
    return ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4]


def add_bands(
    rows: list[dict[str, Any]], runs: list[tuple[dict[str, Any], LatencyProfile]], low: float, high: float
) -> None:
    """Each row's live-path prediction at passes x ``low`` and x ``high``, and whether the server's
    p99 lies between them (``runs[i]`` holds row i's capture and the current profile)."""
    for row, (capture, current) in zip(rows, runs, strict=True):
        lo, hi = (model_error(capture, scaled_passes(current, k)) for k in (low, high))
        row["band"] = {
            "pass_scale": [low, high],
            "error": [lo, hi],
            "covers": None if lo is None or hi is None else min(lo, hi) <= 0 <= max(lo, hi),
            "width": None if lo is None or hi is None else round((1 + hi) / (1 + lo) - 1, 3),
        }


def replay(runs: Iterator[dict[str, Any]], current_setting: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    kept: list[tuple[dict[str, Any], LatencyProfile]] = []
    current: dict[str, Any] | None = None
    for run in runs:
        if run["setting"] == current_setting:
            current = run
            continue
        if current is None:
            continue
        own = LatencyProfile.model_validate(run["profile"])
        cur = LatencyProfile.model_validate(current["profile"])
        profiles = {
            "own": own,
            "current": cur,
            "current_passes": cur.model_copy(update={k: getattr(own, k) for k in OVERHEADS}),
            "own_passes": own.model_copy(update={k: getattr(cur, k) for k in OVERHEADS}),
        }
        errors = {name: model_error(run["capture"], p) for name, p in profiles.items()}
        rows.append(
            {
                **{k: run.get(k) for k in ("trace", "setting", "load", "repeat")},
                "rate_rps": rate(run["capture"]),
                "current_rate_rps": rate(current["capture"]),
                "error": errors,
                "pass_ratio_to_current": pass_ratios(run["profile"], current["profile"]),
                "elasticity": elasticity(run["capture"], own, errors["own"]),
                "pass_drift": pass_drift(run["profile"], current["profile"]),
            }
        )
        kept.append((run["capture"], cur))
    if rows:
        add_bands(rows, kept, *quartiles(rows))
    return rows


ELASTICITY_BANDS = ((0.0, 2.0), (2.0, 4.0), (4.0, math.inf))


def by_elasticity(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per elasticity band: runs, within 20% live (``current``) and in sample (``own``), and the
    median pass drift."""
    out = []
    for lo, hi in ELASTICITY_BANDS:
        sel = [r for r in rows if r.get("elasticity") is not None and lo <= r["elasticity"] < hi]
        drifts = [r["pass_drift"] for r in sel if r.get("pass_drift") is not None]
        out.append(
            {
                "elasticity": [lo, None if math.isinf(hi) else hi],
                "runs": len(sel),
                **{
                    f"{name}_within_20pct": sum(
                        1 for r in sel if (e := r["error"].get(name)) is not None and abs(e) <= 0.2
                    )
                    for name in ("current", "own")
                },
                "median_pass_drift": round(statistics.median(drifts), 3) if drifts else None,
            }
        )
    return out


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    bands = [r["band"] for r in rows if r.get("band", {}).get("covers") is not None]
    if bands:
        out["band"] = {
            "pass_scale": bands[0]["pass_scale"],
            "runs": len(bands),
            "covers": sum(1 for b in bands if b["covers"]),
            "median_width": round(statistics.median(b["width"] for b in bands), 3),
        }
    for name in ("own", "current", "current_passes", "own_passes"):
        errors = [r["error"][name] for r in rows if r["error"].get(name) is not None]
        out[name] = {
            "runs": len(errors),
            "within_20pct": sum(1 for e in errors if abs(e) <= 0.2),
            "median_abs_error": round(statistics.median(abs(e) for e in errors), 3) if errors else None,
        }
    out["by_elasticity"] = by_elasticity(rows)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("captures", type=Path)
    ap.add_argument("--current", default="8:2ms", help="the grid's --current setting, as B:W")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    rows = replay(read_runs(args.captures), args.current)
    for r in rows:
        e = r["error"]
        print(
            f"{r['trace'][:4]} {r['setting']:>8} {r['load']:.2f} #{r['repeat']} "
            f"{r['rate_rps']} req/s (current {r['current_rate_rps']}): "
            + " ".join(f"{k} {v:+.2f}" if v is not None else f"{k} -" for k, v in e.items())
            + f" passes/current {r['pass_ratio_to_current']} elasticity {r['elasticity']} drift {r['pass_drift']}"
        )
    summary = summarize(rows)
    print(json.dumps(summary, indent=2))
    if args.out:
        args.out.write_text(json.dumps({"command": " ".join(sys.argv), "summary": summary, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
