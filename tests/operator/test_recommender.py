"""The operator's scheduled recommendation (recommender.refresh) with the pod documents handed in:
when it runs, what it writes in status, the SettingsStale condition and Event, switching off;
and spec.tuning's admission rules in the models and the real apiserver."""

from __future__ import annotations

import copy
import random
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from pydantic import ValidationError

from batchpilot_operator import opmetrics, recommender
from batchpilot_operator.livedata import Gathered
from batchpilot_operator.spec import parse_spec
from batchpilot_operator.status import Status
from bptest import Kube

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)
SPEC: dict[str, Any] = {
    "model": {"name": "m", "image": "runtime:dev", "source": "builtin:tiny-mlp"},
    "replicas": 1,
    "lanes": [{"name": "interactive", "maxBatchSize": 1, "maxQueueDelay": "1ms", "maxQueueLength": 1000,
               "requestTimeout": "1s"}],
    "slo": {"p99Latency": "50ms", "maxQueueAge": "30ms"},
    "tuning": {"interval": "10m", "window": "1m", "growth": 2, "margin": 0.2},
}  # fmt: skip
BODY = {"metadata": {"name": "shop", "namespace": "ns", "generation": 3}}


def arrivals(rate: float, seconds: float = 60.0) -> dict[str, Any]:
    rng = random.Random(3)
    end = NOW.timestamp()
    t, times = end - seconds, []
    while True:
        t += rng.expovariate(rate)
        if t >= end:
            break
        times.append(t)
    return {
        "kind": "ArrivalCapture", "revision": "r1", "track": "stable", "pod": "shop-stable-a",
        "capturedAt": end, "windowStart": end - seconds,
        "lanes": [{"name": "interactive", "base": times[0], "times": [x - times[0] for x in times],
                   "rows": [1] * len(times), "settings": {}, "batchCutDelay": {"samples": 0}}],
    }  # fmt: skip


PROFILE = {
    "kind": "LatencyProfile",
    "model": {"name": "m", "source": "builtin:tiny-mlp", "device": "cpu"},
    "points": [
        {"batchSize": b, "p50": 0.0015 + 0.0005 * b, "p90": 0.0015 + 0.0005 * b, "p99": 0.0015 + 0.0005 * b}
        for b in (1, 2, 4, 8)
    ],
}


class FakeGather:
    def __init__(self, rate: float | None) -> None:
        self.rate = rate
        self.calls: list[tuple[str, str, float]] = []

    def __call__(self, namespace: str, policy: str, window: float) -> Gathered:
        self.calls.append((namespace, policy, window))
        if self.rate is None:
            return Gathered(errors=["pod shop-stable-a: 503 Service Unavailable"])
        return Gathered(arrivals=[arrivals(self.rate)], profiles=[PROFILE], pods=["shop-stable-a"])


class Events:
    def __init__(self) -> None:
        self.posted: list[tuple[str, str, str]] = []

    def __call__(self, type_: str, reason: str, message: str) -> None:
        self.posted.append((type_, reason, message))


def refresh(status: Status, gather: FakeGather, events: Events, now: datetime = NOW, spec: Any = None) -> Status:
    return recommender.refresh(None, spec or parse_spec(SPEC), BODY, status, now, events, gather=gather)


def stale_gauge(reason: str) -> float:
    for metric in opmetrics.SETTINGS_STALE.collect():
        for s in metric.samples:
            if s.labels == {"namespace": "ns", "policy": "shop", "lane": "interactive", "reason": reason}:
                return s.value
    return 0.0


def test_light_traffic_holds_and_heavy_traffic_is_stale() -> None:
    events = Events()
    # Batch size 1 at 2 ms a row holds 40 req/s, and 80 (growth 2); batching would serve
    # clearly more (the profile's per-batch cost), so it is stale, but for capacity only.
    gather = FakeGather(rate=40.0)
    st = refresh(Status(), gather, events)
    assert gather.calls == [("ns", "shop", 60.0)]
    rec = st.recommendation
    assert rec is not None and rec.stale and rec.reason == "MoreCapacityAvailable"
    assert rec.lanes[0]["reasons"] == ["MoreCapacityAvailable"]
    assert rec.lanes[0]["current"]["atPlanned"]["meetsTargets"] is True
    assert rec.next_at == NOW + timedelta(minutes=10) and rec.window == "1m" and rec.growth == 2
    assert rec.patch and rec.patch[1]["path"] == "/spec/lanes/0/maxBatchSize"
    cond = st.condition("SettingsStale")
    assert cond is not None and (cond.status, cond.reason, cond.observed_generation) == (
        "True", "MoreCapacityAvailable", 3
    )  # fmt: skip
    assert [(t, r) for t, r, _ in events.posted] == [("Warning", "SettingsStale")]
    wire = st.to_dict()["recommendation"]
    assert wire["nextAt"] and wire["lanes"][0]["current"]["maxBatchSize"] == 1

    # Not due yet: no gathering at all (the idle cost is one comparison).
    later = refresh(st, gather, events, now=NOW + timedelta(minutes=5))
    assert later is st and len(gather.calls) == 1

    # Due, and the traffic has grown past what batch size 1 serves: a new reason, a new Event.
    gather.rate = 450.0
    st2 = refresh(st, gather, events, now=NOW + timedelta(minutes=10))
    rec2 = st2.recommendation
    assert rec2 is not None and rec2.stale and rec2.reason == "BreachAtCurrentTraffic"
    cond2 = st2.condition("SettingsStale")
    assert cond2 is not None and (cond2.status, cond2.reason) == ("True", "BreachAtCurrentTraffic")
    assert cond2.last_transition_time == NOW  # still True: the transition time is the first one
    assert len(events.posted) == 2 and events.posted[1][2].startswith("lane interactive: BreachAtCurrentTraffic")
    assert stale_gauge("BreachAtCurrentTraffic") == 1 and stale_gauge("MoreCapacityAvailable") == 0
    # The same verdict again: no third Event.
    refresh(st2, gather, events, now=NOW + timedelta(minutes=20))
    assert len(events.posted) == 2

    # The settings were retuned in Git (the recommended ones): at 40 req/s they hold.
    tuned = copy.deepcopy(SPEC)
    lane = tuned["lanes"][0]
    lane["maxBatchSize"] = rec.patch[1]["value"]
    lane["maxQueueDelay"] = rec.patch[2]["value"]
    gather.rate = 40.0
    st4 = refresh(st2, gather, events, now=NOW + timedelta(minutes=30), spec=parse_spec(tuned))
    cond4 = st4.condition("SettingsStale")
    assert cond4 is not None and (cond4.status, cond4.reason) == ("False", "SettingsCurrent")
    assert st4.recommendation is not None and st4.recommendation.patch == []
    assert stale_gauge("BreachAtCurrentTraffic") == 0


def test_no_answer_from_the_pods_is_unknown_not_an_error() -> None:
    events = Events()
    st = refresh(Status(), FakeGather(rate=None), events)
    rec = st.recommendation
    assert rec is not None and rec.reason == "RecommendationFailed" and "503" in rec.message
    cond = st.condition("SettingsStale")
    assert cond is not None and cond.status == "Unknown"
    assert events.posted == []


def test_turning_tuning_off_removes_what_it_wrote() -> None:
    events = Events()
    st = refresh(Status(), FakeGather(rate=450.0), events)
    assert st.recommendation is not None and stale_gauge("BreachAtCurrentTraffic") == 1
    off = parse_spec({k: v for k, v in SPEC.items() if k != "tuning"})
    gather = FakeGather(rate=450.0)
    cleared = refresh(st, gather, events, spec=off)
    assert cleared.recommendation is None and cleared.condition("SettingsStale") is None
    assert gather.calls == [] and stale_gauge("BreachAtCurrentTraffic") == 0
    # Without tuning and nothing written, the status is returned as is.
    assert refresh(Status(), gather, events, spec=off).recommendation is None


def test_status_round_trips_the_recommendation() -> None:
    st = refresh(Status(), FakeGather(rate=40.0), Events())
    again = Status.from_dict(st.to_dict())
    assert again.recommendation == st.recommendation


BAD_TUNING = [
    ({"interval": "5s"}, "spec.tuning.interval must be at least 10s", "greater than or equal to 10"),
    ({"window": "2h"}, "spec.tuning.window must be greater than zero and at most 1h", "at most 1h"),
    ({"growth": 0.5}, "spec.tuning.growth", "greater than or equal to 1"),
    ({"margin": 1}, "spec.tuning.margin", "less than 1"),
]


@pytest.mark.parametrize(("tuning", "api_message", "model_message"), BAD_TUNING)
def test_bad_tuning_is_rejected_by_the_models(tuning: dict[str, Any], api_message: str, model_message: str) -> None:
    with pytest.raises(ValidationError, match=model_message):
        parse_spec(SPEC | {"tuning": tuning})


@pytest.mark.cluster
def test_tuning_admission_in_the_real_apiserver(kube: Kube, namespace: str) -> None:
    doc = {"apiVersion": "batchpilot.dev/v1alpha1", "kind": "BatchingPolicy", "metadata": {"name": "t"}}
    ok = kube.apply(doc | {"spec": SPEC}, "-n", namespace, check=False)
    assert ok.returncode == 0, ok.stderr
    stored = kube.get("batchingpolicy", "t", namespace)
    assert stored is not None and stored["spec"]["tuning"] == SPEC["tuning"]  # not pruned
    for tuning, api_message, _ in BAD_TUNING:
        bad = copy.deepcopy(SPEC) | {"tuning": tuning}
        result = kube.apply(doc | {"metadata": {"name": "bad"}, "spec": bad}, "-n", namespace, check=False)
        assert result.returncode != 0 and api_message in result.stderr, (tuning, result.stderr)
