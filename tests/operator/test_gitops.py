"""A GitOps sync of an unchanged policy is a no-op against the real API server.

Argo CD with ServerSideApply=true applies each manifest with the field manager
``argocd-controller``. The operator writes only ``.status`` (a subresource) and kopf's
finalizer in ``metadata.finalizers``; on-call commands set annotations under another field
manager. None of that is a field Argo CD's apply owns, so `kubectl diff --server-side` of the
Git manifest shows nothing and re-applying leaves ``metadata.generation`` alone.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from bptest import Kube, OperatorProcess, policy

pytestmark = pytest.mark.cluster

MANAGER = "argocd-controller"
POLICY: dict[str, Any] = policy("gitops")
POLICY["metadata"]["labels"] = {"app.kubernetes.io/instance": "search-policies"}


def sync(kube: Kube, ns: str, path: Path) -> str:
    return kube.kubectl("apply", "--server-side", f"--field-manager={MANAGER}", "-n", ns, "-f", str(path)).stdout


def diff(kube: Kube, ns: str, path: Path) -> tuple[int, str]:
    result = kube.kubectl("diff", "--server-side", f"--field-manager={MANAGER}", "-n", ns, "-f", str(path), check=False)
    assert result.returncode in (0, 1), result.stderr
    return result.returncode, result.stdout


def managers_of_spec(obj: dict[str, Any]) -> set[str]:
    return {
        m["manager"]
        for m in obj["metadata"].get("managedFields", [])
        if "f:spec" in (m.get("fieldsV1") or {}) and m.get("subresource") != "status"
    }


def test_sync_of_an_unchanged_policy_is_a_no_op(
    kube: Kube, namespace: str, operator_without_prometheus: OperatorProcess, tmp_path: Path
) -> None:
    ns = namespace
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(POLICY))
    sync(kube, ns, path)

    def healthy() -> dict[str, Any] | None:
        # Healthy and kopf's finalizer in: both of the operator's writes have landed (they are
        # separate patches, in either order), so the diff below sees everything it will write.
        obj = kube.get("batchingpolicy", "gitops", ns)
        st = (obj or {}).get("status") or {}
        finalizers = (obj or {}).get("metadata", {}).get("finalizers") or []
        return obj if st.get("phase") == "Healthy" and "batchpilot.dev/finalizer" in finalizers else None

    obj = kube.wait_for(healthy, 90, "Healthy, with kopf's finalizer")
    generation = obj["metadata"]["generation"]
    assert obj["status"]["ledger"], "the operator's bookkeeping is in status"
    assert managers_of_spec(obj) == {MANAGER}, "nobody but the GitOps sync writes spec"

    code, out = diff(kube, ns, path)
    assert code == 0, f"a sync of the unchanged file would change:\n{out}"

    # An on-call command (an annotation under another manager) is not drift either.
    kube.kubectl("annotate", "-n", ns, "batchingpolicy", "gitops", "batchpilot.dev/pause=alice@2026-11-30T02:00:00Z")
    kube.wait_for(lambda: (healthy() or {}).get("status", {}).get("paused") is True or None, 30, "paused noted")
    code, out = diff(kube, ns, path)
    assert code == 0, out

    # Re-sync: nothing moves. The annotation survives (the sync does not own it).
    sync(kube, ns, path)
    after = kube.get("batchingpolicy", "gitops", ns)
    assert after is not None
    assert after["metadata"]["generation"] == generation
    assert after["metadata"]["annotations"]["batchpilot.dev/pause"].startswith("alice@")
    assert managers_of_spec(after) == {MANAGER}

    # The check has teeth: a real change in Git is a diff, and a new generation once synced.
    changed = copy.deepcopy(POLICY)
    changed["spec"]["lanes"][0]["maxQueueDelay"] = "3ms"
    path.write_text(yaml.safe_dump(changed))
    code, out = diff(kube, ns, path)
    assert code == 1 and "maxQueueDelay: 3ms" in out
    sync(kube, ns, path)
    assert (kube.get("batchingpolicy", "gitops", ns) or {})["metadata"]["generation"] == generation + 1
