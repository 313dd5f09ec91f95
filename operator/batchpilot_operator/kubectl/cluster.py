"""The plugin's ground floor: the few API calls it makes, its one-line error, its output.

Every command module builds on this one and nothing here imports a command: a command reads or
annotates through :class:`Cluster`, fails with :class:`PluginError` (one line on stderr, exit
code 1) and prints its data with :func:`emit` (``-o table|json|yaml``).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, cast

import yaml
from rich.console import Console

from batchpilot_operator import ledger
from batchpilot_operator.spec import GROUP, PLURAL, VERSION
from batchpilot_operator.status import LedgerEntry


class PluginError(Exception):
    """A failure to report in one line (exit code 1)."""


class Cluster:
    """The few API calls the plugin makes (kubernetes client, loaded like kubectl would)."""

    def __init__(self, kubeconfig: str | None, context: str | None, namespace: str | None) -> None:
        from kubernetes import client, config

        self._client = client
        path = kubeconfig or os.environ.get("KUBECONFIG", "").split(os.pathsep)[0] or None
        self.user_name: str | None = None
        default_ns = "default"
        try:
            contexts, active = config.list_kube_config_contexts(config_file=path)  # type: ignore[no-untyped-call]
            chosen = next((c for c in contexts if c["name"] == context), None) if context else active
            if chosen is None:
                raise PluginError(f"context {context!r} not found in the kubeconfig")
            default_ns = chosen["context"].get("namespace") or "default"
            self.user_name = chosen["context"].get("user")
            self.api = config.new_client_from_config(config_file=path, context=context)  # type: ignore[no-untyped-call]
        except config.ConfigException:
            if kubeconfig or context:
                raise
            config.load_incluster_config()  # type: ignore[no-untyped-call]
            self.api = client.ApiClient()
        self.namespace = namespace or default_ns
        self.custom = client.CustomObjectsApi(self.api)

    def get(self, name: str) -> dict[str, Any]:
        from kubernetes.client.exceptions import ApiException

        try:
            obj = cast(
                dict[str, Any], self.custom.get_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, name)
            )
        except ApiException as exc:
            if exc.status == 404:
                raise PluginError(f'batchingpolicy "{name}" not found in namespace "{self.namespace}"') from exc
            raise PluginError(f"reading batchingpolicy {self.namespace}/{name}: {exc.status} {exc.reason}") from exc
        return obj

    def ledger_archive(self, name: str) -> tuple[list[LedgerEntry], str | None]:
        """The decisions the policy's ledger ConfigMap keeps, or why it could not be read
        (none yet is no error: a policy whose decisions all fit in status)."""
        from kubernetes.client.exceptions import ApiException

        cm_name = ledger.archive_name(name)
        try:
            cm = self._client.CoreV1Api(self.api).read_namespaced_config_map(cm_name, self.namespace)
        except ApiException as exc:
            if exc.status == 404:
                return [], None
            return [], f"configmap {self.namespace}/{cm_name}: {exc.status} {exc.reason}"
        return ledger.archived({"data": cm.data or {}}), None

    def annotate(self, name: str, annotations: dict[str, str | None]) -> dict[str, Any]:
        from kubernetes.client.exceptions import ApiException

        body = {"metadata": {"annotations": annotations}}
        try:
            obj = cast(
                dict[str, Any],
                self.custom.patch_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, name, body),
            )
        except ApiException as exc:
            raise PluginError(f"annotating batchingpolicy {self.namespace}/{name}: {exc.status} {exc.reason}") from exc
        return obj

    def whoami(self) -> str:
        """The authenticated user name (SelfSubjectReview), else the kubeconfig user."""
        from kubernetes.client.exceptions import ApiException

        try:
            review = self._client.AuthenticationV1Api(self.api).create_self_subject_review(
                body=self._client.V1SelfSubjectReview(api_version="authentication.k8s.io/v1", kind="SelfSubjectReview")
            )
            info = review.status.user_info if review.status is not None else None
            if info is not None and info.username:
                return str(info.username)
        except (ApiException, AttributeError, ValueError):
            pass
        return self.user_name or os.environ.get("USER") or "unknown"


def emit(data: dict[str, Any], output: str, console: Console, view: Any) -> int:
    if output == "json":
        sys.stdout.write(json.dumps(data, indent=2) + "\n")
    elif output == "yaml":
        sys.stdout.write(yaml.safe_dump(data, sort_keys=False))
    else:
        console.print(view(data))
    return 0
