"""The operator's narrow window on the Kubernetes API (the `kubernetes` client, synchronous).

Writes go through server-side apply under the ``batchpilot`` field manager, and only when
the desired manifest differs from what was last applied (each child carries the hash of its
desired manifest), so a resync with nothing changed issues no write at all. The policy's
``spec`` is never written; its ``status`` is replaced only when it changed, guarded by the
resourceVersion the decision was made on.

Every write is reported to an optional :class:`WriteObserver` (the watch-fed caches of
``control.cache``) with the apiserver's answer, so a reconcile that runs before the watch
delivers the write reads what was written, not the older state. Every request is counted in
``batchpilot_operator_api_requests_total`` (by verb), and carries the user agent
``batchpilot-operator/<identity>`` so the apiserver's audit log can tell replicas apart.

Credentials: a bearer token kept in a file (``--token-file``, or the kubeconfig user's
``tokenFile``, as a projected ServiceAccount token is in a pod) is re-read whenever the file
changes, so a rotated token is used without a restart (the client library alone reads it once).
A 401 answer is counted in ``batchpilot_operator_auth_errors_total{target="kubernetes"}``
and logged once (:mod:`batchpilot_operator.credentials`); the request fails as before and is
retried, and the first request after a valid token is back succeeds.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from kubernetes import client, config, dynamic
from kubernetes.client import rest
from kubernetes.client.exceptions import ApiException
from kubernetes.dynamic.exceptions import (
    ConflictError,
    DynamicApiError,
    NotFoundError,
    ResourceNotFoundError,
    UnprocessibleEntityError,
)

from batchpilot_operator import credentials
from batchpilot_operator.children import FIELD_MANAGER, LABEL_POLICY, Manifest, applied_hash
from batchpilot_operator.spec import API_VERSION, KIND

log = logging.getLogger(__name__)


class TransientKubeError(RuntimeError):
    """A write lost a race or the API hiccupped: retry on the next reconcile."""


class StatusRejected(RuntimeError):
    """The API server refused the status itself (not a race): retrying the same write fails the
    same way, so it is surfaced with the server's message."""


class WriteObserver(Protocol):
    def wrote(self, obj: Manifest) -> None: ...

    def deleted(self, api_version: str, kind: str, namespace: str, name: str) -> None: ...


USER_AGENT = "batchpilot-operator"
REQUEST_TIMEOUT = (10.0, 30.0)
"""(connect, read) seconds of every API request that sets none (watches set their own)."""


def api_client(kubeconfig: str | None = None, user_agent: str = USER_AGENT) -> client.ApiClient:
    """A client of the configured cluster (kubeconfig, else in-cluster, else ~/.kube/config)
    whose requests are counted and carry ``user_agent``."""
    if kubeconfig:
        result = config.new_client_from_config(config_file=kubeconfig)
    else:
        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        result = client.ApiClient()
    assert isinstance(result, client.ApiClient)
    token_file = os.environ.get("BATCHPILOT_TOKEN_FILE") or (kubeconfig_token_file(kubeconfig) if kubeconfig else None)
    if token_file:
        use_token_file(result.configuration, credentials.TokenFile(token_file))
    # Reconcile threads (16 by default) and informers share the pool: room for all of them,
    # so no TLS connection is set up per request.
    result.configuration.connection_pool_maxsize = 32
    result.rest_client = rest.RESTClientObject(result.configuration)
    result.user_agent = user_agent
    _count_requests(result)
    return result


def kubeconfig_token_file(kubeconfig: str) -> str | None:
    """The ``tokenFile`` of the current context's user in ``kubeconfig`` (relative paths are
    relative to the kubeconfig, as kubectl reads them), or None."""
    import yaml

    data = yaml.safe_load(Path(kubeconfig).read_text()) or {}
    contexts = {c.get("name"): c.get("context") or {} for c in data.get("contexts") or []}
    user_name = contexts.get(data.get("current-context"), {}).get("user")
    users = {u.get("name"): u.get("user") or {} for u in data.get("users") or []}
    token_file = users.get(user_name, {}).get("tokenFile")
    if not token_file:
        return None
    path = Path(token_file)
    return str(path if path.is_absolute() else Path(kubeconfig).resolve().parent / path)


def use_token_file(configuration: client.Configuration, token: credentials.TokenFile) -> None:
    """Authenticate every request with ``token``'s current content (re-read when it changes)."""

    def refresh(cfg: client.Configuration) -> None:
        cfg.api_key["BearerToken"] = f"Bearer {token.token()}"
        cfg.api_key_prefix.pop("BearerToken", None)

    refresh(configuration)
    configuration.refresh_api_key_hook = refresh  # type: ignore[assignment]  # the stub says None


def _observe_auth(status: object) -> None:
    """401 is a refused credential (a 403 is RBAC, not the token); any other answer accepts it."""
    if status == 401:
        credentials.auth_failed("kubernetes", "HTTP 401 Unauthorized")
    elif isinstance(status, int) and status > 0:
        credentials.auth_ok("kubernetes")


def _count_requests(api: client.ApiClient) -> None:
    from batchpilot_operator import opmetrics

    rest = api.rest_client
    request = rest.request

    def counted(method: str, url: str, *args: Any, **kwargs: Any) -> Any:
        query = kwargs.get("query_params") or []
        watch = any(k == "watch" and str(v).lower() == "true" for k, v in query)
        opmetrics.API_REQUESTS.labels("WATCH" if watch else method.upper()).inc()
        if not watch and not kwargs.get("_request_timeout"):
            # The client's default is no timeout at all: one request that an apiserver going
            # away never answers held its reconcile (and so its policy) for good (drill 2).
            kwargs["_request_timeout"] = REQUEST_TIMEOUT
        try:
            answer = request(method, url, *args, **kwargs)
        except ApiException as exc:  # clients before 35 raised non-2xx answers here
            _observe_auth(exc.status)
            raise
        # Since kubernetes 35 the REST layer returns every answer and ApiClient raises later.
        _observe_auth(getattr(answer, "status", None))
        return answer

    rest.request = counted  # type: ignore[method-assign]


@dataclass
class Kube:
    dyn: dynamic.DynamicClient
    observer: WriteObserver | None = None

    @classmethod
    def connect(cls, kubeconfig: str | None = None, user_agent: str = USER_AGENT) -> Kube:
        return cls(dynamic.DynamicClient(api_client(kubeconfig, user_agent)))

    def resource(self, api_version: str, kind: str) -> Any:
        """The API resource of a kind (discovered once, then cached by the client)."""
        return self._resource(api_version, kind)

    def _resource(self, api_version: str, kind: str) -> Any:
        return self.dyn.resources.get(api_version=api_version, kind=kind)

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> Manifest | None:
        try:
            obj = self._resource(api_version, kind).get(name=name, namespace=namespace)
        except NotFoundError:
            return None
        except ResourceNotFoundError as exc:  # discovery: the kind is not served at all
            raise TransientKubeError(
                f"{kind} ({api_version}) is not served by this cluster: are its CRDs installed? ({exc})"
            ) from exc
        result: Manifest = obj.to_dict()
        return result

    def list_owned(self, api_version: str, kind: str, namespace: str, policy: str) -> list[Manifest]:
        objs = self._resource(api_version, kind).get(namespace=namespace, label_selector=f"{LABEL_POLICY}={policy}")
        return [item.to_dict() for item in objs.items]

    def _server_side_apply(self, resource: Any, body: Manifest) -> Any:
        """Server-side apply ``body`` (in its namespace) as the ``batchpilot`` field manager,
        taking over fields another manager holds; the object as written."""
        return self.dyn.server_side_apply(
            resource,
            body=body,
            namespace=body["metadata"]["namespace"],
            field_manager=FIELD_MANAGER,
            force_conflicts=True,
        )

    def apply(self, manifest: Manifest, current: Manifest | None) -> bool:
        """Server-side apply ``manifest`` unless ``current`` already carries its hash.

        Returns whether a write was issued.
        """
        if current is not None and applied_hash(current) == applied_hash(manifest):
            return False
        resource = self._resource(manifest["apiVersion"], manifest["kind"])
        try:
            written = self._server_side_apply(resource, manifest)
        except UnprocessibleEntityError as exc:
            if manifest["kind"] == "ConfigMap" and manifest.get("immutable") and current is not None:
                # An immutable ConfigMap of the same name: revisions are content hashes, so
                # it already holds this content under an older stamp. Nothing to do.
                return False
            raise exc
        except (ConflictError, ApiException) as exc:
            raise TransientKubeError(f"applying {manifest['kind']} {manifest['metadata']['name']}: {exc}") from exc
        if self.observer is not None:
            self.observer.wrote(written.to_dict())
        return True

    def apply_fields(self, body: Manifest) -> Manifest:
        """Server-side apply a partial object (only the fields the operator owns, e.g. an
        HTTPRoute's rules) under the ``batchpilot`` field manager. A ``metadata.resourceVersion``
        in ``body`` makes it conditional: a concurrent change is a conflict, retried later."""
        resource = self._resource(body["apiVersion"], body["kind"])
        try:
            written = self._server_side_apply(resource, body)
        except (ConflictError, UnprocessibleEntityError, ApiException) as exc:
            raise TransientKubeError(f"applying {body['kind']} {body['metadata']['name']}: {exc}") from exc
        result: Manifest = written.to_dict()
        return result

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> bool:
        try:
            self._resource(api_version, kind).delete(
                name=name, namespace=namespace, body={"propagationPolicy": "Background"}
            )
        except NotFoundError:
            if self.observer is not None:
                self.observer.deleted(api_version, kind, namespace, name)
            return False
        if self.observer is not None:
            self.observer.deleted(api_version, kind, namespace, name)
        return True

    def post_event(self, involved: Manifest, type_: str, reason: str, message: str, instance: str) -> None:
        """Post an Event; a failure is logged, never raised (Events are best effort)."""
        body = event_manifest(involved, type_, reason, message, datetime.now(UTC), instance)
        try:
            self._resource("v1", "Event").create(body=body, namespace=body["metadata"]["namespace"])
        except Exception as exc:  # an Event must never fail a reconcile
            log.warning("could not post Event %s on %s: %s", reason, involved["metadata"]["name"], exc)

    def replace_status(self, namespace: str, name: str, resource_version: str, status: dict[str, Any]) -> Manifest:
        """Replace the policy's whole status, only if the object is still at ``resource_version``."""
        resource = self._resource(API_VERSION, KIND)
        dropped: list[str] = []
        status = finite_json(status, "status", dropped)
        if dropped:
            log.warning(
                "%s/%s: status fields with a number JSON cannot hold (NaN or infinity) left out: %s",
                namespace,
                name,
                ", ".join(dropped),
            )
        patch = [
            {"op": "test", "path": "/metadata/resourceVersion", "value": resource_version},
            {"op": "add", "path": "/status", "value": status},
        ]
        try:
            written = resource.status.patch(
                body=patch, name=name, namespace=namespace, content_type="application/json-patch+json"
            )
        except UnprocessibleEntityError as exc:
            # 422 is both a failed resourceVersion test (a race; the body names no field) and a
            # status the CRD's schema refuses (the body lists each field in details.causes):
            # the latter fails the same way on every retry.
            fields = _invalid_fields(exc.body)
            if fields:
                raise StatusRejected(f"status of {namespace}/{name} rejected (422): {'; '.join(fields)}") from exc
            raise TransientKubeError(f"status of {namespace}/{name} changed underneath: {exc}") from exc
        except ConflictError as exc:
            raise TransientKubeError(f"status of {namespace}/{name} changed underneath: {exc}") from exc
        except ApiException as exc:
            if exc.status is not None and 400 <= exc.status < 500 and exc.status not in _RACES:
                why = exc.summary() if isinstance(exc, DynamicApiError) else exc.reason
                raise StatusRejected(f"status of {namespace}/{name} rejected ({exc.status}): {why}") from exc
            raise TransientKubeError(f"status of {namespace}/{name} not written: {exc}") from exc
        result: Manifest = written.to_dict()
        if self.observer is not None:
            self.observer.wrote(result)
        return result


# A status write answered with one of these lost a race or met a busy server (404/410: the policy
# was deleted since the cache read it, and the watch drops it from the queue; 409 and 422 are
# caught as their own classes above): the next reconcile retries it.
_RACES = (404, 408, 410, 429)


def _invalid_fields(body: Any) -> list[str]:
    """``field: message`` for each cause of a 422 ``Invalid`` Status body (none for a failed
    JSON-patch test, whose body names no field)."""
    if isinstance(body, bytes):
        body = body.decode(errors="replace")
    try:
        status = json.loads(body) if isinstance(body, str) else body
    except ValueError:
        return []
    details = status.get("details") if isinstance(status, dict) else None
    causes = details.get("causes") if isinstance(details, dict) else None
    return [
        f"{c.get('field', '?')}: {c.get('message', c.get('reason', ''))}"
        for c in causes or []
        if isinstance(c, dict) and c.get("field")
    ]


def finite_json(value: Any, path: str, dropped: list[str]) -> Any:
    """``value`` without the numbers JSON cannot hold (NaN, infinity: the API server answers
    400 to the whole write): a dict leaves out such a member, and a list that held one is left
    out whole (never written ragged: a tally's [bad, requests] pair is both or neither). Each
    path left out is appended to ``dropped``; ``_MISSING`` stands for "left out"."""
    if isinstance(value, float) and not math.isfinite(value):
        dropped.append(path)
        return _MISSING
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            v = finite_json(v, f"{path}.{k}", dropped)
            if v is not _MISSING:
                out[k] = v
        return out
    if isinstance(value, list):
        before = len(dropped)
        items = [finite_json(v, f"{path}[{i}]", dropped) for i, v in enumerate(value)]
        if any(v is _MISSING for v in items):
            del dropped[before:]
            dropped.append(path)
            return _MISSING
        return items
    return value


_MISSING: Any = object()


def event_manifest(involved: Manifest, type_: str, reason: str, message: str, now: datetime, instance: str) -> Manifest:
    """A core/v1 Event on ``involved`` (what ``kubectl describe`` and ``get events`` show)."""
    meta = involved["metadata"]
    stamp = now.strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
        "involvedObject": {
            "apiVersion": involved.get("apiVersion", API_VERSION),
            "kind": involved.get("kind", KIND),
            "name": meta["name"],
            "namespace": meta["namespace"],
            "uid": meta.get("uid"),
        },
        "type": type_,
        "reason": reason,
        "message": message[:1024],
        "source": {"component": "batchpilot"},
        "reportingComponent": "batchpilot",
        "reportingInstance": instance,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }


def same_json(a: Any, b: Any) -> bool:
    return json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str)
