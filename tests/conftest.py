"""Session fixtures shared by every test directory: the real local Kubernetes control plane.

``kube`` starts etcd, kube-apiserver, kube-controller-manager, kube-scheduler and kwok (fake
GPU nodes) once per session and installs the BatchingPolicy CRD. With
``BATCHPILOT_TEST_KUBECONFIG`` set, the same tests run against that cluster instead.
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from bptest import CRD, Kube


@pytest.fixture(scope="session")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kube]:
    external = os.environ.get("BATCHPILOT_TEST_KUBECONFIG")
    if external:
        kube = Kube(Path(external), os.environ.get("KUBECTL", "kubectl"), external=True)
        kube.apply(CRD.read_text())
        kube.wait_established("batchingpolicies.batchpilot.dev")
        yield kube
        return
    from batchpilot_localdev.cluster import LocalCluster

    workdir = tmp_path_factory.mktemp("cluster")
    cluster = LocalCluster.start(workdir, gpu_nodes=2, audit=True)
    sys.stderr.write(f"\n[batchpilot] local control plane started in {cluster.started_in:.1f}s\n")
    try:
        kube = Kube(cluster.kubeconfig, str(cluster.bin_dir / "kubectl"), external=False, audit_log=cluster.audit_log)
        kube.apply(CRD.read_text())
        kube.wait_established("batchingpolicies.batchpilot.dev")
        yield kube
    finally:
        cluster.stop()


@pytest.fixture
def namespace(kube: Kube) -> Iterator[str]:
    """A fresh namespace per test, deleted afterwards (without waiting)."""
    name = f"t-{uuid.uuid4().hex[:8]}"
    kube.kubectl("create", "namespace", name)
    yield name
    kube.kubectl("delete", "namespace", name, "--wait=false", check=False)
