"""Capacity under an SLO, predicted and measured by a ramp; the recommended setting against the grid's best.

"Capacity" here is what ``batchpilot tune`` and ``recommend`` state: the highest rate at which a
setting keeps the p99 latency under the SLO on a given arrival shape. For each trace and each
batching setting of the grid:

* **predicted**: the tuner's search restricted to that one setting (margin 0), on the trace
  slice, with each profile: ``gap_mean`` (``batchpilot profile`` with idle gaps, read by its
  mean) and ``live`` (the runtime's own ``/admin/profile`` from the runs at ``--current``: the
  pods' profile, what the live path uses for every candidate);
* **measured**: a ramp of fresh runtimes replaying the same slice open-loop, the rate rising by
  ``--step`` from half the ``gap_mean`` prediction until the server's own p99 (its outcome
  record, what Prometheus and the SLO read) breaches twice in a row, then bisected
  ``--bisect`` times between the last pass and the first breach. Capacity is the highest
  passing rate below the lowest rate that breached, among all the ramp's points.

The same ramp is read again against the SLO less ``--margin`` (0.2, as ``tune`` and ``recommend``
default): its capacity there from the same points, descending where no measured rate met it and
bisected like the first.

Then per trace, the **recommended** setting two ways, each judged against the target it ranks by
(``of_best`` 1.0: it meets that target at every rate any setting of the grid does; the issue asks
within 10% of the grid's best): ``at_margin``, the highest predicted capacity under the SLO less the
margin (what ``tune`` and ``recommend`` recommend) against the ramps read at the SLO less the margin;
``margin_0``, the highest predicted capacity under the SLO against the ramps at the SLO. A latency
margin rules out the settings whose p99 floor (window plus a full batch's pass) lies between the
two targets, so the two rankings can pick different settings.

Usage: .venv/bin/python bench/capacity_ramp.py [--requests 600] [--repeats 3] --out bench/results/capacity_ramp.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import benchlib  # noqa: E402
import latency_model_grid as grid  # noqa: E402
import tune_validation as tv  # noqa: E402
from batchpilot_operator.tune.profile import LatencyProfile  # noqa: E402
from batchpilot_operator.tune.search import SLOTargets, search  # noqa: E402
from batchpilot_operator.tune.simulator import LaneSettings  # noqa: E402
from batchpilot_operator.tune.trace import Trace  # noqa: E402
from batchpilot_runtime.config import format_duration, parse_duration  # noqa: E402


def log(msg: str) -> None:
    print(f"[capacity_ramp {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def predicted_capacity(
    trace: Trace, profile: LatencyProfile, settings: LaneSettings, slo: float, margin: float = 0.0
) -> float:
    """The tuner's capacity for exactly this setting under the SLO less ``margin`` (0: it meets
    the SLO at no rate, which the search reports by raising)."""
    try:
        got = search(
            trace,
            profile,
            SLOTargets(p99_latency=slo, queue_age=slo, margin=margin),
            batch_sizes=[settings.max_batch_size],
            windows=[settings.max_queue_delay],
            max_queue_length=settings.max_queue_length,
            request_timeout=settings.request_timeout,
        )
    except ValueError:
        return 0.0
    return float(got.capacity)


class Ramp:
    """Measured p99 (server side) of one setting at rising rates."""

    def __init__(self, tmp: Path, args: argparse.Namespace, trace: Trace, settings: LaneSettings) -> None:
        self.tmp, self.args, self.trace, self.settings = tmp, args, trace, settings
        self.points: list[dict[str, Any]] = []
        self.live_doc: dict[str, Any] | None = None
        self.capped = False

    def p99_at(self, rate: float) -> float | None:
        offsets = [round(t, 6) for t in self.trace.scaled_arrivals(rate)]
        run, live_doc = grid.run_once(self.tmp, self.args, self.settings, offsets, {})
        self.live_doc = self.live_doc or live_doc
        p99 = run["server"].get("observed_p99_ms")
        self.points.append(
            {"rate_rps": round(rate, 2), "server_p99_ms": p99, "client_p99_ms": run["client_p99_ms"],
             "send_lag_p99_ms": run["send_lag_p99_ms"]}
        )  # fmt: skip
        return p99

    def capacity(self, start: float, slo_ms: float) -> float | None:
        """Highest passing rate below the first breach (None: even ``start`` breached twice)."""
        rate, passed, failed, misses = min(start, self.args.max_rate), None, None, 0
        while rate <= self.args.max_rate:
            p99 = self.p99_at(rate)
            if p99 is not None and p99 <= slo_ms:
                passed, misses = rate, 0
                if failed is not None:
                    break
            else:
                failed = rate if failed is None or rate < failed else failed
                misses += 1
                if misses >= 2 or passed is not None:
                    break
            rate *= self.args.step if failed is None else 1 / self.args.step
        if passed is None:
            return None
        if failed is None:
            self.capped = True  # reached --max-rate without a breach: a lower bound
            return passed
        return self._bisect(slo_ms)

    def bracket(self, slo_ms: float) -> tuple[float | None, float | None]:
        """From every point measured so far: the lowest rate that breached ``slo_ms`` and the
        highest rate below it that met it."""
        failed = min((p["rate_rps"] for p in self.points if not _meets(p, slo_ms)), default=None)
        passed = max(
            (p["rate_rps"] for p in self.points if _meets(p, slo_ms) and (failed is None or p["rate_rps"] < failed)),
            default=None,
        )
        return passed, failed

    def _bisect(self, slo_ms: float) -> float | None:
        for _ in range(self.args.bisect):
            passed, failed = self.bracket(slo_ms)
            if passed is None or failed is None:
                break
            self.p99_at((passed * failed) ** 0.5)
        return self.bracket(slo_ms)[0]

    def capacity_below(self, slo_ms: float) -> tuple[float | None, bool]:
        """Capacity under a tighter ``slo_ms`` after :meth:`capacity` ramped the setting: from the
        same points, descending (``--step`` squared at a time, at most twice) where no measured rate
        met it, then bisected like the first. The flag: no measured rate breached it (a lower bound)."""
        passed, failed = self.bracket(slo_ms)
        descents = 0
        while passed is None and descents < 2 and self.points:
            lowest = min(p["rate_rps"] for p in self.points)
            if lowest / self.args.step**2 < 1.0:
                break
            self.p99_at(lowest / self.args.step**2)
            descents += 1
            passed, failed = self.bracket(slo_ms)
        if passed is None:
            return None, False
        if failed is None:
            return passed, True
        return self._bisect(slo_ms), False


def _meets(point: dict[str, Any], slo_ms: float) -> bool:
    p99 = point["server_p99_ms"]
    return p99 is not None and p99 <= slo_ms


def _round(rate: float | None) -> float | None:
    return round(rate, 1) if rate is not None else None


def _median_capacity(ramps: list[tuple[float | None, bool]]) -> tuple[float | None, bool]:
    """The median of the ramps' capacities (a ramp that met the target at no rate counts as 0,
    and a median of 0 is None) and whether it is a lower bound (a ramp reached ``--max-rate``)."""
    mid = statistics.median(r or 0.0 for r, _ in ramps)
    return (mid or None), any(capped for _, capped in ramps)


def _spread(rates: list[float | None]) -> float | None:
    """(max - min) / median of the ramps' capacities (None with one ramp or a median of 0)."""
    got = sorted(r or 0.0 for r in rates)
    if len(got) < 2:
        return None
    med = statistics.median(got)
    return round((got[-1] - got[0]) / med, 3) if med else None


def _errors(measured: float | None, lower_bound: bool, **predicted: float) -> dict[str, float | None]:
    """Each prediction's error against a measured capacity (None where there is none to compare:
    nothing met the target, or nothing breached it)."""
    return {k: round(v / measured - 1, 3) if measured and not lower_bound else None for k, v in predicted.items()}


def _recommended(rows: dict[LaneSettings, dict[str, Any]], ranked_by: str, measured_key: str) -> dict[str, Any]:
    """Per profile, the setting with the highest predicted capacity (``ranked_by``) and its
    measured capacity (``measured_key``) against the grid's best; ``of_best`` 1.0: the recommended
    setting meets the target at every rate any setting of the grid does."""
    measured = [r[measured_key] for r in rows.values() if r[measured_key]]
    best = max(measured) if measured else None
    out: dict[str, Any] = {"best_measured_rps": best}
    for name in ("gap_mean", "live"):
        chosen = max(rows, key=lambda s: rows[s][ranked_by][name])
        got = rows[chosen][measured_key]
        out[name] = {
            "setting": rows[chosen]["setting"],
            "measured_rps": got,
            "of_best": round(got / best, 3) if got and best else None,
        }
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--code-start", type=int, default=2000)
    ap.add_argument("--settings", default="1:1ms,4:2ms,8:2ms,16:5ms,32:10ms,64:20ms")
    ap.add_argument("--current", default="8:2ms", help="the setting whose runtime profile is the live path's")
    ap.add_argument("--slo", default="code=150ms,conversation=40ms", help="p99 SLO per trace")
    ap.add_argument("--traces", default="code,conversation")
    ap.add_argument(
        "--margin", type=float, default=0.2, help="the recommendation's margin under the SLO (tune's default)"
    )
    ap.add_argument("--repeats", type=int, default=1, help="ramps per setting (the capacity: their median)")
    ap.add_argument("--step", type=float, default=1.2)
    ap.add_argument("--bisect", type=int, default=2)
    ap.add_argument("--max-rate", type=float, default=2500.0)
    ap.add_argument("--source", default="builtin:mlp")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--calib-rate", type=float, default=20.0, help="the steady stream that measures request overhead")
    ap.add_argument("--pin", choices=benchlib.PIN_MODES, default="auto", help="see benchlib.pin_for_bench")
    ap.add_argument("--out")
    args = ap.parse_args()
    args.pin_layout = benchlib.pin_for_bench(args.pin)
    slos = {k: parse_duration(v) for k, v in (x.split("=") for x in args.slo.split(","))}
    settings_list, current = grid.parse_settings(args.settings, args.current)
    started = time.time()
    log("profiling the model in-process with idle gaps (batchpilot profile's way), read by its mean")
    gap = tv.measure_profile(args.source, args.threads, [1, 2, 4, 8, 16, 32, 64], 40, gap=0.01)
    all_traces = grid.traces(args.requests, args.code_start)
    out_traces: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bp-capacity-ramp-") as tmpdir:
        tmp = Path(tmpdir)
        body = benchlib.mlp_body(1)
        gap_mean = gap.model_copy(
            update={"quantile": "mean", "request_overhead": tv.SteadyStream(tmp, args, body).overhead(gap)}
        )
        for trace_name in args.traces.split(","):
            trace, slo = all_traces[trace_name], slos[trace_name]
            # The current setting first: its runtime's profile is the live path's for every candidate.
            order = [current, *[s for s in settings_list if s != current]]
            # Each repeat ramps every setting once, in the same order, so the machine's drift over
            # the run falls on every setting alike; a setting's capacity is the median of its ramps.
            measured: dict[LaneSettings, list[tuple[float | None, bool, float | None, bool]]] = {s: [] for s in order}
            ramps: dict[LaneSettings, list[Ramp]] = {s: [] for s in order}
            live: LatencyProfile | None = None
            # Where each ramp starts, and the offline profile's prediction in the row.
            gap_predicted = {s: predicted_capacity(trace, gap_mean, s, slo) for s in order}
            for repeat in range(args.repeats):
                for s in order:
                    ramp = Ramp(tmp, args, trace, s)
                    full = ramp.capacity(max(gap_predicted[s] * 0.5, 5.0), slo * 1e3)
                    tight = ramp.capacity_below(slo * (1 - args.margin) * 1e3)
                    if not ramp.capped:
                        # Read again with the tighter target's probes: a rate that met the SLO less
                        # the margin met the SLO, so the two capacities cannot cross.
                        full = ramp.bracket(slo * 1e3)[0]
                    measured[s].append((full, ramp.capped, *tight))
                    ramps[s].append(ramp)
                    if live is None:
                        assert ramp.live_doc is not None
                        live = LatencyProfile.model_validate(ramp.live_doc)
                    log(f"{trace_name} repeat {repeat + 1}/{args.repeats} SLO {slo * 1e3:g} ms B={s.max_batch_size} "
                        f"W={format_duration(s.max_queue_delay)}: measured {measured[s][-1]}")  # fmt: skip
            assert live is not None
            rows: dict[LaneSettings, dict[str, Any]] = {}
            for s in order:
                pred_gap, pred_live = gap_predicted[s], predicted_capacity(trace, live, s, slo)
                pick_gap, pick_live = (predicted_capacity(trace, p, s, slo, args.margin) for p in (gap_mean, live))
                full, full_capped = _median_capacity([(m[0], m[1]) for m in measured[s]])
                tight, tight_capped = _median_capacity([(m[2], m[3]) for m in measured[s]])
                rows[s] = {
                    "setting": {"maxBatchSize": s.max_batch_size, "maxQueueDelay": format_duration(s.max_queue_delay)},
                    "predicted_rps": {"gap_mean": round(pred_gap, 1), "live": round(pred_live, 1)},
                    # What the recommendation ranks by: the capacity under the SLO less the margin.
                    "predicted_rps_at_margin": {"gap_mean": round(pick_gap, 1), "live": round(pick_live, 1)},
                    "measured_rps": _round(full),
                    "measured_at_max_rate": full_capped,
                    # The same ramps read against the SLO less the margin (what the ranking predicts).
                    "measured_rps_at_margin": _round(tight),
                    "measured_at_margin_unbreached": tight_capped,
                    # Each ramp's capacity, and their spread over the median: the noise floor.
                    "measured_rps_per_ramp": [_round(m[0]) for m in measured[s]],
                    "measured_rps_at_margin_per_ramp": [_round(m[2]) for m in measured[s]],
                    "spread": _spread([m[0] for m in measured[s]]),
                    "spread_at_margin": _spread([m[2] for m in measured[s]]),
                    "error": _errors(full, full_capped, gap_mean=pred_gap, live=pred_live),
                    "error_at_margin": _errors(tight, tight_capped, gap_mean=pick_gap, live=pick_live),
                    "ramps": [r.points for r in ramps[s]],
                }
                log(f"{trace_name} SLO {slo * 1e3:g} ms B={s.max_batch_size} W={format_duration(s.max_queue_delay)}: "
                    f"predicted {rows[s]['predicted_rps']} measured {rows[s]['measured_rps']} "
                    f"(spread {rows[s]['spread']}) error {rows[s]['error']}")  # fmt: skip
            rec = {
                # The ranking tune and recommend use (the SLO less the margin), judged by the ramps
                # read against that same target; and the ranking at margin 0 against the SLO itself.
                "at_margin": _recommended(rows, "predicted_rps_at_margin", "measured_rps_at_margin"),
                "margin_0": _recommended(rows, "predicted_rps", "measured_rps"),
            }
            within = {
                f"{name}{suffix}": f"{sum(abs(e) <= 0.15 for e in errs)} of {len(errs)}"
                for name in ("gap_mean", "live")
                for suffix, key in (("", "error"), ("_at_margin", "error_at_margin"))
                for errs in [[r[key][name] for r in rows.values() if r[key][name] is not None]]
            }
            out_traces[trace_name] = {
                "slo_p99_ms": slo * 1e3,
                "live_profile": live.model_dump(mode="json", by_alias=True, exclude_none=True) if live else None,
                "settings": list(rows.values()),
                "recommended": rec,
                "within_15pct": within,
            }
    out = {
        "command": " ".join(sys.argv),
        "machine": {
            "cores": os.cpu_count(),
            "pinned": args.pin_layout,
            "loadavg_1m_end": round(os.getloadavg()[0], 2),
        },
        "elapsed_s": round(time.time() - started, 1),
        "gap_mean_profile": gap_mean.model_dump(mode="json", by_alias=True, exclude_none=True),
        "traces": out_traces,
    }
    print(
        json.dumps({k: {kk: vv for kk, vv in v.items() if kk != "settings"} for k, v in out_traces.items()}, indent=2)
    )
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
