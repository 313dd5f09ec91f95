"""Can a policy meet its SLO on this model? Plan-time checks against a latency profile.

Pure: a :class:`~batchpilot_operator.spec.PolicySpec` and a
:class:`~batchpilot_operator.tune.profile.LatencyProfile` in, findings out.

Notation for one lane: ``W`` its batching window (``maxQueueDelay``), ``B`` its
``maxBatchSize``, ``E(b)`` the profile's execution time of a batch of ``b`` rows (its
``quantile`` column, p90 by default, the same column the tuner uses), ``o`` the profile's
per-request overhead (HTTP, decoding), ``S`` the lane's p99 SLO, ``N`` the replicas.

The latency of one request is: waiting for batch-mates (at most ``W``) + waiting for the
executor while the batch ahead of its batch runs (at most ``E(B)``) + its own batch
(``E(b)``, at most ``E(B)``) + ``o``.

* **Error** when ``W + E(B) + o > S``. This is the latency of a request that opens a
  batch that closes at the window's end with ``B`` rows, on an *idle* executor: no
  contention assumed. At the load a lane with these settings is built for (batches of up to
  ``B`` rows gathered within ``W``), arrivals are spread over the window, so about 1% of the
  requests wait within 1% of ``W``: the p99 is close to this figure, and above the SLO. The
  SLO cannot be promised with this window and this max batch. (At a trickle, batches are
  smaller and the lane might pass a canary, then break when traffic grows: exactly the
  failure to catch before merge.)
* **Warning** when ``W + 2·E(B) + o > S`` only: the same request also waiting for the batch
  ahead of it, which happens once the executor is busy most of the time. Not certain at low
  utilisation, so not an error.
* **Error** when the lane's ``expectedRate`` exceeds its capacity at max batch,
  ``N · B / E(B)`` rows/s (every replica running full batches back to back): no setting of
  the window can serve that rate. And when the lanes' expected rates together need more
  than the whole executor (``Σ rate·E(B)/B / N > 1``): lanes share one executor per pod.
* **Warning** when ``B`` lies beyond the profile's largest measured batch (extrapolated), or
  the profile was measured for a different model source.
* **Error** when the lanes' expected rates together exceed ``N / c``, ``c`` the profile's
  ``frontEndCost``: each pod's HTTP loop answers one request at a time, whatever the batching.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from batchpilot_operator.spec import LaneSpec, PolicySpec
from batchpilot_operator.tune.profile import LatencyProfile

Severity = Literal["error", "warning"]


@dataclass(frozen=True)
class Finding:
    severity: Severity
    message: str
    lane: str | None = None
    field: str | None = None
    """Path of the field at fault, e.g. ``spec.lanes[0].maxQueueDelay``."""
    check: str = ""
    """Short name of the check: latency, latency-contended, capacity, utilisation, front-end, profile."""


@dataclass(frozen=True)
class LaneBudget:
    lane: str
    window: float
    max_batch: int
    exec_max_batch: float
    overhead: float
    slo: float
    capacity: float
    """Rows/s over all replicas at max batch, back to back."""
    expected_rate: float | None

    @property
    def best_case_worst(self) -> float:
        """W + E(B) + o: the request that opens a full batch closing at the window's end."""
        return self.window + self.exec_max_batch + self.overhead

    @property
    def contended_worst(self) -> float:
        """W + 2·E(B) + o: the same, behind a full batch still running."""
        return self.window + 2 * self.exec_max_batch + self.overhead


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.3g}ms"


def lane_budget(spec: PolicySpec, lane: LaneSpec, profile: LatencyProfile) -> LaneBudget:
    exec_b = profile.exec_time(lane.max_batch_size)
    return LaneBudget(
        lane=lane.name,
        window=lane.max_queue_delay,
        max_batch=lane.max_batch_size,
        exec_max_batch=exec_b,
        overhead=profile.request_overhead,
        slo=spec.lane_slo(lane.name).p99_latency,
        capacity=spec.replicas * lane.max_batch_size / exec_b,
        expected_rate=lane.expected_rate,
    )


def largest_batch_within(profile: LatencyProfile, max_batch: int, budget: float) -> int | None:
    """The largest batch size up to ``max_batch`` whose execution fits ``budget`` seconds."""
    best = None
    for size in range(1, max_batch + 1):
        if profile.exec_time(size) <= budget:
            best = size
    return best


P99_MIN_SAMPLES = 100


def check_rollout(spec: PolicySpec) -> list[Finding]:
    """Findings about the rollout block that need no latency profile."""
    findings: list[Finding] = []
    if spec.rollout.min_samples < P99_MIN_SAMPLES:
        findings.append(
            Finding(
                "warning",
                f"spec.rollout.minSamples is {spec.rollout.min_samples}: a p99 over fewer than {P99_MIN_SAMPLES} "
                "requests is the slowest one of the window, so a single slow request can fail an analysis; "
                f"use at least {P99_MIN_SAMPLES} (or a longer analysisInterval)",
                field="spec.rollout.minSamples",
                check="statistics",
            )
        )
    return findings


def check_policy(spec: PolicySpec, profile: LatencyProfile) -> list[Finding]:
    """Every feasibility finding of ``spec`` on the model ``profile`` describes."""
    findings: list[Finding] = []
    q = profile.quantile
    if profile.model.source != spec.model.source:
        findings.append(
            Finding(
                "warning",
                f"the profile was measured for model {profile.model.source}, the policy runs {spec.model.source}: "
                "execution times may not apply",
                field="spec.model.source",
                check="profile",
            )
        )
    where_measured = (profile.model.device, profile.model.dtype)
    if where_measured != (spec.model.device, spec.model.dtype) and spec.model.device != "auto":
        findings.append(
            Finding(
                "warning",
                f"the profile was measured on {profile.model.device}/{profile.model.dtype}, the policy runs "
                f"{spec.model.device}/{spec.model.dtype}: measure one on the target device "
                "(`batchpilot profile --device ... --dtype ...`) for a verdict that holds there",
                field="spec.model.device",
                check="profile",
            )
        )
    utilisation = 0.0
    for i, lane in enumerate(spec.lanes):
        b = lane_budget(spec, lane, profile)
        where = f"spec.lanes[{i}]"
        slo_field = f"{where}.slo.p99Latency" if lane.slo is not None else "spec.slo.p99Latency"
        if profile.extrapolated(lane.max_batch_size):
            findings.append(
                Finding(
                    "warning",
                    f"maxBatchSize {lane.max_batch_size} is beyond the profile's largest measured batch "
                    f"({profile.max_batch_size}); its execution time {ms(b.exec_max_batch)} is extrapolated",
                    lane=lane.name,
                    field=f"{where}.maxBatchSize",
                    check="profile",
                )
            )
        budget = (
            f"window {ms(b.window)} + execution of a full batch of {b.max_batch} ({ms(b.exec_max_batch)}, "
            f"profile {q})" + (f" + request overhead {ms(b.overhead)}" if b.overhead else "")
        )
        if b.best_case_worst > b.slo:
            room = b.slo - b.exec_max_batch - b.overhead
            fits = largest_batch_within(profile, lane.max_batch_size, b.slo - b.window - b.overhead)
            if room > 0:
                fix = f"shorten maxQueueDelay to below {ms(room)}, lower maxBatchSize, or relax the SLO"
            elif fits:
                fix = f"a full batch alone is too slow: lower maxBatchSize to {fits} or less, or relax the SLO"
            else:
                fix = "even one row with this window is too slow: shorten maxQueueDelay or relax the SLO"
            findings.append(
                Finding(
                    "error",
                    f"{budget} = {ms(b.best_case_worst)} exceeds the p99 SLO {ms(b.slo)} ({slo_field}) even on an "
                    f"idle executor: {fix}",
                    lane=lane.name,
                    field=f"{where}.maxQueueDelay",
                    check="latency",
                )
            )
        elif b.contended_worst > b.slo:
            findings.append(
                Finding(
                    "warning",
                    f"{budget}, behind a full batch still running = {ms(b.contended_worst)} exceeds the p99 SLO "
                    f"{ms(b.slo)} ({slo_field}): the SLO holds only while the executor is mostly idle",
                    lane=lane.name,
                    field=f"{where}.maxQueueDelay",
                    check="latency-contended",
                )
            )
        if b.expected_rate is not None:
            if b.capacity < b.expected_rate:
                findings.append(
                    Finding(
                        "error",
                        f"expectedRate {b.expected_rate:g}/s exceeds the lane's capacity at max batch: "
                        f"{spec.replicas} replica(s) x {b.max_batch} rows / {ms(b.exec_max_batch)} = "
                        f"{b.capacity:.4g}/s; add replicas or raise maxBatchSize",
                        lane=lane.name,
                        field=f"{where}.expectedRate",
                        check="capacity",
                    )
                )
            utilisation += b.expected_rate / b.capacity
    rated = [lane for lane in spec.lanes if lane.expected_rate is not None]
    if len(rated) > 1 and utilisation > 1.0:
        findings.append(
            Finding(
                "error",
                f"the lanes' expected rates together need {utilisation:.0%} of the executor time of "
                f"{spec.replicas} replica(s) at max batch (lanes share each pod's executor); add replicas",
                field="spec.replicas",
                check="utilisation",
            )
        )
    loop_capacity = spec.replicas / profile.front_end_cost if profile.front_end_cost > 0 else math.inf
    total_rate = sum(lane.expected_rate or 0.0 for lane in rated)
    if total_rate > loop_capacity:
        findings.append(
            Finding(
                "error",
                f"the lanes' expected rates together ({total_rate:g}/s) exceed what the pods' HTTP loops "
                f"answer: {spec.replicas} replica(s) / {ms(profile.front_end_cost)} per request "
                f"(the profile's frontEndCost) = {loop_capacity:.4g}/s, whatever the batching; add replicas",
                field="spec.replicas",
                check="front-end",
            )
        )
    return findings
