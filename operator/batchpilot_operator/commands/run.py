"""`batchpilot run`: run the operator (kopf) against the current kubeconfig or in-cluster."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from typing import Any


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser("run", help="run the operator")
    p.add_argument("--kubeconfig", help="kubeconfig to use (default: in-cluster, then ~/.kube/config)")
    p.add_argument(
        "--prometheus-url",
        default=os.environ.get("BATCHPILOT_PROMETHEUS_URL"),
        help="Prometheus that scrapes the runtime pods",
    )
    p.add_argument("--namespace", action="append", default=[], help="watch only these namespaces (repeatable)")
    p.add_argument("--metrics-port", type=int, default=8080, help="operator metrics port (0: off)")
    p.add_argument("--health-port", type=int, default=8081, help="kopf liveness endpoint port (0: off)")
    p.add_argument("--resync", type=float, help="seconds between periodic reconciles of each policy")
    p.add_argument("--verbose", action="store_true")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.kubeconfig:
        os.environ["BATCHPILOT_KUBECONFIG"] = args.kubeconfig
        os.environ["KUBECONFIG"] = args.kubeconfig
    if args.prometheus_url:
        os.environ["BATCHPILOT_PROMETHEUS_URL"] = args.prometheus_url
    if args.resync:
        os.environ["BATCHPILOT_RESYNC_SECONDS"] = str(args.resync)
    import kopf
    from prometheus_client import start_http_server

    from batchpilot_operator import handlers  # noqa: F401  (registers the handlers)

    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not args.verbose:
        # kopf logs every successful handler run at INFO: once a second per policy here.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    if args.metrics_port:
        start_http_server(args.metrics_port, addr="0.0.0.0")
    liveness = f"http://0.0.0.0:{args.health_port}/healthz" if args.health_port else None
    asyncio.run(
        kopf.operator(
            clusterwide=not args.namespace,
            namespaces=list(args.namespace),
            liveness_endpoint=liveness,
            standalone=True,
        )
    )
    return 0
