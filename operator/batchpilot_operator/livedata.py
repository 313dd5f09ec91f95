"""Fetch the runtimes' arrival captures and latency profiles through the apiserver's pod proxy.

Used by ``kubectl batchpilot recommend`` and by the operator's recommender. For each ready pod
of the policy (label ``batchpilot.dev/policy=<name>``, phase Running, condition Ready) it GETs

    /api/v1/namespaces/<ns>/pods/<pod>:<port>/proxy/admin/arrivals?since=<seconds>
    /api/v1/namespaces/<ns>/pods/<pod>:<port>/proxy/admin/profile

where ``<port>`` is the pod's first container port (the runtime's). No direct connection to a
pod: the apiserver proxies (so it works from a laptop, and the pods need no exposure).

RBAC needed (namespaced, or cluster-wide for every namespace):

* ``batchpilot.dev`` ``batchingpolicies``: ``get``
* core ``pods``: ``list``
* core ``pods/proxy``: ``get``
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from batchpilot_operator.children import LABEL_POLICY

RBAC_RULES: list[dict[str, Any]] = [
    {"apiGroups": ["batchpilot.dev"], "resources": ["batchingpolicies"], "verbs": ["get"]},
    {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},
    {"apiGroups": [""], "resources": ["pods/proxy"], "verbs": ["get"]},
]


@dataclass
class Gathered:
    arrivals: list[dict[str, Any]] = field(default_factory=list)
    profiles: list[dict[str, Any]] = field(default_factory=list)
    pods: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # per pod, human-readable


def _ready(pod: Any) -> bool:
    if pod.metadata.deletion_timestamp is not None or (pod.status.phase or "") != "Running":
        return False
    return any(c.type == "Ready" and c.status == "True" for c in (pod.status.conditions or []))


def _port(pod: Any) -> int | None:
    for container in pod.spec.containers or []:
        for port in container.ports or []:
            return int(port.container_port)
    return None


def proxy_get(
    api_client: Any, namespace: str, pod: str, port: int, path: str, query: dict[str, str], timeout: float
) -> Any:
    """GET ``path`` on ``pod:port`` through the apiserver's pod proxy; the decoded JSON body."""
    from kubernetes.client.exceptions import ApiException

    try:
        method, url, headers, body, post = api_client.param_serialize(
            "GET",
            f"/api/v1/namespaces/{namespace}/pods/{pod}:{port}/proxy/{path.lstrip('/')}",
            query_params=list(query.items()),
            header_params={"Accept": "application/json"},
            auth_settings=["BearerToken"],
        )
        resp = api_client.call_api(
            method, url, header_params=headers, body=body, post_params=post, _request_timeout=timeout
        )
        resp.read()
    except ApiException as exc:
        raise OSError(f"{exc.status} {exc.reason}") from exc
    if resp.status != 200:
        detail = bytes(resp.data or b"")[:300].decode(errors="replace").strip()
        raise OSError(f"{resp.status} {resp.reason}: {detail}")
    return json.loads(resp.data)


def gather(api_client: Any, namespace: str, policy: str, since: float | None = None, timeout: float = 10.0) -> Gathered:
    """Arrivals and profiles of every ready pod of ``policy`` (pods that fail are listed in errors)."""
    from kubernetes import client

    core = client.CoreV1Api(api_client)
    pods: list[Any] = core.list_namespaced_pod(namespace, label_selector=f"{LABEL_POLICY}={policy}").items
    out = Gathered()
    query = {"since": f"{since:g}s"} if since is not None else {}
    for pod in sorted(pods, key=lambda p: str(p.metadata.name)):
        if not _ready(pod):
            continue
        name = str(pod.metadata.name)
        port = _port(pod)
        if port is None:
            out.errors.append(f"pod {name}: no container port")
            continue
        try:
            arrivals = proxy_get(api_client, namespace, name, port, "admin/arrivals", query, timeout)
            profile = proxy_get(api_client, namespace, name, port, "admin/profile", {}, timeout)
        except (OSError, ValueError) as exc:
            out.errors.append(f"pod {name}: {exc}")
            continue
        arrivals["pod"] = name  # the apiserver's name for it wins over what the process thinks
        out.arrivals.append(arrivals)
        out.profiles.append(profile)
        out.pods.append(name)
    return out
