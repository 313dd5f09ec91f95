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
import os
import sys

from rich.console import Console

from batchpilot_operator.kubectl import commands, recommend, views
from batchpilot_operator.kubectl.cluster import Cluster, PluginError


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
    p.set_defaults(func=views.cmd_list)
    p = sub.add_parser("status", parents=[common], help="the rollout at a glance")
    p.add_argument("name")
    p.add_argument("--decisions", type=int, default=8, help="ledger decisions to show (default 8)")
    p.add_argument("-w", "--watch", action="store_true", help="redraw on every change until Ctrl-C")
    p.set_defaults(func=views.cmd_status)
    p = sub.add_parser("history", parents=[common], help="revisions with outcome and evidence")
    p.add_argument("name")
    p.set_defaults(func=views.cmd_history)
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
        p.set_defaults(func=commands.cmd_command)
    recommend.register(sub, common)
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
