"""Helpers of the real-node tests in tests/node (imported as `bpnode`; tests/ is on pythonpath)."""

from __future__ import annotations

import copy
import ipaddress
import json
import urllib.request
from typing import Any

from batchpilot_localdev.nodehost import POD_SUBNET
from batchpilot_localdev.nodeimages import RUNTIME_IMAGE
from batchpilot_operator.children import LABEL_POLICY, LABEL_TRACK, RUNTIME_PORT
from bptest import TINY_CANARY_POLICY, Kube

ROW = [0.5] * 512


def real_policy(name: str = "shop", **spec: Any) -> dict[str, Any]:
    """The canary end-to-end policy (``bptest.TINY_CANARY_POLICY``) on the real node: the runtime
    image of ``make images``, one GPU (the node's extended resource), 100m CPU (the node has 2
    cores for every pod of a test) and 1Gi memory, the limit too. ``spec`` replaces whole fields."""
    body = copy.deepcopy(TINY_CANARY_POLICY)
    body["metadata"]["name"] = name
    body["spec"]["model"]["image"] = RUNTIME_IMAGE
    body["spec"]["resources"] = {"gpus": 1, "cpu": "100m", "memory": "1Gi"}
    body["spec"].update(copy.deepcopy(spec))
    return body


def pods(kube: Kube, namespace: str, policy: str, track: str | None = None) -> list[dict[str, Any]]:
    selector = f"{LABEL_POLICY}={policy}" + (f",{LABEL_TRACK}={track}" if track else "")
    out = kube.kubectl("get", "pods", "-n", namespace, "-l", selector, "-o", "json").stdout
    items: list[dict[str, Any]] = json.loads(out)["items"]
    return items


def is_ready(pod: dict[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)


def ready_pods(kube: Kube, namespace: str, policy: str, track: str, count: int) -> list[dict[str, Any]] | None:
    """The track's pods when exactly ``count`` of them are ready and none is terminating."""
    found = [p for p in pods(kube, namespace, policy, track) if not p["metadata"].get("deletionTimestamp")]
    return found if len(found) == count and all(is_ready(p) for p in found) else None


def pod_ip(pod: dict[str, Any]) -> str:
    ip: str = pod["status"]["podIP"]
    assert ipaddress.ip_address(ip) in ipaddress.ip_network(POD_SUBNET), ip
    return ip


def infer(ip: str, model: str = "tiny", timeout: float = 10.0) -> dict[str, Any]:
    """One Open Inference Protocol request to a pod, at its address on the node's bridge."""
    body = json.dumps({"inputs": [{"name": "input", "shape": [1, 512], "datatype": "FP32", "data": ROW}]}).encode()
    req = urllib.request.Request(
        f"http://{ip}:{RUNTIME_PORT}/v2/models/{model}/infer", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        assert resp.status == 200
        answer: dict[str, Any] = json.loads(resp.read())
        return answer


def events(kube: Kube, namespace: str, involved: str) -> list[dict[str, Any]]:
    out = kube.kubectl(
        "get", "events", "-n", namespace, "--field-selector", f"involvedObject.name={involved}", "-o", "json"
    ).stdout
    items: list[dict[str, Any]] = json.loads(out)["items"]
    return items
