"""Writing a policy's status: a number JSON cannot hold never costs the whole write.

The API server answers 400 to a status with NaN or infinity in it (JSON has neither), so one
such number, say a PromQL division by a quiet window's zero, used to make every write of
that status fail: the operator retried it as a race for as long as the number stayed, and
the rollout's decisions (a promotion among them) waited. Seen in a `make demo` run
(2026-12-06): 400 after 400 for 24 s at the 50% step. Now the number's field is left out
(with a warning naming it), and a write the server refuses for any other reason is
surfaced with the server's message instead of being retried as a race.
"""

from __future__ import annotations

import json
import math

import pytest

from batchpilot_operator.kube import Kube as OperatorKube
from batchpilot_operator.kube import StatusRejected, TransientKubeError, finite_json
from bptest import Kube, policy


def test_finite_json_leaves_out_what_json_cannot_hold() -> None:
    dropped: list[str] = []
    status = {
        "phase": "Progressing",
        "lastAnalysis": {"lanes": [{"lane": "a", "p99Latency": math.nan, "samples": 3.0, "p99LatencySlo": 0.1}]},
        "rollout": {"evidence": {"a/p99/canary": [[1.0, 10.0], [math.inf, 5.0]], "b/p99/canary": [[0.0, 4.0]]}},
        "detectable": -math.inf,
    }
    out = finite_json(status, "status", dropped)
    assert out == {
        "phase": "Progressing",
        "lastAnalysis": {"lanes": [{"lane": "a", "samples": 3.0, "p99LatencySlo": 0.1}]},
        # a tally with a broken sub-window is left out whole, never written ragged
        "rollout": {"evidence": {"b/p99/canary": [[0.0, 4.0]]}},
    }
    assert dropped == [
        "status.lastAnalysis.lanes[0].p99Latency",
        "status.rollout.evidence.a/p99/canary",
        "status.detectable",
    ]
    json.dumps(out, allow_nan=False)  # what the API server accepts
    clean: list[str] = []
    assert finite_json({"a": [1.0, 2], "b": None, "c": "x"}, "s", clean) == {"a": [1.0, 2], "b": None, "c": "x"}
    assert clean == []


@pytest.mark.cluster
def test_a_status_with_nan_is_written_without_it(kube: Kube, namespace: str) -> None:
    kube.apply(policy("nan"), "-n", namespace)
    obj = kube.get("batchingpolicy", "nan", namespace)
    assert obj is not None
    api = OperatorKube.connect(str(kube.kubeconfig))
    written = api.replace_status(
        namespace,
        "nan",
        obj["metadata"]["resourceVersion"],
        {"phase": "Progressing", "message": "m", "observedGeneration": math.nan},
    )
    assert written["status"]["phase"] == "Progressing"
    assert "observedGeneration" not in written["status"]


@pytest.mark.cluster
def test_a_status_write_to_a_deleted_policy_is_a_race_not_a_rejection(kube: Kube, namespace: str) -> None:
    """The cache can hold a policy a moment after its delete: the write's 404 is retried (and the
    next reconcile finds it gone), not surfaced as a ReconcileError Event on a deleted object."""
    kube.apply(policy("gone"), "-n", namespace)
    obj = kube.get("batchingpolicy", "gone", namespace)
    assert obj is not None
    kube.kubectl("delete", "batchingpolicy", "gone", "-n", namespace, "--wait=true")
    api = OperatorKube.connect(str(kube.kubeconfig))
    with pytest.raises(TransientKubeError, match="gone"):
        api.replace_status(namespace, "gone", obj["metadata"]["resourceVersion"], {"phase": "Progressing"})


@pytest.mark.cluster
def test_a_status_the_schema_refuses_is_rejected_with_its_fields_and_a_stale_one_is_a_race(
    kube: Kube, namespace: str
) -> None:
    """Both come back 422: the schema's refusal names its fields (and fails the same way on
    every retry: surfaced, with them), a failed resourceVersion test names none (a race)."""
    kube.apply(policy("p"), "-n", namespace)
    obj = kube.get("batchingpolicy", "p", namespace)
    assert obj is not None
    api = OperatorKube.connect(str(kube.kubeconfig))
    with pytest.raises(StatusRejected, match=r"status\.phase: Unsupported value"):
        api.replace_status(namespace, "p", obj["metadata"]["resourceVersion"], {"phase": "Bogus"})
    with pytest.raises(TransientKubeError, match="changed underneath"):
        api.replace_status(namespace, "p", "1", {"phase": "Progressing"})
