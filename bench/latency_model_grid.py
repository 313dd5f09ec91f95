"""The latency model against the runtime over a grid: traces x loads x settings, with repeats.

For each batching setting, its capacity is measured first: a fresh runtime under a closed loop
(``2 B`` clients, a few seconds), beside the model's own ceiling ``B / E(B)`` from the profile.
Then for each arrival trace (the bursty code trace; the conversation trace with its 3 s buckets
spread uniformly at random, seed 0, as its README asks) and each load (a fraction of that
measured capacity), a fresh runtime serves the trace slice open-loop ``--repeats`` times. Per run:

* **client**: p99 from the load generator (latency from the scheduled send time, so a late send
  counts against the server; the send lateness p99 is recorded);
* **server**: the runtime's own record of the same requests (``/admin/arrivals`` outcomes: the
  latency from the handler's start to the answer) and the model's p99 for *the arrivals the
  server saw*, through :func:`batchpilot_operator.tune.live.calibrate` — what the
  operator's calibration does live. It removes the load generator from the comparison. Beside
  the offline profiles and the run's own ``/admin/profile`` (``live``, in sample), two out of
  sample: ``live_previous`` (the profile of the previous run at the same setting) and
  ``live_current``, the live path of ``recommend``: the profile the pods running ``--current``
  measured serving the same trace at the same load in the run just before (each repeat runs the
  current setting first and then every other one; for the current setting's own rows, its
  previous run's; ``live_current_age_s`` per run), which predicts every candidate setting, the larger ones from the timed
  passes the runtime makes at start past its lanes' maxima (scaled by the runtime to the level
  its live batches run at: ``warmupScale``; ``live_current_unscaled`` undoes that scaling).

Per row (trace, setting, load): the prediction (the tuner's simulator on the scheduled
arrivals, with the profile measured in-process, the per-request overhead measured at load
as in tune_validation, and the HTTP front end at the CPU per request the runtime measured on
itself during the setting's capacity run, ``frontEndCost``), the measured median, min and max over the repeats, the **noise floor**
(the repeats' spread, (max - min) / median: the same setting measured again), and the error
(predicted / median - 1) printed beside it. Summary: share of rows within 20%, Spearman rank
correlation of predicted vs measured, per trace and overall, and the median noise floor.

Pinned cores (``--pin``, ``benchlib.pin_for_bench``): on 4 cores or more the runtime's processes
run on the cores after the first and the load generator on core 0; on 2 or 3 the runtime's model
process runs alone on the cores after the first and its server beside the load generator on
core 0 (pinning the whole runtime to one core would make its two processes contend). The JSON
records the layout.

Usage: .venv/bin/python bench/latency_model_grid.py [--requests 800] [--repeats 3] --out bench/results/latency_model_grid.json
"""

from __future__ import annotations

import argparse
import json
import math
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
import tune_validation as tv  # noqa: E402
from batchpilot_operator.tune.calibration import LaneCalibration  # noqa: E402
from batchpilot_operator.tune.captures import merge_traffic, parse_capture  # noqa: E402
from batchpilot_operator.tune.live import calibrate  # noqa: E402
from batchpilot_operator.tune.profile import LatencyProfile  # noqa: E402
from batchpilot_operator.tune.simulator import LaneSettings, simulate  # noqa: E402
from batchpilot_operator.tune.trace import Trace, load_trace  # noqa: E402
from batchpilot_runtime.config import format_duration, parse_duration  # noqa: E402

TRACES = BENCH.parent.parent / "shared" / "traces"
CODE = TRACES / "azure-llm-2023-code.csv"
CONVERSATION = TRACES / "mooncake-2025-conversation.csv"
BUCKET_S = 3.0


def log(msg: str) -> None:
    print(f"[latency_model_grid {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def parse_settings(settings: str, current: str) -> tuple[list[LaneSettings], LaneSettings]:
    """``--settings B:W,...`` and ``--current B:W`` as lane settings whose queue and timeout
    never bind (100000 rows, 30 s); the current one must be among the settings."""

    def one(spec: str) -> LaneSettings:
        b, w = spec.split(":")
        return LaneSettings(int(b), parse_duration(w), 100_000, 30.0)

    settings_list = [one(spec) for spec in settings.split(",")]
    if one(current) not in settings_list:
        raise SystemExit(f"--current {current} is not in --settings")
    return settings_list, one(current)


def traces(n: int, code_start: int) -> dict[str, Trace]:
    code = load_trace(CODE)
    conv = load_trace(CONVERSATION).spread(BUCKET_S, seed=0)
    return {
        "code": Trace.from_times(code.arrivals[code_start : code_start + n], code.source),
        "conversation": Trace.from_times(conv.arrivals[:n], conv.source + " (3 s buckets spread, seed 0)"),
    }


def spearman(xs: list[float], ys: list[float]) -> float | None:
    """Rank correlation (average ranks for ties); None below 3 pairs."""
    if len(xs) < 3:
        return None

    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        out = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    den = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return round(cov / den, 3) if den > 0 else None


def model_check(capture: dict[str, Any], profile: LatencyProfile) -> LaneCalibration:
    """The model on the arrivals one runtime recorded (its ``/admin/arrivals`` document), with
    ``profile``, against the p99 the runtime recorded for them: the operator's calibration check."""
    return calibrate(merge_traffic([parse_capture(capture, "bench")], "interactive"), profile, LaneCalibration())


def server_check(
    rt: tv.Runtime, since: float, profiles: dict[str, LatencyProfile]
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The model's p99 for the arrivals the server recorded vs the server's own p99 for them, with
    each given profile and with the runtime's own ``/admin/profile`` of this run (``live``); and
    that live profile's document (a later run's out-of-sample profile), and the capture read."""
    doc = tv.fetch_json(f"{rt.url}/admin/arrivals?since={since:.1f}s")
    live_doc = tv.fetch_json(f"{rt.url}/admin/profile")
    live = LatencyProfile.model_validate(live_doc)
    out: dict[str, Any] = {}
    for name, profile in {**profiles, "live": live}.items():
        cal = model_check(doc, profile)
        got = cal.last
        if got is None:
            return {"skipped": cal.skipped}, live_doc, doc
        out["requests"] = got.requests
        out["observed_p99_ms"] = tv._ms(got.observed_p99)
        out[name] = {"predicted_p99_ms": tv._ms(got.predicted_p99), "error": round(got.raw_error, 3)}
    return out, live_doc, doc


def unscaled(profile: LatencyProfile) -> LatencyProfile:
    """``profile`` with its warm-up-only points back at the level they were timed at (before the
    runtime scaled them by ``warmupScale``): the live path as it was without that scaling."""
    scale = profile.warmup_scale or 1.0
    points = [
        p.model_copy(
            update={k: getattr(p, k) / scale for k in ("p50", "p90", "p99", "mean") if getattr(p, k) is not None}
        )
        if p.source == "warmup"
        else p
        for p in profile.points
    ]
    return profile.model_copy(update={"points": points, "warmup_scale": None})


def run_once(
    tmp: Path,
    args: argparse.Namespace,
    settings: LaneSettings,
    offsets: list[float],
    profiles: dict[str, LatencyProfile],
    tags: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    body = benchlib.mlp_body(1)
    rt = tv.Runtime(tmp, args.source, args.threads, settings)
    try:
        benchlib.pin_runtime(rt.proc.pid, args.pin_layout)
        tv.replay(rt, [k * 0.02 for k in range(50)], body)  # warm up
        started = time.time()
        res = tv.replay(rt, offsets, body)
        check, live_doc, capture = server_check(rt, time.time() - started, profiles)
    finally:
        rt.stop()
    run = {
        "client_p99_ms": tv._num(res["slo_p99_ms"]),
        "client_p50_ms": tv._num(res["latency_ms"]["p50"]),
        "errors": res["errors"],
        "send_lag_p99_ms": tv._num(res["send_lag_ms"]["p99"]),
        "server": check,
        "loadavg_1m": round(os.getloadavg()[0], 2),
    }
    if getattr(args, "captures", None):
        # What the run's server rows were computed from, so that a change to the model can be
        # replayed on these runs instead of measuring the grid again.
        kept = {
            **(tags or {}),
            "setting": format_settings(settings),
            "capture": capture,
            "profile": live_doc,
            "run": run,
        }
        with open(args.captures, "a") as f:
            f.write(json.dumps(kept) + "\n")
    return run, live_doc


def format_settings(settings: LaneSettings) -> str:
    return f"{settings.max_batch_size}:{format_duration(settings.max_queue_delay)}"


def server_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per profile: the median over the repeats of the model's p99 on the arrivals the server saw,
    against the median of the server's own p99; the server-side noise floor beside it."""
    checks = [r["server"] for r in runs if "observed_p99_ms" in r["server"]]
    if not checks:
        return {}
    observed = [c["observed_p99_ms"] for c in checks]
    med = statistics.median(observed)
    out: dict[str, Any] = {
        "observed_p99_ms": {"median": med, "min": min(observed), "max": max(observed)},
        "noise_floor": round((max(observed) - min(observed)) / med, 3) if med else None,
        "predicted_p99_ms": {},
        "error": {},
    }
    names = sorted({n for c in checks for n in c} - {"requests", "observed_p99_ms"})
    for name in names:
        # A profile given to only some runs (live_previous) is compared over those runs.
        pairs = [(c[name]["predicted_p99_ms"], c["observed_p99_ms"]) for c in checks if name in c]
        p = statistics.median(pred for pred, _ in pairs)
        seen = statistics.median(obs for _, obs in pairs)
        out["predicted_p99_ms"][name] = p
        out["error"][name] = round(p / seen - 1, 3) if seen else None
    return out


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per trace and overall: client-side (the tuner's prediction on the scheduled arrivals, per
    offline profile, against the median of the repeats) and server-side (the model on the arrivals
    the server saw, per profile including the pod's live one, against the server's own p99)."""

    def stats(pairs: list[tuple[float, float]], errors: list[float]) -> dict[str, Any]:
        within = sum(1 for e in errors if abs(e) <= 0.2)
        return {
            "rows": len(errors),
            "within_20pct": within,
            "within_20pct_share": round(within / len(errors), 3) if errors else None,
            "median_abs_error": round(statistics.median(abs(e) for e in errors), 3) if errors else None,
            "spearman": spearman([p for p, _ in pairs], [m for _, m in pairs]) if pairs else None,
        }

    def block(sel: list[dict[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {"rows": len(sel)}
        floors = [r["noise_floor"] for r in sel if r["noise_floor"] is not None]
        out["median_noise_floor"] = round(statistics.median(floors), 3) if floors else None
        for name in sel[0]["predicted_p99_ms_by_profile"] if sel else ():
            ok = [r for r in sel if r["error_by_profile"].get(name) is not None]
            out[f"client_{name}"] = stats(
                [(r["predicted_p99_ms_by_profile"][name], r["measured_p99_ms"]["median"]) for r in ok],
                [r["error_by_profile"][name] for r in ok],
            )
        srv = [r for r in sel if r.get("server_row", {}).get("error")]
        sfloors = [r["server_row"]["noise_floor"] for r in srv if r["server_row"]["noise_floor"] is not None]
        out["server_median_noise_floor"] = round(statistics.median(sfloors), 3) if sfloors else None
        for name in sorted({n for r in srv for n in r["server_row"]["error"]}):
            ok = [r for r in srv if r["server_row"]["error"].get(name) is not None]
            out[f"server_row_{name}"] = stats(
                [(r["server_row"]["predicted_p99_ms"][name], r["server_row"]["observed_p99_ms"]["median"]) for r in ok],
                [r["server_row"]["error"][name] for r in ok],
            )
        for name in sel[0]["server_error_median"] if sel else ():
            errs = [r["server_error_median"][name] for r in sel if r["server_error_median"].get(name) is not None]
            out[f"server_{name}"] = stats([], errs)
            # The operator's calibration: each row's prediction times the median observed/model
            # ratio of the *other* rows (leave one out), as a correction learned elsewhere.
            ratios = [1 / (1 + e) for e in errs]
            corrected = [
                (1 + e) * statistics.median(ratios[:i] + ratios[i + 1 :]) - 1
                for i, e in enumerate(errs)
                if len(errs) > 1
            ]
            out[f"server_{name}_corrected_leave_one_out"] = stats([], corrected)
        return out

    out = {"all": block(rows)}
    for name in sorted({r["trace"] for r in rows}):
        out[name] = block([r for r in rows if r["trace"] == name])
    return out


def plan_row(
    trace: Trace,
    settings: LaneSettings,
    load: float,
    capacity: dict[LaneSettings, dict[str, Any]],
    profiles: dict[str, LatencyProfile],
    args: argparse.Namespace,
) -> dict[str, Any]:
    """One row before its runs: the rate (``load`` of the setting's measured capacity), the
    scheduled arrivals, and the client-side prediction with each offline profile."""
    rate = min(load * capacity[settings]["measured_rps"], args.max_rate)
    arrivals = trace.scaled_arrivals(rate)
    front_end_cost = 0.0 if args.no_front_end else capacity[settings]["front_end_cost_ms"] / 1e3
    predicted_by = {
        name: tv._ms(
            simulate(
                arrivals,
                settings,
                prof.exec_table(settings.max_batch_size),
                request_overhead=prof.request_overhead,
                front_end_cost=front_end_cost,
            ).latency_quantile(0.99)
        )
        for name, prof in profiles.items()
    }
    return {"rate": rate, "offsets": [round(t, 6) for t in arrivals], "predicted_by": predicted_by, "runs": []}


def grid_row(
    trace_name: str,
    trace: Trace,
    settings: LaneSettings,
    load: float,
    capacity: dict[LaneSettings, dict[str, Any]],
    plan: dict[str, Any],
) -> dict[str, Any]:
    """A row of the JSON from its plan and its runs: the measured median, min and max over the
    repeats, the noise floor, and each profile's error against the median."""
    runs: list[dict[str, Any]] = plan["runs"]
    predicted_by: dict[str, float | None] = plan["predicted_by"]
    p99s = [r["client_p99_ms"] for r in runs if r["client_p99_ms"]]
    med = statistics.median(p99s) if p99s else None
    predicted = predicted_by["gap"]
    server_errors = {
        name: [r["server"][name]["error"] for r in runs if name in r["server"]] for name in (*predicted_by, "live")
    }
    return {
        "trace": trace_name,
        "setting": {
            "maxBatchSize": settings.max_batch_size,
            "maxQueueDelay": format_duration(settings.max_queue_delay),
        },
        "load": load,
        "capacity": capacity[settings],
        "rate_rps": round(plan["rate"], 2),
        "requests": trace.count,
        "predicted_p99_ms": predicted,
        "predicted_p99_ms_by_profile": predicted_by,
        "error_by_profile": {name: round(v / med - 1, 3) if v and med else None for name, v in predicted_by.items()},
        "measured_p99_ms": {
            "median": med,
            "min": min(p99s) if p99s else None,
            "max": max(p99s) if p99s else None,
            "runs": p99s,
        },
        "noise_floor": round((max(p99s) - min(p99s)) / med, 3) if p99s and med else None,
        "error": round(predicted / med - 1, 3) if predicted and med else None,
        "server_error_median": {
            name: round(statistics.median(v), 3) if v else None for name, v in server_errors.items()
        },
        "server_row": server_row(runs),
        "runs": runs,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=800, help="arrivals per trace slice")
    ap.add_argument("--code-start", type=int, default=2000, help="first arrival of the code trace's slice")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--settings", default="1:1ms,4:2ms,8:2ms,16:5ms,32:10ms,64:20ms", help="B:W,...")
    ap.add_argument("--loads", default="0.3,0.6,0.85", help="fractions of each setting's measured capacity")
    ap.add_argument("--capacity-seconds", type=float, default=6.0, help="closed-loop seconds per setting")
    ap.add_argument("--traces", default="code,conversation")
    ap.add_argument("--source", default="builtin:mlp")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-rate", type=float, default=1000.0, help="cap on the offered rate")
    ap.add_argument("--calib-rate", type=float, default=20.0)
    ap.add_argument("--pin", choices=benchlib.PIN_MODES, default="auto", help="see benchlib.pin_for_bench")
    ap.add_argument(
        "--current",
        default="8:2ms",
        help="the live path's running setting: its pods' profile predicts every setting's rows (live_current)",
    )
    ap.add_argument(
        "--no-front-end",
        action="store_true",
        help="client-side predictions without the HTTP front end (the model before frontEndCost)",
    )
    ap.add_argument("--out")
    ap.add_argument(
        "--captures", help="append each run's capture (/admin/arrivals), live profile and row to this JSON-lines file"
    )
    ap.add_argument("--summarize", help="recompute the summary of a results file (no runs)")
    args = ap.parse_args()
    if args.summarize:
        done = json.loads(Path(args.summarize).read_text())
        done["summary"] = summarize(done["rows"])
        Path(args.summarize).write_text(json.dumps(done, indent=2))
        print(json.dumps(done["summary"], indent=2))
        return 0
    cores = os.cpu_count() or 1
    args.pin_layout = benchlib.pin_for_bench(args.pin)

    log("profiling the model in-process (runtime loader): with idle gaps (batchpilot profile's default), and hot")
    sizes = [1, 2, 4, 8, 16, 32, 64]
    offline = {
        "gap": tv.measure_profile(args.source, args.threads, sizes, 40, gap=0.01),
        "hot": tv.measure_profile(args.source, args.threads, sizes, 40, gap=0.0),
    }
    body = benchlib.mlp_body(1)
    settings_list, current = parse_settings(args.settings, args.current)
    loads = [float(x) for x in args.loads.split(",")]
    all_traces = traces(args.requests, args.code_start)
    rows: list[dict[str, Any]] = []
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="bp-model-grid-") as tmpdir:
        tmp = Path(tmpdir)
        # Per-request overhead outside the model at working load (tune_validation's method).
        steady = tv.SteadyStream(tmp, args, body)
        profiles: dict[str, LatencyProfile] = {}
        overheads: dict[str, float] = {}
        for name, prof in offline.items():
            overheads[name] = steady.overhead(prof)
            profiles[name] = prof.model_copy(update={"request_overhead": overheads[name], "quantile": "p90"})
            # The same passes read by their mean (what the runtime's own profile states).
            profiles[f"{name}_mean"] = profiles[name].model_copy(update={"quantile": "mean"})
        profile = profiles["gap"]
        log(f"request overhead {overheads}")
        capacity: dict[LaneSettings, dict[str, float]] = {}
        for settings in settings_list:
            table = profile.exec_table(settings.max_batch_size)
            rt = tv.Runtime(tmp, args.source, args.threads, settings)
            try:
                benchlib.pin_runtime(rt.proc.pid, args.pin_layout)
                tv.replay(rt, [k * 0.02 for k in range(50)], body)
                closed = benchlib.closed_loop(
                    rt.infer_url, body, max(4, 2 * settings.max_batch_size), args.capacity_seconds
                )
                time.sleep(1.1)  # past the runtime's front-end window, so this read closes the busy one
                saturated = LatencyProfile.model_validate(tv.fetch_json(f"{rt.url}/admin/profile"))
            finally:
                rt.stop()
            b = settings.max_batch_size
            capacity[settings] = {
                "measured_rps": round(float(closed["ok_per_s"]), 1),
                "model_ceiling_rps": round(b / table[b], 1),
                "model_ceiling_rps_by_profile": {
                    name: round(b / prof.exec_time(b), 1) for name, prof in profiles.items()
                },
                # The runtime's own mean pass at that size while saturated (in-sample: the same run).
                "live_ceiling_rps": round(b / saturated.exec_time(b), 1),
                # Its server process's CPU per request at that load (the profile's frontEndCost):
                # the client-side predictions of this setting queue every request through it.
                "front_end_cost_ms": round(saturated.front_end_cost * 1e3, 4),
            }
            log(f"B={settings.max_batch_size} W={format_duration(settings.max_queue_delay)}: {capacity[settings]}")
        previous_live: dict[LaneSettings, tuple[LatencyProfile, float]] = {}
        for trace_name in args.traces.split(","):
            trace = all_traces[trace_name]
            # The live path (recommend): the pods running the current setting at this trace and
            # load measure their profile, and the model predicts every candidate setting with it.
            # Per load and repeat the current setting runs first and every other setting right
            # after it, so that each candidate's row is predicted from a profile measured a minute
            # before at most (the JSON gives its age per run): recommend predicts from the pods'
            # profile of the moment. Measuring every candidate against one profile taken at the
            # start of the trace (this bench before 2026-12-07) put the machine's drift over
            # ten minutes into the model's error.
            ordered = [current, *[s for s in settings_list if s != current]]
            for load in loads:
                plans = {settings: plan_row(trace, settings, load, capacity, profiles, args) for settings in ordered}
                for repeat in range(args.repeats):
                    for settings in ordered:
                        given = dict(profiles)
                        if settings in previous_live:
                            given["live_previous"] = previous_live[settings][0]
                        # The current setting's own rows: the profile its pods measured the run before.
                        live_current = previous_live.get(current)
                        if live_current is not None:
                            given["live_current"] = live_current[0]
                            if live_current[0].warmup_scale:
                                given["live_current_unscaled"] = unscaled(live_current[0])
                        started_run = time.time()
                        tags = {"trace": trace_name, "load": load, "repeat": repeat}
                        run, live_doc = run_once(tmp, args, settings, plans[settings]["offsets"], given, tags)
                        if live_current is not None:
                            run["live_current_age_s"] = round(started_run - live_current[1], 1)
                        previous_live[settings] = (LatencyProfile.model_validate(live_doc), time.time())
                        plans[settings]["runs"].append(run)
                for settings in ordered:
                    row = grid_row(trace_name, trace, settings, load, capacity, plans[settings])
                    rows.append(row)
                    log(
                        f"{trace_name} B={settings.max_batch_size} W={format_duration(settings.max_queue_delay)} "
                        f"{load:.0%} ({row['rate_rps']:.1f} req/s): predicted {row['predicted_p99_ms']} ms, "
                        f"measured {row['measured_p99_ms']['runs']} ms (noise floor {row['noise_floor']}), "
                        f"error {row['error_by_profile']}, server error {row['server_row'].get('error')}"
                    )
    out = {
        "command": " ".join(sys.argv),
        "machine": {"cores": cores, "pinned": args.pin_layout, "loadavg_1m_end": round(os.getloadavg()[0], 2)},
        "profile": profile.model_dump(mode="json", by_alias=True, exclude_none=True),
        "request_overhead_ms": {k: round(v * 1e3, 3) for k, v in overheads.items()},
        "profiles": {k: v.model_dump(mode="json", by_alias=True, exclude_none=True) for k, v in profiles.items()},
        "elapsed_s": round(time.time() - started, 1),
        "summary": summarize(rows),
        "rows": rows,
    }
    text = json.dumps(out, indent=2)
    print(json.dumps(out["summary"], indent=2))
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
