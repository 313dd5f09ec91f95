"""The latency model checked against the pods: measured error and a correction per policy and lane.

Every prediction batchpilot makes ("this setting at this traffic gives this p99") comes from the
tuner's simulator fed with a latency profile. Here it meets what really happened:

* :func:`check_lane` replays one window's real arrivals (every ready pod's ``/admin/arrivals``,
  merged) through the simulator with the setting the pods ran and the profile they measured,
  and compares its p99 latency and p99 queue wait with what the pods recorded for the same
  requests (the ``outcomes`` of the arrival capture). Same arrivals, same setting, same number
  of replicas: what remains is the model's error.
* :class:`LaneCalibration` keeps the last :data:`KEEP` checks of a lane and the correction the
  predictions carry: the median of observed / predicted p99 over them (actual/expected, the
  way autoscaling planners correct a capacity model), bounded to ``[1/MAX_CORRECTION,
  MAX_CORRECTION]``. A corrected prediction is the model's p99 times the correction; the
  recommendation searches for settings under the SLO divided by it, which is the same thing.
* Each check also states the error of the prediction *as it was shown*: the model times the
  correction in force before that window. That is the figure users see next to every
  prediction, and a recommendation whose last error is beyond :data:`TOLERANCE` says so.

Pure (no I/O). The recommender keeps the state in ``status.recommendation.calibration``; the
``kubectl batchpilot recommend`` command reads it from there.

Queue wait is reported with its error but not corrected: at low load the observed p99 wait is
near zero and a ratio of it says nothing.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from batchpilot_operator.tune.profile import LatencyProfile
from batchpilot_operator.tune.simulator import LaneSettings, nearest_rank, simulate

KEEP: Final = 8
"""Checks kept per lane (the correction is their median)."""
MIN_REQUESTS: Final = 200
"""Fewest answered requests for a check: below it the window's p99 is one or two requests."""
TOLERANCE: Final = 0.25
"""A prediction whose last measured error is beyond this is shown as an estimate, not a fact."""
MAX_CORRECTION: Final = 4.0
QUANTILE: Final = 0.99


@dataclass(frozen=True)
class Observed:
    """What the pods recorded for one lane's requests in a window (seconds; inf: not served)."""

    latencies: tuple[float, ...]
    waits: tuple[float, ...]

    @property
    def requests(self) -> int:
        return len(self.latencies)

    def p99(self) -> float:
        return nearest_rank(sorted(self.latencies), QUANTILE)

    def p99_wait(self) -> float:
        return nearest_rank(sorted(self.waits), QUANTILE)


@dataclass(frozen=True)
class Check:
    """One window: the model's p99 against the pods' for the same requests."""

    time: float  # Unix seconds, end of the window
    requests: int
    predicted_p99: float  # the model alone (no correction)
    observed_p99: float
    predicted_wait: float
    observed_wait: float
    correction: float  # in force when the window's predictions were made

    @property
    def ratio(self) -> float:
        """observed / model: what the correction learns from."""
        return self.observed_p99 / self.predicted_p99 if self.predicted_p99 > 0 else math.nan

    @property
    def raw_error(self) -> float:
        """The model alone: predicted / observed - 1 (negative: the model was optimistic)."""
        return _error(self.predicted_p99, self.observed_p99)

    @property
    def error(self) -> float:
        """The prediction as shown (model x the correction then in force) against the observation."""
        return _error(self.predicted_p99 * self.correction, self.observed_p99)

    def to_dict(self) -> dict[str, Any]:
        return {
            "time": round(self.time, 3),
            "requests": self.requests,
            "predictedP99": _ms(self.predicted_p99),
            "observedP99": _ms(self.observed_p99),
            "predictedQueueWaitP99": _ms(self.predicted_wait),
            "observedQueueWaitP99": _ms(self.observed_wait),
            "correction": round(self.correction, 4),
            "error": _round(self.error),
            "rawError": _round(self.raw_error),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Check:
        return cls(
            time=float(d["time"]),
            requests=int(d["requests"]),
            predicted_p99=_from_ms(d["predictedP99"]),
            observed_p99=_from_ms(d["observedP99"]),
            predicted_wait=_from_ms(d.get("predictedQueueWaitP99")),
            observed_wait=_from_ms(d.get("observedQueueWaitP99")),
            correction=float(d.get("correction", 1.0)),
        )


@dataclass(frozen=True)
class LaneCalibration:
    """The last checks of one lane and the correction they give."""

    checks: tuple[Check, ...] = ()
    skipped: str = ""  # why the last window gave no check (empty: it did, or none was tried)

    @property
    def correction(self) -> float:
        ratios = [c.ratio for c in self.checks if math.isfinite(c.ratio) and c.ratio > 0]
        if not ratios:
            return 1.0
        return min(max(statistics.median(ratios), 1 / MAX_CORRECTION), MAX_CORRECTION)

    @property
    def last(self) -> Check | None:
        return self.checks[-1] if self.checks else None

    @property
    def within_tolerance(self) -> bool | None:
        """Whether the last prediction shown was within :data:`TOLERANCE` (None: never checked)."""
        last = self.last
        if last is None or not math.isfinite(last.error):
            return None
        return abs(last.error) <= TOLERANCE

    def add(self, check: Check) -> LaneCalibration:
        return LaneCalibration((*self.checks, check)[-KEEP:])

    def skip(self, why: str) -> LaneCalibration:
        return LaneCalibration(self.checks, why)

    def summary(self) -> str:
        """One line for a table or a message: the last error as shown, the correction, the history."""
        last = self.last
        if last is None:
            return "model error: not measured yet" + (f" ({self.skipped})" if self.skipped else "")
        mean_abs = statistics.fmean(abs(c.error) for c in self.checks if math.isfinite(c.error))
        text = (
            f"model error last window {last.error:+.0%} (p99 {_ms_text(last.predicted_p99 * last.correction)} "
            f"predicted, {_ms_text(last.observed_p99)} observed over {last.requests} requests); "
            f"mean |error| {mean_abs:.0%} over {len(self.checks)} window(s); correction now x{self.correction:.3g}"
        )
        if self.within_tolerance is False:
            text += f"; above {TOLERANCE:.0%}: predictions are estimates, let the canary decide"
        return text

    def to_dict(self) -> dict[str, Any]:
        last = self.last
        return {
            "correction": round(self.correction, 4),
            "lastError": None if last is None else _round(last.error),
            "withinTolerance": self.within_tolerance,
            "tolerance": TOLERANCE,
            "skipped": self.skipped,
            "summary": self.summary(),
            "checks": [c.to_dict() for c in self.checks],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> LaneCalibration:
        if not d:
            return cls()
        try:
            checks = tuple(Check.from_dict(c) for c in d.get("checks") or ())
        except (KeyError, TypeError, ValueError):
            return cls()  # an unreadable history starts over rather than failing the recommendation
        return cls(checks[-KEEP:], str(d.get("skipped") or ""))


@dataclass(frozen=True)
class RevisionCheck:
    """The model against one revision's pods over one analysis window, one lane: what the model
    predicts at the traffic that revision really got, beside what its pods recorded."""

    revision: str
    track: str  # canary or stable
    lane: str
    check: Check | None = None
    skipped: str = ""  # why there is no check

    def describe(self) -> str:
        c = self.check
        if c is None:
            return f"{self.track} not checked ({self.skipped})"
        return (
            f"{self.track} p99 {_ms_text(c.predicted_p99 * c.correction)} predicted, {_ms_text(c.observed_p99)} "
            f"observed ({c.error:+.0%}, {c.requests} requests)"
        )


def calibrations_from_status(recommendation: Mapping[str, Any] | None) -> dict[str, LaneCalibration]:
    """Per lane, the calibration kept in ``status.recommendation.calibration``."""
    raw = (recommendation or {}).get("calibration") or {}
    return {str(lane): LaneCalibration.from_dict(d) for lane, d in raw.items() if isinstance(d, Mapping)}


@dataclass
class Window:
    """One lane's window as the pods saw it: arrivals (one per row), their outcomes, the setting."""

    end: float
    arrivals: Sequence[float]  # seconds, sorted (any origin)
    observed: Observed
    settings: LaneSettings
    replicas: int
    notes: list[str] = field(default_factory=list)


def check_lane(
    window: Window, profile: LatencyProfile, correction: float, min_requests: int = MIN_REQUESTS
) -> Check | str:
    """The model's p99 for the window's arrivals against the pods' (a reason when no check is possible)."""
    if window.observed.requests < min_requests:
        return f"{window.observed.requests} answered requests in the window, fewer than {min_requests}"
    if window.replicas < 1:
        return "no pod served the window"
    table = profile.exec_table(max(window.settings.max_batch_size, 1))
    sim = simulate(
        list(window.arrivals),
        window.settings,
        table,
        window.replicas,
        "random",
        0,
        profile.request_overhead,
        dispatch_delay=profile.dispatch_delay,
    )
    predicted = sim.latency_quantile(QUANTILE)
    observed = window.observed.p99()
    if not (math.isfinite(predicted) and math.isfinite(observed)) or observed <= 0:
        return f"p99 not finite (model {predicted:g} s, pods {observed:g} s): requests were dropped or timed out"
    return Check(
        time=window.end,
        requests=window.observed.requests,
        predicted_p99=predicted,
        observed_p99=observed,
        predicted_wait=sim.queue_age_quantile(QUANTILE),
        observed_wait=window.observed.p99_wait(),
        correction=correction,
    )


def _error(predicted: float, observed: float) -> float:
    if not (math.isfinite(predicted) and math.isfinite(observed)) or observed <= 0:
        return math.nan
    return predicted / observed - 1


def _round(x: float) -> float | None:
    return None if not math.isfinite(x) else float(f"{x:.4g}")


def _ms(x: float) -> float | None:
    return None if not math.isfinite(x) else round(x * 1e3, 3)


def _from_ms(x: Any) -> float:
    return math.inf if x is None else float(x) / 1e3


def _ms_text(x: float) -> str:
    return "inf" if not math.isfinite(x) else f"{x * 1e3:.3g} ms"


UNMEASURED: Final = (
    "model error: not measured for this policy (the prediction comes from the profile alone; a policy with "
    "spec.tuning keeps its checks in status.recommendation.calibration: pass them with --calibration)"
)


def policy_calibration(doc: Mapping[str, Any]) -> dict[str, LaneCalibration] | None:
    """The calibration in a BatchingPolicy document's own status (None: it carries none)."""
    return calibrations_from_status((doc.get("status") or {}).get("recommendation")) or None


def load_calibration(doc: Mapping[str, Any], policy: str | None = None) -> dict[str, LaneCalibration]:
    """Per lane, the calibration in a document: a BatchingPolicy with its status (``kubectl get
    batchingpolicy NAME -o yaml``), its ``status.recommendation``, or the ``calibration`` map itself.
    With ``policy``, a BatchingPolicy of another name is refused (its checks are not this policy's)."""
    if "status" in doc or doc.get("kind"):
        name = (doc.get("metadata") or {}).get("name")
        if policy and name and name != policy:
            raise ValueError(f"the calibration is policy {name!r}'s, not {policy!r}'s")
        doc = (doc.get("status") or {}).get("recommendation") or {}
    out = calibrations_from_status(doc if isinstance(doc.get("calibration"), Mapping) else {"calibration": doc})
    if not out:
        raise ValueError("no calibration found (expected status.recommendation.calibration of a BatchingPolicy)")
    return out
