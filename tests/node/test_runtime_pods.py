"""The operator's runtime pods run by a real kubelet and containerd, in a namespace that enforces
the restricted Pod Security Standard: admitted, started from the image `make images` built,
Ready only once their readiness probe answers, and serving inference at their pod IPs."""

from __future__ import annotations

import datetime as dt
import json
import subprocess
from pathlib import Path

import pytest

from batchpilot_operator.localdev.realnode import NODE_NAME, RUNTIME_IMAGE, RealNode
from bpnode import infer, pod_ip, pods, ready_pods, real_policy
from bptest import NO_PROMETHEUS, Kube, policy_status, start_operator

pytestmark = [pytest.mark.cluster, pytest.mark.realnode, pytest.mark.slow]


def _time(stamp: str) -> dt.datetime:
    return dt.datetime.fromisoformat(stamp.replace("Z", "+00:00"))


def test_policy_pods_run_on_the_real_node_and_serve(kube: Kube, node: RealNode, namespace: str, tmp_path: Path) -> None:
    op = start_operator(kube, namespace, tmp_path, NO_PROMETHEUS)
    try:
        kube.apply(real_policy(), "-n", namespace)
        stable = kube.wait_for(lambda: ready_pods(kube, namespace, "shop", "stable", 2), 180, "2 ready stable pods")
        status = kube.wait_for(
            lambda: (st := policy_status(kube, namespace, "shop")).get("phase") == "Healthy" and st, 60, "Healthy"
        )
        revision = status["stableRevision"]
        for pod in stable:
            assert pod["spec"]["nodeName"] == NODE_NAME
            (container,) = pod["status"]["containerStatuses"]
            assert container["image"] == RUNTIME_IMAGE and container["imageID"].startswith("sha256:")
            assert container["restartCount"] == 0 and container["ready"]
            # The kubelet's readiness probe, not a fake: Ready came after the container started
            # (the model is loaded and warmed first), and the container runs as the restricted
            # profile wants (non-root; the kubelet would refuse a root image with runAsNonRoot).
            started = _time(container["state"]["running"]["startedAt"])
            ready = next(c for c in pod["status"]["conditions"] if c["type"] == "Ready")
            assert _time(ready["lastTransitionTime"]) >= started
            assert pod["spec"]["securityContext"]["runAsNonRoot"] is True
            answer = infer(pod_ip(pod))
            assert answer["model_version"] == revision
            assert len(answer["outputs"][0]["data"]) == 512
        # The namespace really enforces the restricted profile: a privileged pod is refused.
        refused = kube.apply(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "privileged"},
                "spec": {
                    "containers": [{"name": "c", "image": RUNTIME_IMAGE, "securityContext": {"privileged": True}}]
                },
            },
            "-n",
            namespace,
            check=False,
        )
        assert refused.returncode != 0
        assert 'violates PodSecurity "restricted:latest"' in refused.stderr, refused.stderr
        assert not [p for p in pods(kube, namespace, "shop") if p["metadata"]["name"] == "privileged"]
    finally:
        op.stop()


def test_the_kubelet_is_a_node_not_the_admin(kube: Kube, node: RealNode) -> None:
    # The kubelet's own credentials (a client certificate from the cluster's CA): it is
    # system:node:<name> in system:nodes, the Node authorizer keeps it off what its pods do not
    # need, and NodeRestriction admission keeps it off labels reserved to the cluster.
    kubelet = [kube.kubectl_bin, f"--kubeconfig={node.workdir / 'kubelet.kubeconfig'}"]

    def as_kubelet(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*kubelet, *args], capture_output=True, text=True, timeout=30, check=False)

    whoami = as_kubelet("auth", "whoami", "-o", "json")
    assert whoami.returncode == 0, whoami.stderr
    user = json.loads(whoami.stdout)["status"]["userInfo"]
    assert user["username"] == f"system:node:{NODE_NAME}" and "system:nodes" in user["groups"]
    assert as_kubelet("get", "node", NODE_NAME, "-o", "name").stdout.strip() == f"node/{NODE_NAME}"
    assert as_kubelet("auth", "can-i", "list", "secrets", "--all-namespaces").stdout.strip() == "no"
    assert as_kubelet("auth", "can-i", "delete", "namespaces").stdout.strip() == "no"
    relabel = as_kubelet("label", "node", NODE_NAME, "node-restriction.kubernetes.io/pool=gpu")
    assert relabel.returncode != 0 and "is not allowed to modify labels" in relabel.stderr, relabel.stderr
