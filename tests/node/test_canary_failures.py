"""Canaries that never become ready on a real node: one OOM-killed by its memory limit (and so
crash-looping), one whose image tag does not exist. Each hits its progress deadline and is rolled
back with the kubelet's own reason in the policy's status and its Warning event, while the
stable pods keep serving."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from batchpilot_localdev.nodeimages import RUNTIME_IMAGE
from batchpilot_localdev.realnode import RealNode
from bpnode import events, infer, pod_ip, pods, ready_pods, real_policy
from bptest import NO_PROMETHEUS, Kube, policy_status, start_operator, wait_policy_status

pytestmark = [pytest.mark.cluster, pytest.mark.realnode, pytest.mark.slow]

PROGRESS_DEADLINE = 40
"""Seconds: long enough for the kubelet to start, kill and restart the canary's container."""


def _tiny_memory(spec: dict[str, Any]) -> None:
    # Python and torch need ~250 MB before the model is even loaded: 96Mi is an OOM kill.
    spec["resources"] = {**spec["resources"], "memory": "96Mi"}


def _missing_tag(spec: dict[str, Any]) -> None:
    # No registry here: the kubelet's pull of a tag containerd lacks fails (localhost:443 refuses).
    spec["model"] = {**spec["model"], "image": RUNTIME_IMAGE.rsplit(":", 1)[0] + ":no-such-tag"}


@pytest.mark.parametrize(
    ("change", "kubelet_says"),
    [
        pytest.param(_tiny_memory, ("OOMKilled",), id="oom-killed"),
        pytest.param(_missing_tag, ("ErrImagePull", "ImagePullBackOff"), id="missing-tag"),
    ],
)
def test_a_canary_that_cannot_start_is_rolled_back_with_the_kubelets_reason(
    kube: Kube, node: RealNode, namespace: str, tmp_path: Path, change: Any, kubelet_says: tuple[str, ...]
) -> None:
    op = start_operator(kube, namespace, tmp_path, NO_PROMETHEUS)
    try:
        policy = real_policy()
        policy["spec"]["rollout"]["progressDeadline"] = f"{PROGRESS_DEADLINE}s"
        kube.apply(policy, "-n", namespace)
        kube.wait_for(lambda: ready_pods(kube, namespace, "shop", "stable", 2), 180, "2 ready stable pods")
        stable = wait_policy_status(kube, namespace, "shop", lambda st: st.get("phase") == "Healthy", "Healthy", op)
        change(policy["spec"])
        kube.apply(policy, "-n", namespace)
        seen: set[str] = set()

        def rolled_back() -> dict[str, Any] | None:
            # What the kubelet reports on the canary's pods while it waits (the test's evidence
            # that the failure is the real one, not a scheduling problem).
            for pod in pods(kube, namespace, "shop", "canary"):
                for cs in (pod.get("status") or {}).get("containerStatuses") or []:
                    seen.add(json.dumps(cs.get("state")) + json.dumps(cs.get("lastState")))
            st = policy_status(kube, namespace, "shop")
            failed = st.get("failedRevisions") or []
            return st if failed and st.get("phase") != "Progressing" else None

        status = kube.wait_for(rolled_back, PROGRESS_DEADLINE + 90, "the canary rolled back")
        assert any(word in s for s in seen for word in kubelet_says), seen
        (failed,) = status["failedRevisions"]
        assert failed["revision"] != stable["stableRevision"] and failed["reason"] == "CanaryNotReady"
        assert "(progressDeadline)" in failed["evidence"]
        assert any(word in failed["evidence"] for word in kubelet_says), failed["evidence"]
        assert status["stableRevision"] == stable["stableRevision"]
        warnings = [
            e["message"]
            for e in events(kube, namespace, "shop")
            if e["type"] == "Warning" and e["reason"] == "RolledBack"
        ]
        assert warnings and any(word in warnings[-1] for word in kubelet_says), warnings
        # The stable pods served throughout and still do; the canary's pods are gone.
        stable_pods = kube.wait_for(lambda: ready_pods(kube, namespace, "shop", "stable", 2), 60, "stable pods")
        for pod in stable_pods:
            assert pod["status"]["containerStatuses"][0]["restartCount"] == 0
            assert infer(pod_ip(pod))["model_version"] == stable["stableRevision"]
        kube.wait_for(lambda: not pods(kube, namespace, "shop", "canary"), 60, "no canary pods")
    finally:
        op.stop()
