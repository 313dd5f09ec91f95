"""`kubectl batchpilot recommend` end to end: the operator, the real control plane, a real runtime
process per pod (local harness) serving a replay of the real trace, and the apiserver's pod
proxy reaching the runtime's /admin endpoints through the local pod network (only 127.0.0.0/8 is
ever dialled: see batchpilot_localdev/podnet.py). Also: exactly the RBAC the command documents suffices,
and without ``pods/proxy`` it fails saying so."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from batchpilot_localdev.harness import RuntimeHarness
from batchpilot_localdev.load import ROW, TraceReplay
from batchpilot_localdev.prometheus import PrometheusServer
from batchpilot_operator.livedata import RBAC_RULES
from batchpilot_operator.tune.live import BREACH_GROWTH, BREACH_NOW
from batchpilot_operator.tune.profile import LatencyProfile
from batchpilot_operator.tune.search import SLOTargets, search
from batchpilot_operator.tune.trace import Trace, load_trace
from bptest import REPO, Kube, OperatorProcess, Plugin, start_operator

# alone: its assertions compare the pods' p99 with the model's and need the sender on time;
# beside the other half of the suite on 2 cores both missed (pods 3-4x slower, the sender late).
pytestmark = [pytest.mark.cluster, pytest.mark.prometheus, pytest.mark.slow, pytest.mark.alone]

HERE = Path(__file__).parent
TRACE = REPO.parent / "shared" / "traces" / "azure-llm-2023-code.csv"
SLICE_START = 2000
SLICE = 500
"""Arrivals 2000..2499 of the real trace, looped. Of its 500-arrival windows this one is the
least bursty (gap CV 1.9; the trace's worst reach 16): with bursts of tens of requests at one
instant, a p99 is set by one burst whatever the rate, and what the runtime records of such a
burst on a loaded 2-core machine (the sender lagging, then catching up) decides the verdict."""
# bp_op_models.linear sleeps 5 ms a row.
SLO_ROWS = 20
"""The policy's p99 SLO in forward times of one row as the pod measures it (its live profile's
mean, right before), set once measured: its queue-age SLO is 0.8 of that, the margin 0.2. Fixed
durations made the tests a test of this machine's speed: on a loaded 2-core machine the model
thread wakes from its 5 ms sleep late (6.4 to 11.6 ms a row measured), and against a fixed
100 ms SLO the slice's bursts alone (tens of rows at one instant, whatever the rate) reached
the SLO at 1 req/s. In these units the premises hold at any speed (simulated over the slice,
as ratios of the SLO: p99 0.41 at the normal rate, 4.9 at the surge, for 6.4 and 11.6 ms alike)."""
LOOSE_SLO = SLOTargets(p99_latency=0.5, queue_age=0.4, margin=0.2)
"""The policy's SLO until the service time is measured."""
WINDOW = 30.0
"""The scheduled recommendation's window (spec.tuning) in the SettingsStale test."""
LAG_ROWS = 1.0
"""The SettingsStale test judges the normal traffic only over windows whose sender was never late
by more than the time this many of its arrivals take at the normal rate (load.LATE_S records any
lag over 20 ms): a sender catching up sends them at once, a burst the trace does not have. One
row's worth adds at most one row of queueing to a burst, a quarter of the SLO's margin (0.2 of
SLO_ROWS: 4 rows)."""
CALM = 0.4
"""The normal traffic, as a fraction of the capacity measured in the test (``Setup.capacity``)."""
SURGE = 0.7
"""The surge, as a fraction of the throughput the pod sustains under a closed-loop load measured
in the test (``Setup.throughput``): a utilization at which the slice's bursts queue behind each
other, so the p99 is set by the rate and a breach is certain at any speed. Below that the p99 is
set by the bursts alone (a run at twice the simulated capacity, 34% utilization, measured 83 ms
with 85 ms at the normal rate). The capacity of a window of the looped slice depends on which of
its bursts the window holds, so the surge's windows hold the slice at least twice
(``Setup.surge``). The prediction can miss the p99 either way (a cold CI run measured 94 ms
where 184 ms was predicted from the p90 column the profile was read by then), so the test
measures the breach, by the recommender's own criterion (the SLO less its margin), rather than
assuming it."""


def policy(tuning: dict[str, Any] | None = None, slo: SLOTargets | None = None, window: str = "1ms") -> dict[str, Any]:
    """The policy; without ``slo`` (before the service time is measured) a loose one."""
    p99, age = (slo or LOOSE_SLO).p99_latency, (slo or LOOSE_SLO).queue_age
    spec: dict[str, Any] = {
        "model": {"name": "m", "image": "runtime:dev", "source": "python:bp_op_models:linear", "device": "cpu",
                  "dtype": "float32", "threads": 1},
        "replicas": 1,
        "resources": {"gpus": 1},
        "lanes": [{"name": "interactive", "maxBatchSize": 1, "maxQueueDelay": window, "maxQueueLength": 256,
                   "requestTimeout": "1s"}],
        "slo": {"p99Latency": f"{p99 * 1e3:.1f}ms", "maxQueueAge": f"{age * 1e3:.1f}ms"},
        # One step long enough for two analyses of each revision (the model-check test's canary).
        "rollout": {"steps": [{"weight": 50, "pause": "75s"}], "analysisInterval": "30s"},
    }  # fmt: skip
    if tuning is not None:
        spec["tuning"] = tuning
    return {
        "apiVersion": "batchpilot.dev/v1alpha1",
        "kind": "BatchingPolicy",
        "metadata": {"name": "shop"},
        "spec": spec,
    }


def capacity(arrivals: Trace, profile: LatencyProfile, slo: SLOTargets) -> float:
    """The simulator's capacity of the policy's setting (batch size 1) for the slice."""
    result = search(arrivals, profile, slo, replicas=1, batch_sizes=[1], windows=[0.001], verify=())
    return result.capacity


def closed_loop_throughput(url: str, seconds: float = 4.0, in_flight: int = 16) -> float:
    """Requests/s answered 200 with ``in_flight`` requests always outstanding (the pod saturated)."""
    body = json.dumps({"inputs": [{"name": "input", "shape": [1, 512], "datatype": "FP32", "data": ROW}]}).encode()

    async def run() -> int:
        ok = 0
        end = time.monotonic() + seconds
        async with aiohttp.ClientSession(headers={"Content-Type": "application/json"}) as session:

            async def client() -> None:
                nonlocal ok
                while time.monotonic() < end:
                    async with session.post(f"{url}/v2/models/m/infer", data=body) as r:
                        await r.read()
                        ok += r.status == 200

            await asyncio.gather(*(client() for _ in range(in_flight)))
        return ok

    return asyncio.run(run()) / seconds


@dataclass
class Setup:
    kube: Kube
    namespace: str
    harness: RuntimeHarness
    op: OperatorProcess
    arrivals: Trace
    slo: SLOTargets = LOOSE_SLO
    """Set from the measured service time (see SLO_ROWS)."""
    generation: int = 0
    """The policy's generation once the test set its SLO (the operator never changes it)."""
    throughput: float = 0.0
    """Requests/s the pod answers under a closed-loop load (16 in flight): its real ceiling."""
    capacity: float = 0.0
    """The simulator's capacity of the policy's setting over the whole slice, at the service
    time the pod measured (req/s): the scale every rate of these tests is set on."""

    @property
    def rate(self) -> float:
        """The normal traffic (see CALM)."""
        return CALM * self.capacity

    @property
    def surge(self) -> float:
        """The surge (see SURGE): at least two loops of the slice in a recommendation's window."""
        return max(SURGE * self.throughput, 2 * SLICE / WINDOW)

    def calibrate(self) -> None:
        """Measure the service time in the pod, set the SLO from it (SLO_ROWS) and the
        capacity at that SLO (see SURGE)."""
        warm = self.replay(10.0)
        try:
            self.kube.wait_for(lambda: self.held() >= 60, 60, "60 live batches")
        finally:
            warm.stop()
        (proc,) = self.harness.endpoints("shop")
        with urllib.request.urlopen(f"{proc.url}/admin/profile", timeout=10) as resp:
            profile = LatencyProfile.model_validate(json.loads(resp.read()))
        self.throughput = closed_loop_throughput(proc.url)
        row = profile.exec_time(1)
        self.slo = SLOTargets(p99_latency=SLO_ROWS * row, queue_age=0.8 * SLO_ROWS * row, margin=0.2)
        self.capacity = capacity(self.arrivals, profile, self.slo)
        sys.stderr.write(
            f"\n[recommend] measured forward time {row * 1e3:.2f} ms a row ({profile.quantile}): SLO p99 "
            f"{self.slo.p99_latency * 1e3:.0f} ms, capacity {self.capacity:.1f} req/s, throughput "
            f"{self.throughput:.1f} req/s; normal {self.rate:.1f}, surge {self.surge:.1f}\n"
        )

    def replay(self, rate: float) -> TraceReplay:
        return TraceReplay(
            self.arrivals.scaled_arrivals(rate), lambda: self.harness.endpoints("shop"), model="m"
        ).start()

    def held(self) -> int:
        total = 0
        for proc in self.harness.endpoints("shop"):
            with urllib.request.urlopen(f"{proc.url}/admin/arrivals", timeout=5) as resp:
                total += sum(lane["held"] for lane in json.loads(resp.read())["lanes"])
        return total

    def status(self) -> dict[str, Any]:
        return (self.kube.get("batchingpolicy", "shop", self.namespace) or {}).get("status") or {}


@pytest.fixture
def setup(
    kube: Kube, namespace: str, prometheus: PrometheusServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Setup]:
    # The runtime processes import the test model from here.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    harness = RuntimeHarness(kube.kubeconfig, namespace, tmp_path / "runtime", prometheus).start()
    op = start_operator(kube, namespace, tmp_path, prometheus_url=prometheus.url, resync=1.0)
    arrivals = Trace.from_times(load_trace(TRACE).arrivals[SLICE_START : SLICE_START + SLICE])
    try:
        yield Setup(kube, namespace, harness, op, arrivals)
    finally:
        op.stop()
        harness.stop()


def start_policy(s: Setup, tuning: dict[str, Any] | None = None) -> None:
    """The policy up, its service time measured, then its SLO (and ``tuning``) set from it: SLO and
    tuning are no revision's business, so the pods stay as they are."""
    s.kube.apply(policy(), "-n", s.namespace)
    s.kube.wait_for(lambda: s.status().get("phase") == "Healthy", 120, "the policy Healthy")
    s.harness.wait_ready("shop", 1)
    s.calibrate()
    revision = s.status()["stableRevision"]
    s.kube.apply(policy(tuning, s.slo), "-n", s.namespace)
    s.generation = s.kube.get("batchingpolicy", "shop", s.namespace)["metadata"]["generation"]
    s.kube.wait_for(lambda: s.status().get("observedGeneration") == s.generation, 60, "the SLO change observed")
    assert s.status()["stableRevision"] == revision and not s.status().get("canaryRevision")


def test_recommend_reads_the_pods_through_the_pod_proxy(setup: Setup) -> None:
    s = setup
    start_policy(s)
    before = s.held()
    replay = s.replay(s.rate)
    started = time.monotonic()
    try:
        s.kube.wait_for(lambda: s.held() - before >= SLICE, 2 * SLICE / s.rate + 30, f"{SLICE} arrivals captured")
        plugin = Plugin(s.kube, s.namespace)
        since = f"{time.monotonic() - started:.1f}s"  # the replay only, not the calibration
        data = plugin.json("recommend", "shop", "--since", since)
        planned = plugin.json("recommend", "shop", "--since", since, "--rate", f"{s.surge:.3f}")
        table = plugin.run("recommend", "shop", "--since", since).stdout
    finally:
        replay.stop()
    for d in (data, planned):
        ln = d["lanes"][0]
        sys.stderr.write(
            f"\n[recommend] replay {s.rate:.1f} req/s: traffic {ln['traffic']}, current {ln['current']}, "
            f"recommended {ln['recommended']}, reasons {ln['reasons']}, profile {d['profile']}\n"
        )
    (pod,) = [p.pod for p in s.harness.endpoints("shop")]
    assert data["pods"] == [pod] and data["podErrors"] == []
    assert data["profile"]["model"] == "python:bp_op_models:linear" and 1 in data["profile"]["batchSizes"]
    (lane,) = data["lanes"]
    assert lane["lane"] == "interactive"
    assert lane["traffic"]["requests"] >= SLICE * 0.9
    assert lane["traffic"]["rate"] == pytest.approx(s.rate, rel=0.25)
    assert lane["traffic"]["gapCV"] > 1.2  # the real trace's bursts, not a uniform load
    assert lane["current"]["maxBatchSize"] == 1 and lane["current"]["maxQueueDelay"] == "1ms"
    # At the observed traffic the setting holds (the replay runs below its capacity) ...
    assert lane["current"]["atObserved"]["meetsTargets"] is True
    assert BREACH_NOW not in lane["reasons"]
    assert lane["current"]["capacity"] > lane["observedRowRate"]
    # ... and at the surge it does not: the plan says so, and no window fixes it.
    (plan,) = planned["lanes"]
    assert plan["reasons"][0] == BREACH_GROWTH
    assert plan["current"]["atPlanned"]["meetsTargets"] is False
    assert plan["plannedRowRate"] == pytest.approx(s.surge, rel=0.05)
    assert any("replicas would serve" in n for n in plan["notes"]), plan["notes"]
    for ops in (data["patch"], planned["patch"]):
        if ops:
            assert ops[0] == {"op": "test", "path": "/spec/lanes/0/name", "value": "interactive"}
    assert "lane interactive" in table and "recommended" in table and "capacity rows/s" in table
    # The model checked against the pod: the replay's own requests, replayed through the model with
    # the setting the pod ran, against the latencies the pod recorded for them.
    model = lane["model"]
    sys.stderr.write(f"\n[recommend] {model['summary']}\n")
    (check,) = model["checks"]
    assert check["requests"] >= SLICE * 0.9 and check["observedP99"] > 0 and check["predictedP99"] > 0
    assert check["correction"] == 1.0  # no operator check before (no spec.tuning)
    ratio = check["observedP99"] / check["predictedP99"]
    assert model["correction"] == pytest.approx(min(max(ratio, 0.25), 4.0), rel=0.01)
    assert "model error last window" in table
    # The policy was never edited.
    assert s.kube.get("batchingpolicy", "shop", s.namespace)["metadata"]["generation"] == s.generation


def test_every_analysis_checks_the_model_against_each_revision(setup: Setup) -> None:
    """With spec.tuning the operator replays, after every canary analysis, the arrivals each
    revision's pods got in the window through the model and records its p99 beside theirs."""
    s = setup
    tuning = {"interval": "1h"}
    start_policy(s, tuning=tuning)
    replay = s.replay(s.rate)
    try:
        s.kube.apply(policy(tuning, s.slo, window="2ms"), "-n", s.namespace)  # a new revision: a canary
        s.harness.wait_ready("shop", 2)

        def both_checked() -> Any:
            la = s.status().get("lastAnalysis") or {}
            lanes = la.get("lanes") or []
            return lanes and "canary p99" in (lanes[0].get("model") or "") and "stable p99" in lanes[0]["model"] and la

        la = s.kube.wait_for(both_checked, 200, "an analysis with the model checked on both revisions")
    finally:
        replay.stop()
    (lane,) = la["lanes"]
    sys.stderr.write(f"\n[recommend] analysis at {s.rate:.1f} req/s: {lane['model']}\n")
    assert lane["predictedP99Latency"] > 0 and lane["stablePredictedP99Latency"] > 0
    entries = [
        e for e in s.status()["ledger"]
        if e["kind"] == "Analysis" and e.get("metric") == "p99Latency" and e.get("predictedValue") is not None
    ]  # fmt: skip
    assert entries, "no p99 entry in the ledger carries the model's value"
    last = entries[-1]
    assert last["revision"] == la["revision"] and last["stablePredictedValue"] > 0
    # The model against the pods' own record: off by less than the correction's bound (4x).
    for error in (last["modelError"], last["stableModelError"]):
        assert -0.75 < error < 3.0, last
    assert "model:" in Plugin(s.kube, s.namespace).run("status", "shop").stdout


def _kubeconfig_for(kube: Kube, namespace: str, sa: str, path: Path) -> Path:
    admin = yaml.safe_load(kube.kubeconfig.read_text())
    token = kube.kubectl("create", "token", sa, "-n", namespace).stdout.strip()
    admin["users"] = [{"name": sa, "user": {"token": token}}]
    admin["contexts"] = [{"name": "sa", "context": {"cluster": "local", "user": sa, "namespace": namespace}}]
    admin["current-context"] = "sa"
    path.write_text(yaml.safe_dump(admin))
    return path


def test_recommend_needs_exactly_the_documented_rbac(setup: Setup, tmp_path: Path) -> None:
    s = setup
    start_policy(s)
    replay = s.replay(s.rate)
    try:
        s.kube.wait_for(lambda: s.held() >= 50, 60, "some arrivals captured")
    finally:
        replay.stop()
    ns = s.namespace
    s.kube.kubectl("create", "serviceaccount", "recommender", "-n", ns)
    role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": {"name": "recommend", "namespace": ns}, "rules": RBAC_RULES}  # fmt: skip
    s.kube.apply(role, "-n", ns)
    s.kube.kubectl(
        "create", "rolebinding", "recommend", "--role=recommend", f"--serviceaccount={ns}:recommender", "-n", ns
    )
    config = _kubeconfig_for(s.kube, ns, "recommender", tmp_path / "sa.kubeconfig")
    plugin = Plugin(s.kube, ns)

    def run() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [s.kube.kubectl_bin, "batchpilot", "recommend", "shop", "-o", "json", "--kubeconfig", str(config)],
            capture_output=True, text=True, env=plugin.env, timeout=120, check=False,
        )  # fmt: skip

    ok = run()
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["podErrors"] == []
    # Without pods/proxy the pods cannot be read, and the command says why.
    role["rules"] = [r for r in RBAC_RULES if r["resources"] != ["pods/proxy"]]
    s.kube.apply(role, "-n", ns)
    denied = s.kube.wait_for(lambda: (r := run()).returncode != 0 and r, 30, "the RBAC change to take effect")
    errors = json.loads(denied.stdout)["podErrors"]
    assert len(errors) == 1 and "403" in errors[0], errors


def _t(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def measured(replay: TraceReplay) -> tuple[float, float]:
    """The replay's own measure: p99 latency of its answered requests (from their scheduled
    send), and the share of requests that failed."""
    latencies = sorted(x for st in replay.stats.values() for x in st.latencies)
    sent = sum(st.sent for st in replay.stats.values())
    failed = sum(st.errors for st in replay.stats.values())
    assert latencies and sent, "the replay sent nothing"
    return latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], failed / sent


def test_settings_stale_is_raised_when_the_traffic_surges(setup: Setup) -> None:
    s = setup
    window = WINDOW
    start_policy(s, tuning={"interval": "10s", "window": f"{window:g}s", "growth": 1, "margin": 0.2})

    def after(rec: Any, t: float) -> bool:
        """``rec`` is a recommendation whose whole window lies after ``t``."""
        return bool(rec) and _t(rec["time"]) > t + window + 1

    def judged_after(t: float) -> Any:
        """The first recommendation whose whole window lies after ``t``."""
        rec = s.status().get("recommendation")
        return rec if after(rec, t) else None

    def condition() -> dict[str, Any]:
        return next(c for c in s.status()["conditions"] if c["type"] == "SettingsStale")

    replay = s.replay(s.rate)
    started = time.time()

    def judged_calm() -> Any:
        """The first recommendation over the normal traffic whose window the sender kept up with:
        a loaded machine's load generator that falls behind and catches up sends bursts the
        trace does not have, and a p99 here is set by one burst (see SLICE)."""
        rec: Any = s.status().get("recommendation")
        if not after(rec, since[0]):
            last_seen[0] = rec["time"] if rec else None
            return None
        end = _t(rec["time"])
        lagged = [(at, lag) for at, lag in list(replay.late) if end - window <= at <= end and lag > tolerable]
        if lagged:
            skipped.append(round(max(lag for _, lag in lagged), 3))
            since[0] = max(at for at, _ in lagged)  # the next window must start after the last
            return None
        return rec

    tolerable = LAG_ROWS / s.rate
    skipped: list[float] = []
    since = [started]
    last_seen: list[str | None] = [None]
    try:
        calm = s.kube.wait_for(judged_calm, 300, "a recommendation over the normal traffic, sent on time")
    except AssertionError as exc:
        raise AssertionError(
            f"{exc}; windows skipped, the sender late by more than {tolerable:.3f} s: {skipped}; "
            f"the last recommendation too early was at {last_seen[0]} (the replay started at {started:.1f})"
        ) from exc
    finally:
        replay.stop()
    if skipped:
        sys.stderr.write(f"\n[recommend] windows skipped, the sender late by up to {skipped} s\n")
    # No breach predicted. (A window that batches a little better than 1 row may be
    # recommended as MoreCapacityAvailable when the measured per-batch overhead is large.)
    assert not {BREACH_NOW, BREACH_GROWTH} & set(calm["lanes"][0]["reasons"]), json.dumps(calm, indent=1)
    assert condition()["reason"] in ("SettingsCurrent", "MoreCapacityAvailable")

    calm_p99, calm_failed = measured(replay)

    surge = s.replay(s.surge)
    started = time.time()
    try:
        stale = s.kube.wait_for(lambda: judged_after(started), 90, "a recommendation over the surge")
    finally:
        surge.stop()
    surge_p99, surge_failed = measured(surge)
    (lane,) = stale["lanes"]
    sys.stderr.write(
        f"\n[recommend] measured p99 {calm_p99 * 1e3:.0f} ms ({calm_failed:.1%} failed) at {s.rate:.1f} req/s, "
        f"{surge_p99 * 1e3:.0f} ms ({surge_failed:.1%} failed) at {s.surge:.1f} req/s; "
        f"predicted at the surge: {lane['current']['atObserved']}\n"
    )
    # The breach the recommender predicts is one the runtime really had (the premise is measured,
    # not assumed), and the calm traffic was served better than the surge.
    assert surge_p99 > s.slo.p99_latency * (1 - s.slo.margin) or surge_failed > 0.01
    assert calm_p99 < surge_p99
    assert stale["stale"] is True and stale["reason"] == BREACH_NOW, stale["message"]
    assert lane["traffic"]["rate"] == pytest.approx(s.surge, rel=0.25)
    assert lane["current"]["capacity"] < lane["observedRowRate"]
    assert lane["current"]["atObserved"]["meetsTargets"] is False
    assert "replicas would serve" in stale["message"]
    # Each recommendation checked its model against the pod (or said why not) and kept the history.
    cal = stale["calibration"]["interactive"]
    sys.stderr.write(f"\n[recommend] calibration at the surge: {cal['summary']}; calm: {calm['calibration']}\n")
    assert cal["checks"] or cal["skipped"], cal
    assert "no request outcomes" not in cal["skipped"]
    assert "model error" in stale["message"]
    cond = condition()
    assert (cond["status"], cond["reason"]) == ("True", BREACH_NOW)
    events = json.loads(
        s.kube.kubectl(
            "get", "events", "-n", s.namespace, "--field-selector", "reason=SettingsStale", "-o", "json"
        ).stdout
    )["items"]
    breach = [e for e in events if e["message"].startswith(f"lane interactive: {BREACH_NOW}")]
    assert breach and breach[0]["involvedObject"]["name"] == "shop" and breach[0]["type"] == "Warning", events
    # The gauge is set after the status write that carries the condition: it can trail it briefly.
    s.kube.wait_for(
        lambda: s.op.metric("batchpilot_operator_settings_stale", policy="shop", reason=BREACH_NOW) == 1,
        10,
        "the settings_stale gauge",
    )
    # Advice only: the spec is what was applied.
    obj = s.kube.get("batchingpolicy", "shop", s.namespace)
    assert obj is not None and obj["metadata"]["generation"] == s.generation
    assert obj["spec"]["lanes"][0]["maxBatchSize"] == 1
