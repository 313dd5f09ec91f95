"""Drills 3 and 4: the operator's dependencies slow down or go away mid-canary.

3. Prometheus behind Toxiproxy: latency above the operator's query timeout, then connection
   resets. The analyses are Error, the canary is held (Stalled/MetricsUnavailable in status and
   as an Event) and never promoted on missing data, another policy's reconciles stay prompt, and
   the rollout resumes once the toxics are removed. The apiserver behind a latency toxic: the
   operator (kubeconfig through the proxy, TLS passing through) still takes a canary to promotion.
4. Prometheus stopped mid-canary: under ``Hold`` the canary waits (any length of time) and
   resumes; under ``Rollback`` it is rolled back once the deadline passes, stable untouched.
   The 5-minute outages are long drills; CI runs a 30 s outage with a 10 s deadline (Rollback;
   a short Hold is phase (c) of tests/operator/test_canary_e2e.py). The slow apiserver is a long
   drill too.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from batchpilot_localdev.toxiproxy import Toxiproxy
from bpdrill import Drill
from bpdrill_deps import Stage, apiserver_address, condition, policy, proxied_kubeconfig, stage, stalled
from bptest import Kube, wait_until

pytestmark = [pytest.mark.cluster, pytest.mark.prometheus, pytest.mark.slow]

QUERY_TIMEOUT_S = 1.0


@pytest.fixture
def deps(kube: Kube, namespace: str, tmp_path: Path) -> Iterator[Stage]:
    yield from stage(kube, namespace, tmp_path, prometheus_timeout=QUERY_TIMEOUT_S)


def errors(s: Stage) -> float:
    return s.op.metric("batchpilot_operator_analyses_total", namespace=s.namespace, outcome="Error")


def hold_without_promotion(s: Stage, stable: str, canary: str, seconds: float, what: str) -> dict[str, object]:
    """Poll the policy for ``seconds``: it must stay Stalled on ``canary``, never promoted."""
    end = time.monotonic() + seconds
    last: dict[str, object] = {}
    while time.monotonic() < end:
        st = s.status()
        assert st.get("stableRevision") == stable, f"promoted on missing data during {what}: {st}"
        assert st.get("canaryRevision") == canary, f"canary lost during {what}: {st}"
        assert stalled(st), f"not Stalled during {what}: {st.get('conditions')}"
        last = st
        time.sleep(0.5)
    return last


def test_prometheus_slow_then_resetting(deps: Stage, drill: Drill) -> None:
    s = deps
    drill.fault = (
        f"Toxiproxy between operator and Prometheus: 3 s latency (query timeout {QUERY_TIMEOUT_S:g} s), "
        "then TCP resets, mid-canary"
    )
    drill.expected = (
        "analyses Error, canary held Stalled/MetricsUnavailable (status + Event), never promoted; "
        "another policy reconciles promptly; resumes and promotes after the toxics are removed"
    )
    other = policy("other")
    other["spec"]["replicas"] = 1
    s.apply(other)
    s.wait(lambda st: st.get("phase") == "Healthy", 120, "policy other Healthy", name="other")
    baseline = s.reconcile_latency("other", 2)
    stable, canary = s.start_canary("3ms")

    errors0 = errors(s)
    s.toxi.latency("prometheus", 3000)
    t0 = time.monotonic()
    held = s.wait(stalled, 60, "Stalled while Prometheus is slow")
    detect = time.monotonic() - t0
    cond = condition(held, "Stalled") or {}
    assert cond.get("reason") == "MetricsUnavailable", cond
    # The operator counts a decision's analyses after writing its status (a status write that
    # fails is retried, and must not count twice), so the counter can trail the status briefly.
    s.kube.wait_for(lambda: errors(s) > errors0, 10, "the Error analysis counted")
    during = s.reconcile_latency("other", 1)
    hold_without_promotion(s, stable, canary, 12, "the latency toxic")  # two 6 s step pauses

    s.toxi.reset_peer("prometheus")  # before the latency goes: no moment without a fault
    s.toxi.remove_toxic("prometheus", "latency")
    errors1 = errors(s)
    s.kube.wait_for(lambda: errors(s) >= errors1 + 2, 60, "Error analyses while connections are reset")
    hold_without_promotion(s, stable, canary, 12, "the reset toxic")
    error_entries = [e for e in s.status().get("ledger", []) if e.get("outcome") == "Error"]

    s.toxi.reset()
    t1 = time.monotonic()
    done = s.wait(
        lambda st: st.get("stableRevision") == canary and st.get("phase") == "Healthy", 120, "promotion after the fault"
    )
    recover = time.monotonic() - t1
    assert done["history"][-1]["outcome"] == "Promoted"
    # Events are posted right after the status write that records the decision: poll briefly.
    s.kube.wait_for(
        lambda: {"Stalled", "MetricsRestored", "Promoted"} <= {e["reason"] for e in s.events()},
        10,
        "the Stalled, MetricsRestored and Promoted Events",
    )
    assert during < 10.0, f"policy other took {during:.1f}s to reconcile while Prometheus was slow"

    drill.detected(detect)
    drill.recovered(recover)
    total_errors = errors(s) - errors0
    drill.figures.update(
        {
            "error_analyses": int(total_errors),
            "ledger_error_entries": len(error_entries),
            "other_policy_reconcile_s_baseline": round(baseline, 2),
            "other_policy_reconcile_s_during_fault": round(during, 2),
        }
    )
    drill.observed = (
        f"Stalled/MetricsUnavailable {detect:.1f} s after the latency toxic; {int(total_errors)} Error analyses, "
        f"held 24 s+ without promotion; policy other reconciled in {during:.1f} s during the fault "
        f"({baseline:.1f} s before); promoted {recover:.1f} s after the toxics were removed"
    )


def prometheus_outage(s: Stage, drill: Drill, outage_s: float, deadline_s: float | None) -> None:
    """Stop Prometheus mid-canary for ``outage_s``; ``deadline_s`` None: Hold, else Rollback."""
    rollout = (
        {"onMetricsUnavailable": {"action": "Hold"}}
        if deadline_s is None
        else {"onMetricsUnavailable": {"action": "Rollback", "deadline": f"{deadline_s:g}s"}}
    )
    mode = "Hold" if deadline_s is None else f"Rollback, deadline {deadline_s:g} s"
    drill.fault = f"Prometheus stopped {outage_s:g} s mid-canary (onMetricsUnavailable {mode})"
    stable, canary = s.start_canary("3ms", **rollout)
    s.prom.stop()
    t0 = time.monotonic()
    held = s.wait(stalled, 60, "Stalled while Prometheus is down")
    detect = time.monotonic() - t0
    drill.detected(detect)
    assert (condition(held, "Stalled") or {}).get("reason") == "MetricsUnavailable"
    if deadline_s is None:
        drill.expected = "Stalled/MetricsUnavailable for the whole outage, never promoted; promoted after it"
        hold_without_promotion(s, stable, canary, outage_s - (time.monotonic() - t0), "the outage")
        s.prom.start()
        t1 = time.monotonic()
        s.wait(
            lambda st: st.get("stableRevision") == canary and st.get("phase") == "Healthy",
            120,
            "promotion after Prometheus returned",
        )
        recover = time.monotonic() - t1
        drill.recovered(recover)
        drill.observed = (
            f"Stalled {detect:.1f} s after the stop, held {outage_s:g} s, promoted {recover:.1f} s after restart"
        )
        return
    drill.expected = (
        f"Stalled, then RolledBack (reason MetricsUnavailable) {deadline_s:g} s after the first Error; "
        "stable untouched and serving"
    )
    rolled = s.wait(lambda st: st.get("phase") == "RolledBack", deadline_s + 60, "rollback at the metrics deadline")
    rolled_after = time.monotonic() - t0
    assert rolled["stableRevision"] == stable and not rolled.get("canaryRevision"), rolled
    entry = next(e for e in reversed(rolled["ledger"]) if e.get("kind") == "RolledBack")
    assert entry.get("reason") == "MetricsUnavailable", entry
    assert rolled_after >= deadline_s, f"rolled back after {rolled_after:.1f}s, before the {deadline_s:g}s deadline"
    s.kube.wait_for(lambda: s.kube.get("deployment", "shop-canary", s.namespace) is None, 60, "canary removed")
    while time.monotonic() - t0 < outage_s:  # the rest of the outage: it stays rolled back
        st = s.status()
        assert st.get("phase") == "RolledBack" and st.get("stableRevision") == stable, st
        time.sleep(0.5)
    s.prom.start()
    t1 = time.monotonic()
    # Stalled stays True, now with reason RolledBack: the rolled-back revision is still desired.
    after = s.wait(
        lambda st: st.get("phase") == "RolledBack" and (condition(st, "Stalled") or {}).get("reason") == "RolledBack",
        60,
        "settled after the outage",
    )
    assert after["stableRevision"] == stable
    # The stable track keeps serving: it lent a pod to the canary's step (replica ratio), so the
    # rollback scaled it back up, and that new pod serves once its model is loaded and warm. (Read
    # at once, beside the rest of the suite on 2 cores, one run found it still loading.)
    wait_until(
        lambda: len([p for p in s.harness.endpoints("shop") if p.revision == stable]) >= 2,
        120,
        "the stable track serving from 2 pods again",
    )
    drill.recovered(time.monotonic() - t1)
    drill.figures["rolled_back_after_s"] = round(rolled_after, 1)
    drill.observed = (
        f"Stalled {detect:.1f} s after the stop; RolledBack (MetricsUnavailable) {rolled_after:.1f} s after it "
        f"(deadline {deadline_s:g} s); stable {stable} untouched and serving"
    )


def test_prometheus_down_rollback_short(deps: Stage, drill: Drill) -> None:
    prometheus_outage(deps, drill, outage_s=30, deadline_s=10)


@pytest.mark.long_drill
def test_prometheus_down_5min_hold(deps: Stage, drill: Drill) -> None:
    prometheus_outage(deps, drill, outage_s=300, deadline_s=None)


@pytest.mark.long_drill
def test_prometheus_down_5min_rollback(deps: Stage, drill: Drill) -> None:
    prometheus_outage(deps, drill, outage_s=300, deadline_s=120)


@pytest.fixture
def slow_apiserver(kube: Kube, namespace: str, tmp_path: Path) -> Iterator[tuple[Stage, Toxiproxy]]:
    toxi = Toxiproxy(tmp_path / "toxiproxy-api")
    proxy = toxi.proxy("apiserver", apiserver_address(kube))
    kubeconfig = proxied_kubeconfig(kube, proxy.listen, tmp_path / "kubeconfig-proxied")
    try:
        for s in stage(kube, namespace, tmp_path, prometheus_timeout=5.0, kubeconfig=kubeconfig):
            yield s, toxi
    finally:
        toxi.stop()


@pytest.mark.long_drill
def test_slow_apiserver(slow_apiserver: tuple[Stage, Toxiproxy], drill: Drill) -> None:
    s, toxi = slow_apiserver
    latency_ms = 250
    drill.fault = f"Toxiproxy between operator and kube-apiserver: {latency_ms} ms latency on every response"
    drill.expected = "the operator keeps working: a canary is promoted, status and children consistent"
    requests0 = s.op.metric("batchpilot_operator_api_requests_total")
    toxi.latency("apiserver", latency_ms)
    t0 = time.monotonic()
    _, canary = s.start_canary("3ms")
    done = s.wait(
        lambda st: st.get("stableRevision") == canary and st.get("phase") == "Healthy", 240, "promotion, slow apiserver"
    )
    took = time.monotonic() - t0
    assert done["history"][-1]["outcome"] == "Promoted"
    # The status is written first (the record of the decision), the canary removed after it in
    # the same reconcile: under 250 ms a request, a moment later.
    s.kube.wait_for(lambda: s.kube.get("deployment", "shop-canary", s.namespace) is None, 30, "the canary removed")
    toxi.reset()
    drill.recovered(took)
    drill.figures["api_requests"] = int(s.op.metric("batchpilot_operator_api_requests_total") - requests0)
    drill.figures["promotion_s"] = round(took, 1)
    drill.observed = f"canary {canary} promoted {took:.1f} s after the change under {latency_ms} ms apiserver latency"
