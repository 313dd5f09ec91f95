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

NEEDS_BY_FIXTURE = {
    "kube": "cluster",
    "namespace": "cluster",
    "real_node": "realnode",
    "prometheus_factory": "prometheus",
}
"""The fixtures that start something outside the test process, and the marker a test that uses
one (directly or through another fixture) needs: added here, so that no test has to say it."""
NEEDS = ("cluster", "prometheus", "realnode", "images", "runtime_server", "slow", "long_drill")
"""The markers of tests that need more than this process (`make check` leaves them out)."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test by what it needs: the markers of the fixtures it uses, then ``unit`` on
    those that need nothing of :data:`NEEDS` (`make check` runs ``pytest -m unit``). The
    fixture closure is pytest's own (a fixture's fixtures count), so a new test that takes
    ``kube`` or ``prometheus`` is classified without a marker of its own."""
    for item in items:
        used = set(getattr(item, "fixturenames", ()))
        for fixture, marker in NEEDS_BY_FIXTURE.items():
            if fixture in used and item.get_closest_marker(marker) is None:
                item.add_marker(marker)
        if not any(item.get_closest_marker(marker) for marker in NEEDS):
            item.add_marker("unit")


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
