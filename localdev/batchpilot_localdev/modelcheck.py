"""The demo's latency model check: predicted against observed p99 for every analysis window.

While the demo runs, :class:`OutcomeCollector` reads every runtime process's
``/admin/arrivals`` (arrivals and the outcome of each admitted request) and ``/admin/profile``
every few seconds, and keeps them per pod: pods come and go during a rollout, so what a
replaced pod served is kept from before it went.

:func:`window_rows` then takes each lane-level p99 analysis of the ledger (the canary and the
stable track it was compared with, over the analysis's own query window) and replays the
arrivals those pods really received through the tuner's model, with the setting they ran and
the profile they measured (:func:`batchpilot_operator.tune.live.calibrate`: the check the
operator's calibration makes). Each row: the model's p99, the p99 the pods recorded
for the same requests, and the p99 Prometheus gave the analysis (its histogram buckets and
rate window: an estimate of the same thing).
"""

from __future__ import annotations

import contextlib
import json
import re
import threading
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from batchpilot_operator.tune.calibration import QUANTILE, LaneCalibration
from batchpilot_operator.tune.captures import MergedTraffic, merge_profiles
from batchpilot_operator.tune.live import calibrate
from batchpilot_operator.tune.simulator import nearest_rank

_RANGE = re.compile(r"\[(\d+(?:\.\d+)?)s\]")


@dataclass
class PodRecord:
    pod: str
    revision: str
    track: str
    settings: dict[str, dict[str, Any]] = field(default_factory=dict)  # lane -> settings
    profile: dict[str, Any] | None = None
    # lane -> arrival time -> [rows, latency or None while unanswered, queue wait, its batch's
    # pass, the answer's hand-off to the loop] (the last two None: not served, or not recorded)
    arrivals: dict[str, dict[float, list[Any]]] = field(default_factory=dict)


class OutcomeCollector:
    """Polls ``endpoints()`` (objects with ``pod`` and ``url``) every ``interval`` seconds."""

    def __init__(self, endpoints: Callable[[], Sequence[Any]], interval: float = 5.0) -> None:
        self.endpoints = endpoints
        self.interval = interval
        self.pods: dict[str, PodRecord] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="outcome-collector", daemon=True)

    def start(self) -> OutcomeCollector:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        self.poll()  # the last seconds

    def dump(self) -> dict[str, Any]:
        """Every pod's record as JSON (``arrivals``: per lane, ``[time, rows, latency, queue wait,
        pass, hand-off]`` rows, as :class:`PodRecord` holds them); :meth:`load` reads it back."""
        return {
            "pods": [
                {
                    "pod": p.pod,
                    "revision": p.revision,
                    "track": p.track,
                    "settings": p.settings,
                    "profile": p.profile,
                    "arrivals": {lane: [[t, *v] for t, v in sorted(held.items())] for lane, held in p.arrivals.items()},
                }
                for p in self.pods.values()
            ]
        }

    @staticmethod
    def load(doc: dict[str, Any]) -> dict[str, PodRecord]:
        """The pods of a :meth:`dump`."""
        pods: dict[str, PodRecord] = {}
        for d in doc["pods"]:
            rec = PodRecord(d["pod"], d["revision"], d["track"], d["settings"], d["profile"])
            for lane, rows in d["arrivals"].items():
                rec.arrivals[lane] = {
                    float(t): [int(r), *(None if v is None else float(v) for v in rest)] for t, r, *rest in rows
                }
            pods[rec.pod] = rec
        return pods

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.poll()

    def poll(self) -> None:
        for ep in list(self.endpoints()):
            with contextlib.suppress(OSError, ValueError, KeyError):
                self._read(ep)

    def _read(self, ep: Any) -> None:
        since = f"{3 * self.interval:g}s"
        doc = _get(f"{ep.url}/admin/arrivals?since={since}")
        rec = self.pods.get(ep.pod)
        if rec is None:
            rec = self.pods[ep.pod] = PodRecord(ep.pod, str(doc["revision"]), str(doc.get("track", "")))
        rec.profile = _get(f"{ep.url}/admin/profile")  # live batches refine it as the pod serves
        for lane in doc["lanes"]:
            name = str(lane["name"])
            rec.settings[name] = dict(lane.get("settings") or {})
            held = rec.arrivals.setdefault(name, {})
            base = float(lane.get("base", 0.0))
            for t, rows in zip(lane.get("times", []), lane.get("rows", []), strict=True):
                held.setdefault(round(base + float(t), 6), [int(rows), None, None, None, None])
            out = lane.get("outcomes") or {}
            times = out.get("times", [])
            after = zip(out.get("pass") or [None] * len(times), out.get("handoff") or [None] * len(times), strict=True)
            for t, lat, wait, (pass_s, handoff) in zip(
                times, out.get("latency", []), out.get("queueWait", []), after, strict=True
            ):
                entry = held.setdefault(round(base + float(t), 6), [1, None, None, None, None])
                served = float(lat) >= 0
                entry[1] = float(lat) if served else float("inf")
                entry[2] = float(wait)
                entry[3] = float(pass_s) if served and pass_s is not None else None
                entry[4] = float(handoff) if served and handoff is not None else None


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.loads(resp.read())


def _epoch(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def check_window(pods: Sequence[PodRecord], lane: str, start: float, end: float) -> dict[str, Any] | None:
    """The model's p99 against the pods' for the requests ``pods`` received in ``[start, end]``."""
    # Only the pods that served the window: a replaced pod (another revision of the same track)
    # must lend neither its profile nor its setting, nor count as a replica.
    pods = [
        p
        for p in pods
        if lane in p.arrivals
        and p.profile is not None
        and lane in p.settings
        and any(start <= t <= end for t in p.arrivals[lane])
    ]
    if not pods:
        return None
    pairs: list[tuple[float, int]] = []
    outcomes: list[tuple[float, float, float]] = []
    parts: dict[str, list[float]] = {"wait": [], "pass": [], "handoff": []}  # of the served requests
    for p in pods:
        for t, (rows, lat, wait, *after) in p.arrivals[lane].items():
            if start <= t <= end:
                pairs.append((t, rows))
                if lat is not None:
                    outcomes.append((t, lat, wait))
                if len(after) == 2 and after[0] is not None and after[1] is not None:
                    parts["wait"].append(wait)
                    parts["pass"].append(after[0])
                    parts["handoff"].append(after[1])
    pairs.sort()
    settings_ran: list[dict[str, Any]] = []
    for p in pods:
        if p.settings[lane] not in settings_ran:
            settings_ran.append(p.settings[lane])
    traffic = MergedTraffic(
        lane=lane,
        pods=sorted(p.pod for p in pods),
        revisions=sorted({p.revision for p in pods}),
        start=start,
        end=end,
        times=[t for t, _ in pairs],
        rows=[r for _, r in pairs],
        outcomes=sorted(outcomes),
        settings_ran=settings_ran,
    )
    # The operator's own check (tune.live.calibrate), with no correction.
    profile = merge_profiles([p.profile for p in pods if p.profile is not None])
    cal = calibrate(traffic, profile, LaneCalibration())
    # The window's burst, which its mean rate averages away (the busiest second, per pod).
    served = {"revisions": traffic.revisions, "pods": len(pods), "peakPerPod": traffic.peak_row_rate() / len(pods)}
    # Where the pods' time went (p99 of each part over the served requests, seconds): in the
    # queue, in its batch's pass, in the answer's hand-off to the event loop. A pass far over the
    # profile's, or a long hand-off, is the machine's, not the model's queue (docs/tuning.md).
    if parts["wait"]:
        served["observedParts"] = {k: nearest_rank(sorted(v), QUANTILE) for k, v in parts.items()}
    got = cal.last
    if got is None:
        return served | {"requests": len(outcomes), "skipped": cal.skipped}
    return served | {
        "requests": got.requests,
        "predictedP99": got.predicted_p99,
        "observedP99": got.observed_p99,
        "error": got.raw_error,
        # What the model was given, to tell a wrong profile from a wrong queue (seconds).
        "profile": {
            "requestOverhead": profile.request_overhead,
            "dispatchDelay": profile.dispatch_delay,
            "frontEndCost": profile.front_end_cost,
            "warmupScale": profile.warmup_scale,
            "pass": {str(b): profile.exec_time(b) for b in sorted({1, int(settings_ran[0]["maxBatchSize"])})},
        },
    }


def window_rows(collector: OutcomeCollector, ledger: Sequence[dict[str, Any]], start: float) -> list[dict[str, Any]]:
    """One row per track of each lane-level p99 analysis in the ledger (see the module docstring)."""
    rows: list[dict[str, Any]] = []
    for entry in ledger:
        if entry.get("kind") != "Analysis" or entry.get("metric") != "p99Latency" or entry.get("tenant"):
            continue
        end = _epoch(entry["time"])
        found = _RANGE.search(entry.get("query") or "")
        length = float(found.group(1)) if found else 15.0
        lane = str(entry.get("lane") or "")
        for track in ("canary", "stable"):
            pods = [
                p
                for p in collector.pods.values()
                if p.track == track and (track != "canary" or p.revision == entry.get("revision"))
            ]
            got = check_window(pods, lane, end - length, end)
            if got is None:
                continue
            prom = entry.get("value") if track == "canary" else entry.get("stableValue")
            rows.append(
                {
                    "t": round(end - start, 1),
                    "revision": ",".join(got.pop("revisions")),
                    "track": track,
                    "lane": lane,
                    "window": length,
                    "outcome": entry.get("outcome"),
                    "prometheusP99": prom,
                }
                | got
            )
    return rows


def stable_over_slo(rows: Sequence[dict[str, Any]], slo: float) -> str:
    """Which of the stable's windows its pods served over the p99 ``slo``, and in what burst:
    each such window's busiest second per pod (``peakPerPod``) against the median window's. A
    breach at several times the median burst is the trace's; one at the median is the setting's
    (or the machine's)."""
    stable = [r for r in rows if r.get("track") == "stable" and r.get("observedP99") is not None and r.get("pods")]
    if not stable:
        return ""
    peak = {id(r): float(r.get("peakPerPod") or 0.0) for r in stable}
    median = sorted(peak.values())[len(peak) // 2]
    over = [r for r in stable if r["observedP99"] > slo]
    head = f"stable over its {slo * 1e3:g}ms SLO in {len(over)} of {len(stable)} windows"
    if not over or median <= 0:
        return head
    at = ", ".join(f"t={r['t']:.0f}s {peak[id(r)] / median:.1f}x{_parts(r)}" for r in over)
    return f"{head}, in these bursts (busiest second per pod against the median window's): {at}"


def _parts(row: dict[str, Any]) -> str:
    """The pods' p99 of queue wait, pass and hand-off in a window, where they recorded them."""
    parts = row.get("observedParts")
    if not parts:
        return ""
    return f" (p99 queue {parts['wait'] * 1e3:.0f} ms, pass {parts['pass'] * 1e3:.0f} ms, hand-off {parts['handoff'] * 1e3:.0f} ms)"


def window_table(rows: Sequence[dict[str, Any]], slo: float | None = None) -> str:
    """Predicted vs observed p99 per analysis window, for the console and report/summary.txt;
    with the p99 ``slo``, which of the stable's windows were over it (:func:`stable_over_slo`)."""

    def ms(v: Any) -> str:
        return "-" if v is None or v != v or v == float("inf") else f"{v * 1e3:.1f}ms"

    lines = [
        f"{'t':>6}  {'track':<7}{'revision':<12}{'requests':>9}{'model p99':>11}{'pods p99':>10}"
        f"{'error':>8}{'prom p99':>10}  outcome"
    ]
    for r in rows:
        err = r.get("error")
        lines.append(
            f"{r['t']:>6.0f}  {r['track']:<7}{str(r['revision'])[:11]:<12}{r.get('requests', 0):>9}"
            f"{ms(r.get('predictedP99')):>11}{ms(r.get('observedP99')):>10}"
            f"{'-' if err is None else f'{err:+.0%}':>8}{ms(r.get('prometheusP99')):>10}  "
            f"{r.get('outcome') or ''}{' (' + r['skipped'] + ')' if r.get('skipped') else ''}"
        )
    errors = [abs(r["error"]) for r in rows if r.get("error") is not None]
    if errors:
        within = sum(1 for e in errors if e <= 0.2)
        errors.sort()
        lines.append(
            f"model vs pods: {within} of {len(errors)} windows within 20%, median |error| "
            f"{errors[len(errors) // 2]:.0%}"
        )
    if slo is not None and (line := stable_over_slo(rows, slo)):
        lines.append(line)
    return "\n".join(lines)
