"""Child manifests of a BatchingPolicy, built by pure functions returning plain dicts.

Per policy ``p`` and revision ``r`` (a short hash of the runtime-relevant spec):

- ConfigMap ``p-r``: the revision's runtime config (``config.json``), immutable.
- Deployment ``p-stable`` and, during a rollout, ``p-canary``: runtime pods mounting their
  revision's ConfigMap. The selector is {policy, track} (selectors are immutable, revisions are
  not); the pod template carries the revision label too.
- Service ``p``: selects the pods of both tracks, so with the default routing the canary's
  share of traffic follows its share of ready pods.

Every child is owned by the policy (garbage-collected with it) and carries the labels
``batchpilot.dev/policy``, ``batchpilot.dev/revision`` (not on the Service) and
``batchpilot.dev/track``, which Prometheus relabels into ``policy``/``revision``/``track``.
Pure: no I/O, no Kubernetes client.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

from batchpilot_operator.spec import API_VERSION, KIND, PolicySpec

Manifest = dict[str, Any]
Track = Literal["stable", "canary"]

LABEL_POLICY = "batchpilot.dev/policy"
LABEL_REVISION = "batchpilot.dev/revision"
LABEL_TRACK = "batchpilot.dev/track"
LABEL_ENVIRONMENT = "batchpilot.dev/environment"
"""On a policy (e.g. ``staging``, ``prod``): copied onto its pods, where the PodMonitor turns it
into the ``environment`` target label the canary analysis and the dashboard filter by."""
LABEL_COMPONENT = "app.kubernetes.io/component"
ANNOTATION_APPLIED = "batchpilot.dev/applied-hash"
FIELD_MANAGER = "batchpilot"
RUNTIME_PORT = 8000
CONFIG_DIR = "/etc/batchpilot"
CONFIG_KEY = "config.json"
ENDPOINT_REMOVAL_SECONDS = 5
"""How long a deleted pod keeps serving before its SIGTERM (a preStop sleep): the endpoint
controller marks it terminating at once, but Services route by EndpointSlices that every
kube-proxy, gateway and client watch learns of a moment later, and until then requests still
come. Without the wait they meet a draining server (503) or a closed port."""


def owner_reference(policy_name: str, policy_uid: str) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": policy_name,
        "uid": policy_uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def common_labels(policy: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "batchpilot-runtime",
        "app.kubernetes.io/managed-by": "batchpilot",
        "app.kubernetes.io/instance": policy,
        LABEL_POLICY: policy,
    }


def configmap_name(policy: str, revision: str) -> str:
    return f"{policy}-{revision}"


def deployment_name(policy: str, track: Track) -> str:
    return f"{policy}-{track}"


def _stamp(manifest: Manifest) -> Manifest:
    """Record a hash of the desired manifest, so an unchanged resync can skip the write."""
    digest = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()[:16]
    manifest["metadata"].setdefault("annotations", {})[ANNOTATION_APPLIED] = digest
    return manifest


def applied_hash(obj: Manifest | None) -> str | None:
    if not obj:
        return None
    value = (obj.get("metadata", {}).get("annotations") or {}).get(ANNOTATION_APPLIED)
    return str(value) if value is not None else None


def build_configmap(policy: str, namespace: str, uid: str, spec: PolicySpec, revision: str) -> Manifest:
    config = spec.runtime_config(policy=policy, revision=revision)
    return _stamp(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": configmap_name(policy, revision),
                "namespace": namespace,
                "labels": {**common_labels(policy), LABEL_REVISION: revision, LABEL_COMPONENT: "config"},
                "ownerReferences": [owner_reference(policy, uid)],
            },
            "immutable": True,
            "data": {CONFIG_KEY: config.to_json()},
        }
    )


def build_ledger_configmap(
    policy: str, namespace: str, uid: str, name: str, data: dict[str, str], annotations: dict[str, str]
) -> Manifest:
    """The policy's decision archive (``ledger.py``): no revision label, so no revision's
    ConfigMap clean-up ever takes it."""
    return _stamp(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": name,
                "namespace": namespace,
                "labels": {**common_labels(policy), LABEL_COMPONENT: "ledger"},
                "annotations": dict(annotations),
                "ownerReferences": [owner_reference(policy, uid)],
            },
            "data": data,
        }
    )


DEFAULT_MEMORY = "4Gi"


def _resources(spec: PolicySpec) -> dict[str, Any]:
    """Requests always set (the scheduler and the restricted profile want them): CPU from the
    spec, else the model's thread count, else 2; memory from the spec, else 4Gi, also the limit."""
    memory = spec.resources.memory or DEFAULT_MEMORY
    requests: dict[str, str] = {"cpu": spec.resources.cpu or str(spec.model.threads or 2), "memory": memory}
    limits: dict[str, str] = {"memory": memory}
    if spec.resources.gpus:
        requests["nvidia.com/gpu"] = limits["nvidia.com/gpu"] = str(spec.resources.gpus)
    return {"requests": requests, "limits": limits}


def _tolerations(spec: PolicySpec) -> list[dict[str, Any]]:
    tolerations = [t.model_dump(by_alias=True, exclude_none=True) for t in spec.tolerations]
    if spec.resources.gpus and not any(t.get("key") == "nvidia.com/gpu" for t in tolerations):
        # GPU nodes are commonly tainted nvidia.com/gpu:NoSchedule.
        tolerations.append({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"})
    return tolerations


def build_deployment(
    policy: str,
    namespace: str,
    uid: str,
    spec: PolicySpec,
    track: Track,
    revision: str,
    replicas: int,
    drain_seconds: int = 30,
    environment: str | None = None,
) -> Manifest:
    selector = {LABEL_POLICY: policy, LABEL_TRACK: track}
    pod_labels = {**common_labels(policy), LABEL_TRACK: track, LABEL_REVISION: revision}
    if environment:
        pod_labels[LABEL_ENVIRONMENT] = environment
    probe_common = {"periodSeconds": 5, "timeoutSeconds": 2}
    container: dict[str, Any] = {
        "name": "runtime",
        "image": spec.model.image,
        "imagePullPolicy": "IfNotPresent",
        "args": [
            "--config",
            f"{CONFIG_DIR}/{CONFIG_KEY}",
            "--track",
            track,
            "--host",
            "0.0.0.0",
            "--port",
            str(RUNTIME_PORT),
        ],
        "env": [{"name": "BATCHPILOT_TRACK", "value": track}],
        "ports": [{"name": "http", "containerPort": RUNTIME_PORT, "protocol": "TCP"}],
        "readinessProbe": {"httpGet": {"path": "/v2/health/ready", "port": "http"}, **probe_common},
        "livenessProbe": {
            "httpGet": {"path": "/v2/health/live", "port": "http"},
            "failureThreshold": 6,
            **probe_common,
        },
        "startupProbe": {
            "httpGet": {"path": "/v2/health/live", "port": "http"},
            "failureThreshold": 60,
            **probe_common,
        },
        "lifecycle": {"preStop": {"sleep": {"seconds": ENDPOINT_REMOVAL_SECONDS}}},
        "resources": _resources(spec),
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]},
        },
        "volumeMounts": [
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }
    pod_spec: dict[str, Any] = {
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 65532,
            "runAsGroup": 65532,
            "fsGroup": 65532,
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": ENDPOINT_REMOVAL_SECONDS + drain_seconds + 15,
        "containers": [container],
        "volumes": [
            {"name": "config", "configMap": {"name": configmap_name(policy, revision)}},
            {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}},
        ],
    }
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(spec.node_selector)
    tolerations = _tolerations(spec)
    if tolerations:
        pod_spec["tolerations"] = tolerations
    return _stamp(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {
                "name": deployment_name(policy, track),
                "namespace": namespace,
                "labels": {**common_labels(policy), LABEL_TRACK: track, LABEL_REVISION: revision},
                "ownerReferences": [owner_reference(policy, uid)],
            },
            "spec": {
                "replicas": replicas,
                "revisionHistoryLimit": 2,
                "selector": {"matchLabels": selector},
                "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
                "template": {
                    "metadata": {
                        "labels": pod_labels,
                        "annotations": {
                            "prometheus.io/scrape": "true",
                            "prometheus.io/port": str(RUNTIME_PORT),
                            "prometheus.io/path": "/metrics",
                        },
                    },
                    "spec": pod_spec,
                },
            },
        }
    )


def keep_running_pod_fields(manifest: Manifest, running: Manifest) -> Manifest:
    """``manifest`` (a Deployment built from the current spec) with the spec-derived pod fields
    (image, resources, nodeSelector, tolerations) of the Deployment as it ``running``, restamped.

    The stable Deployment runs the stable revision; while the spec already describes the next
    one (mid-canary, after a rollback), its pod fields belong to the canary. Built from the
    spec, a change of ``resources`` (or image, nodeSelector, tolerations) reached the stable
    pods at once, outside any canary (drill 7 found the stable re-created with the canary's
    two-GPU request, unschedulable)."""
    out: Manifest = json.loads(json.dumps(manifest))
    out["metadata"].get("annotations", {}).pop(ANNOTATION_APPLIED, None)
    if not out["metadata"].get("annotations"):
        out["metadata"].pop("annotations", None)
    pod = out["spec"]["template"]["spec"]
    run_pod = running.get("spec", {}).get("template", {}).get("spec", {})
    run_container = next((c for c in run_pod.get("containers", []) if c.get("name") == "runtime"), None)
    if run_container is not None:
        container = pod["containers"][0]
        container["image"] = run_container.get("image", container["image"])
        container["resources"] = run_container.get("resources") or {}
    for key in ("nodeSelector", "tolerations"):
        if run_pod.get(key):
            pod[key] = run_pod[key]
        else:
            pod.pop(key, None)
    return _stamp(out)


def build_service(policy: str, namespace: str, uid: str) -> Manifest:
    return _stamp(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {
                "name": policy,
                "namespace": namespace,
                "labels": {**common_labels(policy), LABEL_COMPONENT: "inference"},
                "ownerReferences": [owner_reference(policy, uid)],
            },
            "spec": {
                "type": "ClusterIP",
                # Both tracks: the canary's share follows its share of ready pods.
                "selector": {LABEL_POLICY: policy},
                "ports": [{"name": "http", "port": 80, "targetPort": "http", "protocol": "TCP"}],
            },
        }
    )


# --------------------------------------------------------------------------- pods in trouble
# issue 11 (drills): why a track's pods are not ready, in words, for the CanaryNotReady
# rollback's evidence and the Degraded condition. Only real trouble counts (a pod that is
# merely starting says nothing), so a routine scale-up raises no Warning.

TROUBLE_WAITING_REASONS = frozenset(
    {
        "CrashLoopBackOff",
        "ImagePullBackOff",
        "ErrImagePull",
        "InvalidImageName",
        "CreateContainerConfigError",
        "CreateContainerError",
        "RunContainerError",
    }
)
TROUBLE_LIMIT = 3
"""Pods named in a summary; the rest are counted."""


def _pod_problem(pod: Manifest, lost_nodes: frozenset[str]) -> str | None:
    status = pod.get("status") or {}
    conditions = {c.get("type"): c for c in status.get("conditions") or []}
    scheduled = conditions.get("PodScheduled")
    if scheduled is not None and scheduled.get("status") == "False":
        reason = scheduled.get("reason") or "NotScheduled"
        return f"{reason}: {scheduled.get('message', '')}".strip().rstrip(":")
    for cs in status.get("containerStatuses") or []:
        state = cs.get("state") or {}
        waiting = state.get("waiting") or {}
        restarts = cs.get("restartCount", 0)
        # Why the container last died (issue 23: the kubelet says OOMKilled, or Error with an exit
        # code); a crash loop's waiting message does not say it.
        last = (cs.get("lastState") or {}).get("terminated") or {}
        died = f", last terminated {last.get('reason') or 'Error'} (exit code {last.get('exitCode')})" if last else ""
        if waiting.get("reason") in TROUBLE_WAITING_REASONS:
            detail = waiting.get("message") or ""
            text = f"{waiting['reason']} (container {cs.get('name')}, {restarts} restarts{died})"
            return f"{text}: {detail}" if detail else text
        if last.get("reason") == "OOMKilled" and not cs.get("ready"):
            # Restarted after an OOM kill and not ready (yet): the kill is the news.
            return f"OOMKilled (container {cs.get('name')}, {restarts} restarts, exit code {last.get('exitCode')})"
    node = (pod.get("spec") or {}).get("nodeName")
    if node and node in lost_nodes:
        return f"node {node} is not Ready"
    ready = conditions.get("Ready")
    containers = conditions.get("ContainersReady")
    # The node lifecycle controller marks the pods of a node that stopped reporting NotReady
    # and leaves their containers' own state alone (no kubelet to ask).
    marked = ready is not None and ready.get("status") == "False"
    by_node = marked and ready is not None and ready.get("reason") == "NodeNotReady"
    containers_ok = containers is not None and containers.get("status") == "True"
    if node and marked and (by_node or containers_ok):
        return f"node {node} is not Ready"
    return None


def pod_trouble(pods: list[Manifest], lost_nodes: frozenset[str] = frozenset()) -> str:
    """One line on the pods that are in trouble (``""`` when none is): unschedulable (with the
    scheduler's message), a container crash-looping or failing to pull, or on a node that
    is not Ready (``lost_nodes``). Terminating pods are skipped."""
    problems: list[str] = []
    for pod in sorted(pods, key=lambda p: p["metadata"]["name"]):
        if pod["metadata"].get("deletionTimestamp"):
            continue
        problem = _pod_problem(pod, lost_nodes)
        if problem:
            problems.append(f"pod {pod['metadata']['name']}: {problem}")
    if len(problems) > TROUBLE_LIMIT:
        problems = [*problems[:TROUBLE_LIMIT], f"and {len(problems) - TROUBLE_LIMIT} more"]
    return "; ".join(problems)


def build_track_service(policy: str, namespace: str, uid: str, track: Track) -> Manifest:
    """``<policy>-<track>``: one track's pods, the backend a Gateway API route weighs
    (``spec.rollout.trafficRouting``; see ``traffic``)."""
    return _stamp(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {
                "name": f"{policy}-{track}",
                "namespace": namespace,
                "labels": {**common_labels(policy), LABEL_COMPONENT: "inference", LABEL_TRACK: track},
                "ownerReferences": [owner_reference(policy, uid)],
            },
            "spec": {
                "type": "ClusterIP",
                "selector": {LABEL_POLICY: policy, LABEL_TRACK: track},
                "ports": [{"name": "http", "port": TRACK_SERVICE_PORT, "targetPort": "http", "protocol": "TCP"}],
            },
        }
    )


TRACK_SERVICE_PORT = 80


def service_port(service: Manifest | None) -> int | None:
    """The first port of a Service (what a route's backendRef to it names)."""
    ports = ((service or {}).get("spec") or {}).get("ports") or []
    return int(ports[0]["port"]) if ports else None


def owned_by_policy(obj: Manifest | None, policy: str) -> bool:
    refs = ((obj or {}).get("metadata") or {}).get("ownerReferences") or []
    return any(r.get("kind") == KIND and r.get("name") == policy for r in refs)
