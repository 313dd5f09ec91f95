"""The local pod network: where the apiserver's pod proxy reaches the runtime processes.

kwok gives fake pods addresses from a private range (10.0.0.0/24 here) that are no hosts of
ours, and the apiserver refuses to proxy to a pod whose IP is not global unicast (loopback is
not: ``pkg/registry/core/pod/strategy.go``, ``ResourceLocation``), so pods cannot simply get
127.x addresses. Instead the local control plane starts kube-apiserver with an egress
selector (``--egress-selector-config-file``) that sends all *cluster* traffic (pod, service
and node proxy, logs, exec) through this HTTP CONNECT proxy, the way konnectivity does in
real clusters. The proxy never dials the address it is asked for: it looks the pod address up
in a routes directory (one file per ``<pod ip>_<port>``, holding ``127.0.0.1:<port>`` of the
process that plays the pod, written by :mod:`batchpilot_localdev.harness`) and
connects there, only ever to 127.0.0.0/8. Unknown addresses get 502, a route outside
127.0.0.0/8 gets 403: nothing ever connects to a 10.x address. The one exception is the
project's own bridge of the real node (localdev/realnode.py, 198.18.0.0/15): its pods and its
kubelet are real hosts there, dialled as they are (logs, exec, pod proxy).

Run: ``python -m batchpilot_localdev.podnet --socket PATH --routes DIR`` (the apiserver
dials the Unix socket; see ``cluster.egress_selector_config``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import logging
import os
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path

log = logging.getLogger("batchpilot.podnet")
LOOPBACK = ipaddress.ip_network("127.0.0.0/8")
REAL_NODE_NET = ipaddress.ip_network("198.18.0.0/15")
"""The real node's bridge (localdev/nodehost.py PROJECT_NET): real pods, dialled directly."""


def route_file(routes: Path, pod_ip: str, port: int) -> Path:
    return routes / f"{pod_ip}_{port}"


def write_route(routes: Path, pod_ip: str, port: int, local: str) -> None:
    """Map ``pod_ip:port`` to ``local`` (``127.x.y.z:port``), atomically."""
    host = local.rsplit(":", 1)[0]
    if ipaddress.ip_address(host) not in LOOPBACK:
        raise ValueError(f"route target {local} is outside 127.0.0.0/8")
    path = route_file(routes, pod_ip, port)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(local)
    tmp.replace(path)


def remove_route(routes: Path, pod_ip: str, port: int, local: str) -> None:
    """Remove the route of ``pod_ip:port`` if it still leads to ``local``: kwok gives a deleted
    pod's address to the next pod, whose process has its own route by the time the old process
    ends its ``preStop`` and is stopped (removing it unread cut that pod off the apiserver's
    proxy: ``recommend`` got 502 from it at the end of every ``make demo``)."""
    if read_route(routes, pod_ip, port) == local:
        route_file(routes, pod_ip, port).unlink(missing_ok=True)


def read_route(routes: Path, pod_ip: str, port: int) -> str | None:
    """Where the route of ``pod_ip:port`` leads (``127.x.y.z:port``), or None when there is none."""
    try:
        return route_file(routes, pod_ip, port).read_text().strip()
    except OSError:
        return None


def resolve(routes: Path, target: str) -> tuple[str, int] | None:
    """The loopback address that plays ``target`` (``ip:port``), or None when there is none."""
    host, _, port = target.rpartition(":")
    host = host.strip("[]")
    try:
        address = ipaddress.ip_address(host)
        port_no = int(port)
    except ValueError:
        return None
    if address in REAL_NODE_NET:
        return host, port_no
    local = read_route(routes, host, port_no)
    if local is None:
        return None
    lhost, _, lport = local.rpartition(":")
    if ipaddress.ip_address(lhost) not in LOOPBACK:
        raise PermissionError(f"route for {target} points outside 127.0.0.0/8: {local}")
    return lhost, int(lport)


async def relay(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    up_reader: asyncio.StreamReader,
    up_writer: asyncio.StreamWriter,
) -> None:
    """Copy bytes both ways between a client's connection and its upstream's until both ends
    are done: each side's writer is closed when the other side's reader ends or fails."""
    await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while chunk := await reader.read(65536):
            writer.write(chunk)
            await writer.drain()
    except (OSError, asyncio.IncompleteReadError, asyncio.CancelledError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


async def _answer(writer: asyncio.StreamWriter, status: str, message: str) -> None:
    body = message.encode()
    writer.write(
        f"HTTP/1.1 {status}\r\nContent-Type: text/plain\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n".encode()
        + body
    )
    with contextlib.suppress(ConnectionError):
        await writer.drain()
    writer.close()


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def handler(routes: Path) -> Handler:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            writer.close()
            return
        first = head.split(b"\r\n", 1)[0].decode("latin-1").split()
        if len(first) != 3 or first[0] != "CONNECT":
            await _answer(writer, "405 Method Not Allowed", "only CONNECT is served\n")
            return
        target = first[1]
        try:
            local = resolve(routes, target)
        except PermissionError as exc:
            log.warning("%s", exc)
            await _answer(writer, "403 Forbidden", f"{exc}\n")
            return
        if local is None:
            await _answer(writer, "502 Bad Gateway", f"no local process plays {target}\n")
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*local)
        except OSError as exc:
            await _answer(writer, "502 Bad Gateway", f"{target} -> {local[0]}:{local[1]}: {exc}\n")
            return
        writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        await writer.drain()
        await relay(reader, writer, up_reader, up_writer)

    return handle


async def serve(socket_path: Path, routes: Path) -> None:
    server = await asyncio.start_unix_server(handler(routes), str(socket_path))
    os.chmod(socket_path, 0o600)
    log.info("pod network proxy on unix:%s, routes in %s", socket_path, routes)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="podnet", description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--socket", required=True, help="Unix socket the apiserver's egress selector dials")
    p.add_argument("--routes", required=True)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    routes = Path(args.routes)
    routes.mkdir(parents=True, exist_ok=True)
    Path(args.socket).unlink(missing_ok=True)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(Path(args.socket), routes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
