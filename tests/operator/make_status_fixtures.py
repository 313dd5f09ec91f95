"""Capture BatchingPolicy objects from real operator runs as Argo CD health-check fixtures.

    .venv/bin/python tests/operator/make_status_fixtures.py [--out tests/operator/fixtures/status]

Starts the local control plane (or uses ``BATCHPILOT_TEST_KUBECONFIG``), runs ``batchpilot
run`` against it without Prometheus, and walks one policy through Healthy, a canary that
holds (analysis Error -> Stalled/MetricsUnavailable), Paused (pause annotation), and
RolledBack (abort annotation); a second policy whose pods cannot be scheduled stays Pending.
Each capture is the object's metadata (name, generation, annotations) and status, written as
``<case>.json`` with the Argo CD verdict it must get (``expect``). test_argocd_health.py runs
the Lua health script over them.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from bptest import CRD, Kube, OperatorProcess, policy, start_operator  # noqa: E402

POLICY: dict[str, Any] = policy("embedder")

EXPECT = {
    "pending": "Progressing",
    "healthy": "Healthy",
    "canary-stalled": "Progressing",
    "paused": "Suspended",
    "rolled-back": "Degraded",
}


def with_window(policy: dict[str, Any], window: str) -> dict[str, Any]:
    out = copy.deepcopy(policy)
    out["spec"]["lanes"][0]["maxQueueDelay"] = window
    return out


def trim(obj: dict[str, Any]) -> dict[str, Any]:
    meta = obj["metadata"]
    return {
        "apiVersion": obj["apiVersion"],
        "kind": obj["kind"],
        "metadata": {
            "name": meta["name"],
            "generation": meta["generation"],
            "annotations": {
                k: v for k, v in (meta.get("annotations") or {}).items() if k.startswith("batchpilot.dev/")
            },
        },
        "status": obj.get("status") or {},
    }


def capture(kube: Kube, namespace: str, log_dir: Path) -> dict[str, dict[str, Any]]:
    """Run the operator and return {case: trimmed object} (see the module docstring)."""
    op: OperatorProcess = start_operator(kube, namespace, log_dir, prometheus_url="http://127.0.0.1:9")
    out: dict[str, dict[str, Any]] = {}

    def wait(name: str, pred: Callable[[dict[str, Any]], bool], what: str) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            obj = kube.get("batchingpolicy", name, namespace)
            return obj if obj and pred(obj.get("status") or {}) and _current(obj) else None

        try:
            result: dict[str, Any] = kube.wait_for(check, 90, what)
        except AssertionError as exc:
            raise AssertionError(f"{exc}\noperator log:\n{op.log()[-3000:]}") from exc
        return result

    try:
        stuck = copy.deepcopy(POLICY)
        stuck["metadata"]["name"] = "unschedulable"
        stuck["spec"]["nodeSelector"] = {"batchpilot.dev/no-such-node": "true"}
        kube.apply(stuck, "-n", namespace)
        out["pending"] = trim(wait("unschedulable", lambda s: s.get("phase") == "Pending", "Pending"))

        kube.apply(POLICY, "-n", namespace)
        out["healthy"] = trim(wait("embedder", lambda s: s.get("phase") == "Healthy", "Healthy"))

        kube.apply(with_window(POLICY, "3ms"), "-n", namespace)
        out["canary-stalled"] = trim(
            wait(
                "embedder",
                lambda s: (
                    bool(s.get("canaryRevision"))
                    and any(c["type"] == "Stalled" and c["status"] == "True" for c in s.get("conditions", []))
                ),
                "a canary Stalled on MetricsUnavailable",
            )
        )
        kube.kubectl("annotate", "-n", namespace, "batchingpolicy", "embedder", "batchpilot.dev/pause=true")
        out["paused"] = trim(wait("embedder", lambda s: s.get("phase") == "Paused", "Paused"))
        kube.kubectl("annotate", "-n", namespace, "batchingpolicy", "embedder", "batchpilot.dev/pause-")
        wait("embedder", lambda s: s.get("phase") == "Progressing", "Progressing again")
        kube.kubectl(
            "annotate", "-n", namespace, "batchingpolicy", "embedder",
            "batchpilot.dev/abort=fixture@2026-11-30T02:00:00Z",
        )  # fmt: skip
        out["rolled-back"] = trim(wait("embedder", lambda s: s.get("phase") == "RolledBack", "RolledBack"))
    finally:
        op.stop()
    return out


def _current(obj: dict[str, Any]) -> bool:
    return bool((obj.get("status") or {}).get("observedGeneration") == obj["metadata"]["generation"])


def write(cases: dict[str, dict[str, Any]], out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    for case, obj in cases.items():
        doc = {"expect": EXPECT[case], "object": obj}
        (out_dir / f"{case}.json").write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")


def main() -> int:
    import os

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE / "fixtures" / "status")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        external = os.environ.get("BATCHPILOT_TEST_KUBECONFIG")
        cluster = None
        if external:
            kube = Kube(Path(external), os.environ.get("KUBECTL", "kubectl"), external=True)
        else:
            from batchpilot_localdev.cluster import LocalCluster

            cluster = LocalCluster.start(work / "cluster", gpu_nodes=1)
            kube = Kube(cluster.kubeconfig, str(cluster.bin_dir / "kubectl"), external=False)
        try:
            kube.apply(CRD.read_text())
            kube.wait_established("batchingpolicies.batchpilot.dev")
            kube.kubectl("create", "namespace", "fixtures", check=False)
            cases = capture(kube, "fixtures", work)
        finally:
            if cluster is not None:
                cluster.stop()
    write(cases, args.out)
    print(f"wrote {len(cases)} fixtures to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
