"""The real node: the tests of this folder run their pods on a kubelet with containerd.

``kube`` is overridden here: a control plane of its own with no kwok node at all, and beside it
the real node of ``batchpilot_localdev/realnode.py`` (its only node, ``bp-node-0``, with 4
``nvidia.com/gpu``), so that every pod of these tests is run by a real kubelet from the image
``make images`` built. One per test module (~12 s with the images cached), so that a module can
also start a node of its own (``batchpilot up --real-node``): a machine holds one at a time. Needs root (network namespaces, a bridge, cgroups): a machine where it
cannot start fails these tests with the reason, it never skips them.
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator

import pytest

from batchpilot_localdev.cluster import LocalCluster
from batchpilot_localdev.realnode import RealNode
from bptest import CRD, Kube

SERVICE_CIDR = "198.19.0.0/16"
"""The project's own range (198.18.0.0/15): pods on 198.18.0.0/24, Service IPs here."""


@pytest.fixture(scope="module")
def real_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalCluster, RealNode]]:
    if os.geteuid() != 0:
        pytest.fail("the real node needs root: a bridge, network namespaces and cgroups")
    workdir = tmp_path_factory.mktemp("realnode")
    cluster = LocalCluster.start(workdir / "cluster", gpu_nodes=0, service_cidr=SERVICE_CIDR)
    try:
        node = RealNode.start(cluster.kubeconfig, cluster.workdir / "pki" / "ca.crt", workdir / "node")
        imported = ", ".join(f"{image} {s:.0f}s" for image, s in node.imported.items()) or "none, all cached"
        sys.stderr.write(
            f"\n[batchpilot] control plane started in {cluster.started_in:.1f}s, real node "
            f"{node.name} in {node.started_in:.1f}s (images imported: {imported})\n"
        )
        try:
            yield cluster, node
        finally:
            problems = node.stop()
            if problems:  # an error of the module's last test: the machine was left dirty
                pytest.fail(f"real node clean-up left: {problems}")
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def kube(real_node: tuple[LocalCluster, RealNode]) -> Kube:
    cluster, _ = real_node
    kube = Kube(cluster.kubeconfig, str(cluster.bin_dir / "kubectl"), external=False)
    kube.apply(CRD.read_text())
    kube.wait_established("batchingpolicies.batchpilot.dev")
    return kube


@pytest.fixture
def node(real_node: tuple[LocalCluster, RealNode]) -> RealNode:
    return real_node[1]


@pytest.fixture
def namespace(kube: Kube) -> Iterator[str]:
    """A fresh namespace that enforces the restricted Pod Security Standard, deleted afterwards."""
    name = f"t-{uuid.uuid4().hex[:8]}"
    kube.kubectl("create", "namespace", name)
    kube.kubectl(
        "label",
        "namespace",
        name,
        "pod-security.kubernetes.io/enforce=restricted",
        "pod-security.kubernetes.io/enforce-version=latest",
    )
    yield name
    kube.kubectl("delete", "namespace", name, "--wait=false", check=False)
