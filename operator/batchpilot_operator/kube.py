"""The operator's narrow window on the Kubernetes API (the `kubernetes` client, synchronous).

Writes go through server-side apply under the ``batchpilot`` field manager, and only when
the desired manifest differs from what was last applied (each child carries the hash of its
desired manifest), so a resync with nothing changed issues no write at all. The policy's
``spec`` is never written; its ``status`` is replaced only when it changed, guarded by the
resourceVersion the decision was made on.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

from kubernetes import client, config, dynamic
from kubernetes.client.exceptions import ApiException
from kubernetes.dynamic.exceptions import ConflictError, NotFoundError, UnprocessibleEntityError

from batchpilot_operator.children import FIELD_MANAGER, LABEL_POLICY, Manifest, applied_hash
from batchpilot_operator.spec import API_VERSION, KIND

log = logging.getLogger(__name__)


class TransientKubeError(RuntimeError):
    """A write lost a race or the API hiccupped: retry on the next reconcile."""


@dataclass
class Kube:
    dyn: dynamic.DynamicClient

    @classmethod
    def connect(cls, kubeconfig: str | None = None) -> Kube:
        if kubeconfig:
            api_client = config.new_client_from_config(config_file=kubeconfig)
        else:
            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            api_client = client.ApiClient()
        return cls(dynamic.DynamicClient(api_client))

    def _resource(self, api_version: str, kind: str) -> Any:
        return self.dyn.resources.get(api_version=api_version, kind=kind)

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> Manifest | None:
        try:
            obj = self._resource(api_version, kind).get(name=name, namespace=namespace)
        except NotFoundError:
            return None
        result: Manifest = obj.to_dict()
        return result

    def list_owned(self, api_version: str, kind: str, namespace: str, policy: str) -> list[Manifest]:
        objs = self._resource(api_version, kind).get(namespace=namespace, label_selector=f"{LABEL_POLICY}={policy}")
        return [item.to_dict() for item in objs.items]

    def apply(self, manifest: Manifest, current: Manifest | None) -> bool:
        """Server-side apply ``manifest`` unless ``current`` already carries its hash.

        Returns whether a write was issued.
        """
        if current is not None and applied_hash(current) == applied_hash(manifest):
            return False
        resource = self._resource(manifest["apiVersion"], manifest["kind"])
        try:
            self.dyn.server_side_apply(
                resource,
                body=manifest,
                namespace=manifest["metadata"]["namespace"],
                field_manager=FIELD_MANAGER,
                force_conflicts=True,
            )
        except UnprocessibleEntityError as exc:
            if manifest["kind"] == "ConfigMap" and current is not None:
                # An immutable ConfigMap of the same name: revisions are content hashes, so
                # it already holds this content under an older stamp. Nothing to do.
                return False
            raise exc
        except (ConflictError, ApiException) as exc:
            raise TransientKubeError(f"applying {manifest['kind']} {manifest['metadata']['name']}: {exc}") from exc
        return True

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> bool:
        try:
            self._resource(api_version, kind).delete(
                name=name, namespace=namespace, body={"propagationPolicy": "Background"}
            )
        except NotFoundError:
            return False
        return True

    def replace_status(self, namespace: str, name: str, resource_version: str, status: dict[str, Any]) -> None:
        """Replace the policy's whole status, only if the object is still at ``resource_version``."""
        resource = self._resource(API_VERSION, KIND)
        patch = [
            {"op": "test", "path": "/metadata/resourceVersion", "value": resource_version},
            {"op": "add", "path": "/status", "value": status},
        ]
        try:
            resource.status.patch(
                body=patch, name=name, namespace=namespace, content_type="application/json-patch+json"
            )
        except (ConflictError, UnprocessibleEntityError, ApiException) as exc:
            raise TransientKubeError(f"status of {namespace}/{name} changed underneath: {exc}") from exc


def same_json(a: Any, b: Any) -> bool:
    return json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str)
