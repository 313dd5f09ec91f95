"""Drill 2: kube-apiserver restarted, and etcd restarted, mid-canary.

The drill's own LocalCluster (never the session's ``kube``) has one component stopped and
started again on the same port and data directory while a canary runs under trace traffic.
The same operator process must reconnect (it is not restarted), its watches and caches must
resync (a child deleted by hand afterwards is re-created: only a live watch tells it), and
the rollout must finish as it would have: promoted once, no decision recorded twice, no pod
without its ConfigMap. Runtime pods keep serving while the control plane is down.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from bpdrill import Drill
from bpdrill_stack import DrillStack, duplicate_decisions, policy, ts

pytestmark = [pytest.mark.cluster, pytest.mark.prometheus, pytest.mark.slow]

DOWN_FOR = 15.0
"""Seconds the component stays down (the fault's size, not a wait on an outcome)."""


def _restart_mid_canary(tmp_path: Path, drill: Drill, component: str) -> None:
    drill.fault = f"{component} stopped for {DOWN_FOR:g}s mid-canary, then started again (same port and data)"
    drill.expected = (
        "the same operator process reconnects, its caches resync, the rollout finishes as it would have "
        "(promoted once); runtime keeps serving"
    )
    # Nodes keep their health through the outage: the node lifecycle controller would mark
    # every pod NotReady once the leases it sees are older than its grace period, and kwok,
    # unlike a kubelet, never reports an already-started pod Ready again (see test_capacity).
    with DrillStack.start(tmp_path, gpu_nodes=2, node_monitor_grace_period=600) as s:
        assert s.harness is not None and s.audit is not None
        s.start_traffic()
        op = s.operator()
        s.apply(policy(progressDeadline="3m"))
        first = s.wait(lambda st: st.get("phase") == "Healthy", 180, "the first revision Healthy")["stableRevision"]
        s.harness.wait_ready("shop", 2, timeout=120)
        base = s.traffic()
        s.apply(policy("4ms", progressDeadline="3m"))
        mid = s.wait(
            lambda st: (
                st.get("canaryRevision") not in (None, first)
                and st.get("currentStepIndex") == 0
                and (st.get("rollout") or {}).get("stepStartedAt")
            ),
            120,
            "the canary ready at step 1",
        )
        canary = mid["canaryRevision"]
        t_fault = time.monotonic()
        s.cluster.restart(component, down_for=DOWN_FOR)
        t_back, wall_back = time.monotonic(), time.time()
        assert op.proc.poll() is None, f"the operator exited while {component} was down:\n{op.log()[-3000:]}"
        # detect: the operator writes again (a status change after the outage)
        s.wait(
            lambda st: (
                st.get("stableRevision") == canary
                or ts((st.get("lastAnalysis") or {}).get("time", "1970-01-01T00:00:00Z")) >= wall_back - 1
            ),
            120,
            "the operator writing again (an analysis after the outage)",
        )
        writing_again = time.monotonic() - t_back
        done = s.wait(
            lambda st: st.get("phase") == "Healthy" and st.get("stableRevision") == canary,
            240,
            f"the rollout finished after the {component} restart",
        )
        recovered = time.monotonic() - t_back
        assert op.proc.poll() is None, "the same operator process finished the rollout"
        # caches resynced and watches live: a child deleted by hand comes back
        s.kube.kubectl("delete", "service", "shop", "-n", s.namespace)
        t_del = time.monotonic()
        s.kube.wait_for(lambda: s.kube.get("service", "shop", s.namespace), 60, "the Service re-created")
        service_back = time.monotonic() - t_del
        sent, failed, lost = (a - b for a, b in zip(s.traffic(), base, strict=True))
        s.audit.stop()
        kinds = [(e["kind"], e["revision"]) for e in done["ledger"] if e["kind"] != "Analysis"]
        assert kinds.count(("Promoted", canary)) == 1 and kinds.count(("CanaryStarted", canary)) == 1
        assert not duplicate_decisions(done["ledger"]), duplicate_decisions(done["ledger"])
        assert not s.audit.violations, s.audit.violations
        assert s.audit.errors > 0, "the audit saw the control plane down (else the fault did not happen)"
        drill.observed = (
            f"operator stayed up and wrote again {writing_again:.1f}s after {component} was back; promoted "
            f"{canary} once {recovered:.1f}s after; a deleted Service re-created in {service_back:.1f}s; "
            f"{failed} of {sent} requests failed during the canary"
        )
        drill.detected(writing_again)
        drill.recovered(recovered)
        drill.requests_sent, drill.requests_failed, drill.requests_lost = sent, failed, lost
        drill.figures = {
            "down_s": round(t_back - t_fault, 1),
            "service_recreated_s": round(service_back, 1),
            "audit_errors_while_down": s.audit.errors,
        }
        assert s.replay is not None
        for (revision, track), stats in s.replay.stats.items():
            drill.figures[f"requests_{track}_{revision}_sent_failed"] = f"{stats.sent}/{stats.errors}"
            if stats.failures:
                drill.figures[f"requests_{track}_{revision}_failures"] = str(dict(stats.failures))
        if s.harness.errors:
            drill.figures["harness_errors"] = "; ".join(s.harness.errors[-5:])[:500]


def test_apiserver_restart_mid_canary(tmp_path: Path, drill: Drill) -> None:
    _restart_mid_canary(tmp_path, drill, "kube-apiserver")


@pytest.mark.long_drill
def test_etcd_restart_mid_canary(tmp_path: Path, drill: Drill) -> None:
    _restart_mid_canary(tmp_path, drill, "etcd")
