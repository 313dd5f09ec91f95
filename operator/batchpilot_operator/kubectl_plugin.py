"""`kubectl batchpilot`: on-call commands for BatchingPolicy rollouts (a kubectl plugin).

Installed as the console script ``kubectl-batchpilot``, so ``kubectl batchpilot ...`` finds it::

    kubectl batchpilot list [-A]        every policy: phase, stable, canary, weight/step, last
                                        analysis, age (-A: all namespaces)
    kubectl batchpilot status NAME      the rollout at a glance: revisions, step, weight, per-lane
                                        p99 and queue age against the SLO, last decisions, why
                                        (-w: redraw on every change until Ctrl-C)
    kubectl batchpilot history NAME     revisions with outcome and evidence, every rollout decision
                                        (status's and the older ones of the ledger ConfigMap)
    kubectl batchpilot promote NAME     promote the canary now (skip the remaining steps)
    kubectl batchpilot abort NAME       roll the canary back now
    kubectl batchpilot pause NAME       hold the rollout (the step clock stops, no analysis)
    kubectl batchpilot resume NAME      continue a paused rollout
    kubectl batchpilot retry NAME       canary a rolled-back revision again
    kubectl batchpilot recommend NAME   batching settings from the pods' own traffic (a patch for Git)

Commands never edit the spec (Git stays the source of truth): they set annotations the
operator watches (``batchpilot.dev/{promote,abort,retry,pause}``) to ``<user>@<RFC 3339
time>``; the operator acts once per distinct value and leaves an Event and a ledger entry
carrying it. ``resume`` removes the pause annotation and records who in
``batchpilot.dev/resume`` (the operator credits it in the Resumed entry). The user is who the
API server says you are (SelfSubjectReview, as ``kubectl auth whoami``), else the kubeconfig's
user name.

Global flags: -n/--namespace, --kubeconfig, --context, -o table|json|yaml.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import UTC, datetime
from typing import Any, cast

import yaml
from rich.console import Console

from batchpilot_operator import kubectl_recommend as recommend
from batchpilot_operator import kubectl_views, ledger
from batchpilot_operator.oncall import render
from batchpilot_operator.rollout import (
    ABORT_ANNOTATION,
    PAUSE_ANNOTATION,
    PROMOTE_ANNOTATION,
    RESUME_ANNOTATION,
    RETRY_ANNOTATION,
)
from batchpilot_operator.spec import GROUP, PLURAL, VERSION
from batchpilot_operator.status import LedgerEntry

COMMAND_ANNOTATIONS = {"promote": PROMOTE_ANNOTATION, "abort": ABORT_ANNOTATION, "retry": RETRY_ANNOTATION}


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


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# --------------------------------------------------------------------------- commands


def cmd_status(cluster: Cluster, args: argparse.Namespace, console: Console) -> int:
    data = render.summary(cluster.get(args.name), decisions=args.decisions)
    return emit(data, args.output, console, render.status_view)


def cmd_history(cluster: Cluster, args: argparse.Namespace, console: Console) -> int:
    obj = cluster.get(args.name)
    archive, error = cluster.ledger_archive(args.name)
    data = render.history(obj, archive, error)
    return emit(data, args.output, console, render.history_view)


def cmd_command(cluster: Cluster, args: argparse.Namespace, console: Console) -> int:
    """promote / abort / retry / pause / resume."""
    verb: str = args.command
    obj = cluster.get(args.name)
    status = obj.get("status") or {}
    user = cluster.whoami()
    value = f"{user}@{now_rfc3339()}"
    if verb in COMMAND_ANNOTATIONS:
        if verb in ("promote", "abort") and not status.get("rollout"):
            console.print(
                f"[yellow]warning:[/] no canary in flight ({status.get('phase')}); the operator will ignore {verb}"
            )
        if verb == "retry" and status.get("phase") != "RolledBack":
            console.print(
                f"[yellow]warning:[/] phase is {status.get('phase')}, not RolledBack; the operator will ignore retry"
            )
        cluster.annotate(args.name, {COMMAND_ANNOTATIONS[verb]: value})
        handled_key, expected = verb, value
    elif verb == "pause":
        cluster.annotate(args.name, {PAUSE_ANNOTATION: value})
        handled_key, expected = "pause", value
    else:  # resume
        if PAUSE_ANNOTATION not in ((obj.get("metadata") or {}).get("annotations") or {}):
            console.print("[yellow]warning:[/] the policy is not paused")
        cluster.annotate(args.name, {PAUSE_ANNOTATION: None, RESUME_ANNOTATION: value})
        handled_key, expected = "pause", ""
    result: dict[str, Any] = {"command": verb, "policy": args.name, "namespace": cluster.namespace, "by": value}
    if args.wait > 0:
        obj = wait_handled(cluster, args.name, handled_key, expected, args.wait)
        st = obj.get("status") or {}
        result |= {"handled": True, "phase": st.get("phase"), "message": st.get("message")}
    if args.output == "table":
        console.print(f"{verb} requested for {cluster.namespace}/{args.name} by {value}")
        if "phase" in result:
            console.print(f"phase {result['phase']}: {result['message']}")
        return 0
    return emit(result, args.output, console, None)


def wait_handled(cluster: Cluster, name: str, key: str, expected: str, timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        obj = cluster.get(name)
        handled = ((obj.get("status") or {}).get("handledCommands") or {}).get(key, "")
        if handled == expected:
            return obj
        if time.monotonic() >= deadline:
            raise PluginError(f"the operator has not handled the command within {timeout:g}s (is it running?)")
        time.sleep(0.5)


def emit(data: dict[str, Any], output: str, console: Console, view: Any) -> int:
    if output == "json":
        sys.stdout.write(json.dumps(data, indent=2) + "\n")
    elif output == "yaml":
        sys.stdout.write(yaml.safe_dump(data, sort_keys=False))
    else:
        console.print(view(data))
    return 0


# --------------------------------------------------------------------------- parsing


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-n", "--namespace", default=argparse.SUPPRESS, help="namespace (default: the context's)")
    common.add_argument("--kubeconfig", default=argparse.SUPPRESS, help="kubeconfig file")
    common.add_argument("--context", default=argparse.SUPPRESS, help="kubeconfig context")
    common.add_argument("-o", "--output", choices=["table", "json", "yaml"], default=argparse.SUPPRESS)
    parser = argparse.ArgumentParser(
        prog="kubectl batchpilot",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        parents=[common],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n\n".join(__doc__.split("\n\n")[1:]) if __doc__ else None,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("list", parents=[common], help="every policy with phase, revisions, weight/step, last analysis")
    p.add_argument("-A", "--all-namespaces", action="store_true", help="list policies in every namespace")
    p.set_defaults(func=kubectl_views.cmd_list)
    p = sub.add_parser("status", parents=[common], help="the rollout at a glance")
    p.add_argument("name")
    p.add_argument("--decisions", type=int, default=8, help="ledger decisions to show (default 8)")
    p.add_argument("-w", "--watch", action="store_true", help="redraw on every change until Ctrl-C")
    p.set_defaults(func=kubectl_views.cmd_status)
    p = sub.add_parser("history", parents=[common], help="revisions with outcome and evidence")
    p.add_argument("name")
    p.set_defaults(func=cmd_history)
    helps = {
        "promote": "promote the canary now, skipping its remaining steps",
        "abort": "roll the canary back now",
        "pause": "hold the rollout: no analysis, the step clock stops",
        "resume": "continue a paused rollout",
        "retry": "canary a rolled-back revision again",
    }
    for verb, text in helps.items():
        p = sub.add_parser(verb, parents=[common], help=text)
        p.add_argument("name")
        p.add_argument(
            "--wait",
            type=float,
            default=0.0,
            metavar="SECONDS",
            help="wait until the operator has handled the command, then show the phase",
        )
        p.set_defaults(func=cmd_command)
    recommend.register(sub, common, recommend.cmd_recommend)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for key, default in (("namespace", None), ("kubeconfig", None), ("context", None), ("output", "table")):
        if not hasattr(args, key):
            setattr(args, key, default)
    width = int(os.environ.get("COLUMNS", "0")) or None
    console = Console(width=width if width else (None if sys.stdout.isatty() else 160))
    try:
        cluster = Cluster(args.kubeconfig, args.context, args.namespace)
        code: int = args.func(cluster, args, console)
    except PluginError as exc:
        Console(stderr=True).print(f"[red]error:[/] {exc}")
        return 1
    return code


if __name__ == "__main__":
    sys.exit(main())
