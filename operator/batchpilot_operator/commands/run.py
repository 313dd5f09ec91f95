"""`batchpilot run`: run the operator (kopf) against the current kubeconfig or in-cluster.

With ``--leader-elect`` (as the Deployment runs it, 2 replicas) the process first waits to
hold the Lease (``control.leader``) and only then starts kopf: a standby watches nothing and
writes nothing, and serves ``/healthz`` itself. A leader that cannot renew exits (status 1);
one stopped by SIGTERM stops kopf, then releases the Lease so a standby takes over at once.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import logging
import os
import signal
import socket
import threading
import uuid
from pathlib import Path
from typing import Any

SA_NAMESPACE = Path("/var/run/secrets/kubernetes.io/serviceaccount/namespace")


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser("run", help="run the operator")
    p.add_argument("--kubeconfig", help="kubeconfig to use (default: in-cluster, then ~/.kube/config)")
    p.add_argument(
        "--prometheus-url",
        default=os.environ.get("BATCHPILOT_PROMETHEUS_URL"),
        help="Prometheus that scrapes the runtime pods",
    )
    p.add_argument(
        "--prometheus-bearer-token-file",
        default=os.environ.get("BATCHPILOT_PROMETHEUS_BEARER_TOKEN_FILE"),
        help="send this file's token to Prometheus (Authorization: Bearer); re-read when the file changes",
    )
    p.add_argument(
        "--token-file",
        default=os.environ.get("BATCHPILOT_TOKEN_FILE"),
        help="bearer token for the Kubernetes API (e.g. a projected ServiceAccount token), re-read when the "
        "file changes; default: the kubeconfig user's tokenFile, which is re-read the same way",
    )
    p.add_argument("--namespace", action="append", default=[], help="watch only these namespaces (repeatable)")
    p.add_argument("--metrics-port", type=int, default=8080, help="operator metrics port (0: off)")
    p.add_argument("--health-port", type=int, default=8081, help="kopf liveness endpoint port (0: off)")
    p.add_argument(
        "--resync",
        type=float,
        help="seconds between safety resyncs of each policy (default 600, jittered; 0: off). "
        "Reconciles are driven by watch events and the planner's requeue; a resync reads only caches",
    )
    p.add_argument("--workers", type=int, help="concurrent reconciles (default 16; they mostly wait on the API)")
    p.add_argument("--leader-elect", action="store_true", help="run only while holding the leader Lease")
    p.add_argument(
        "--leader-election-namespace",
        help="namespace of the Lease (default: the pod's namespace, $POD_NAMESPACE)",
    )
    p.add_argument("--leader-election-id", default="batchpilot-operator", help="name of the Lease")
    p.add_argument("--verbose", action="store_true")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.kubeconfig:
        os.environ["BATCHPILOT_KUBECONFIG"] = args.kubeconfig
        os.environ["KUBECONFIG"] = args.kubeconfig
    if args.prometheus_url:
        os.environ["BATCHPILOT_PROMETHEUS_URL"] = args.prometheus_url
    for flag, path, env in (
        (
            "--prometheus-bearer-token-file",
            args.prometheus_bearer_token_file,
            "BATCHPILOT_PROMETHEUS_BEARER_TOKEN_FILE",
        ),
        ("--token-file", args.token_file, "BATCHPILOT_TOKEN_FILE"),
    ):
        if path:
            if not os.path.isfile(path):
                raise SystemExit(f"{flag}: no such file {path!r}")
            os.environ[env] = os.path.abspath(path)
    if args.resync is not None:
        if args.resync < 0:
            raise SystemExit(f"--resync must be >= 0 seconds, got {args.resync}")
        os.environ["BATCHPILOT_RESYNC_SECONDS"] = str(args.resync)
    if args.workers is not None:
        if args.workers < 1:
            raise SystemExit(f"--workers must be >= 1, got {args.workers}")
        os.environ["BATCHPILOT_WORKERS"] = str(args.workers)
    os.environ["BATCHPILOT_NAMESPACES"] = ",".join(args.namespace)
    identity = os.environ.setdefault("BATCHPILOT_IDENTITY", f"{socket.gethostname()}_{uuid.uuid4().hex[:8]}")
    import kopf
    from prometheus_client import start_http_server

    from batchpilot_operator import handlers, opmetrics  # noqa: F401  (registers the handlers)

    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    if not args.verbose:
        # kopf logs every successful handler run at INFO: once a second per policy here.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    if args.metrics_port:
        start_http_server(args.metrics_port, addr="0.0.0.0")
    log = logging.getLogger("batchpilot")
    # `kill -USR1 <pid>` writes every thread's stack to stderr: what a stuck operator is doing.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    elector = None
    if args.leader_elect:
        elector = _lead(args, identity, log)
        if elector is None:
            return 0
    else:
        opmetrics.LEADER.labels(identity).set(1)
        log.info("leading as %s (leader election off)", identity)
    liveness = f"http://0.0.0.0:{args.health_port}/healthz" if args.health_port else None
    try:
        asyncio.run(
            kopf.operator(
                clusterwide=not args.namespace,
                namespaces=list(args.namespace),
                liveness_endpoint=liveness,
                standalone=True,
            )
        )
    finally:
        if elector is not None:
            elector.release()
            opmetrics.LEADER.labels(identity).set(0)
    return 0


def _lead(args: argparse.Namespace, identity: str, log: logging.Logger) -> Any:
    """Wait (as a standby) until this process holds the Lease; None if stopped first."""
    from batchpilot_operator import opmetrics
    from batchpilot_operator.control.leader import LeaderElector
    from batchpilot_operator.kube import USER_AGENT, api_client

    namespace = args.leader_election_namespace or os.environ.get("POD_NAMESPACE")
    if not namespace and SA_NAMESPACE.exists():
        namespace = SA_NAMESPACE.read_text().strip()
    if not namespace:
        raise SystemExit("--leader-elect needs --leader-election-namespace (or $POD_NAMESPACE, or in-cluster)")
    api = api_client(args.kubeconfig, f"{USER_AGENT}/{identity}")
    elector = LeaderElector(api, namespace, args.leader_election_id, identity)
    opmetrics.LEADER.labels(identity).set(0)
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGTERM, signal.SIGINT)}
    health = _standby_health(args.health_port) if args.health_port else None
    log.info("standby as %s: waiting for Lease %s/%s", identity, namespace, args.leader_election_id)
    try:
        if not elector.acquire(stop):
            log.info("stopped while standby")
            return None
    finally:
        if health is not None:
            health.shutdown()
            health.server_close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    opmetrics.LEADER.labels(identity).set(1)
    log.info("leading as %s (Lease %s/%s)", identity, namespace, args.leader_election_id)

    def lost() -> None:
        opmetrics.LEADER.labels(identity).set(0)
        log.error("lost the Lease: exiting so that no write of ours follows the new leader's")
        logging.shutdown()
        os._exit(1)

    elector.keep_renewing(lost)
    return elector


def _standby_health(port: int) -> Any:
    """/healthz while standby (kopf's endpoint takes the port over once this process leads)."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Health(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            ok = self.path.startswith("/healthz")
            self.send_response(200 if ok else 404)
            self.end_headers()
            if ok:
                self.wfile.write(b"standby\n")

        def log_message(self, *_: Any) -> None:
            pass

    server = ThreadingHTTPServer(("0.0.0.0", port), Health)
    threading.Thread(target=server.serve_forever, name="standby-health", daemon=True).start()
    return server
