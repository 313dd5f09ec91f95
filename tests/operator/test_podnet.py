"""The local pod network (batchpilot_localdev/podnet.py): a CONNECT to a pod address reaches the process that
plays the pod on 127.0.0.1, an unknown address gets 502 and is never dialled, and routes can
only point into 127.0.0.0/8. A real proxy process on a Unix socket, a real HTTP server."""

from __future__ import annotations

import http.server
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from batchpilot_localdev import free_port, podnet


@pytest.fixture
def proxy(tmp_path: Path) -> Iterator[tuple[Path, Path]]:
    sock = tmp_path / "podnet.sock"
    routes = tmp_path / "routes"
    proc = subprocess.Popen(
        [sys.executable, "-m", "batchpilot_localdev.podnet", "--socket", str(sock), "--routes", str(routes)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 20
    while not sock.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "podnet did not start"
        time.sleep(0.05)
    yield sock, routes
    proc.terminate()
    proc.wait(10)


def connect(sock: Path, target: str, request: bytes | None = None) -> bytes:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(10)
        s.connect(str(sock))
        s.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = s.recv(4096)
            if not chunk:
                break
            head += chunk
        if request is None or not head.startswith(b"HTTP/1.1 200"):
            while chunk := s.recv(4096):
                head += chunk
            return head
        s.sendall(request)
        body = b""
        while chunk := s.recv(4096):
            body += chunk
        return head + body


class Hello(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        payload = f"hello from {self.path}".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(payload)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args: object) -> None:
        pass


def test_connect_reaches_the_process_playing_the_pod(proxy: tuple[Path, Path]) -> None:
    sock, routes = proxy
    port = free_port()
    server = http.server.HTTPServer(("127.0.0.1", port), Hello)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        podnet.write_route(routes, "10.0.0.7", 8000, f"127.0.0.1:{port}")
        out = connect(sock, "10.0.0.7:8000", b"GET /admin/arrivals HTTP/1.1\r\nHost: x\r\n\r\n")
        assert out.startswith(b"HTTP/1.1 200 Connection established")
        assert out.endswith(b"hello from /admin/arrivals")
        podnet.remove_route(routes, "10.0.0.7", 8000, f"127.0.0.1:{port}")
        assert connect(sock, "10.0.0.7:8000").startswith(b"HTTP/1.1 502")
    finally:
        server.shutdown()


def test_unknown_pod_addresses_are_refused_not_dialled(proxy: tuple[Path, Path]) -> None:
    sock, _ = proxy
    out = connect(sock, "10.0.0.9:8000")
    assert out.startswith(b"HTTP/1.1 502") and b"no local process plays 10.0.0.9:8000" in out
    assert connect(sock, "not-an-address:80").startswith(b"HTTP/1.1 502")


def test_routes_point_only_into_loopback(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"outside 127\.0\.0\.0/8"):
        podnet.write_route(tmp_path, "10.0.0.7", 8000, "10.0.0.7:8000")
    # A route file written by hand to a private address is refused when used.
    (tmp_path / "10.0.0.8_8000").write_text("10.1.2.3:8000")
    with pytest.raises(PermissionError, match=r"outside 127\.0\.0\.0/8"):
        podnet.resolve(tmp_path, "10.0.0.8:8000")


def test_the_real_nodes_bridge_is_dialled_as_it_is_and_nothing_else(tmp_path: Path) -> None:
    # batchpilot_localdev/realnode.py: its pods and kubelet are real hosts on the project's own bridge.
    assert podnet.resolve(tmp_path, "198.18.0.7:8000") == ("198.18.0.7", 8000)
    assert podnet.resolve(tmp_path, "198.19.255.1:10250") == ("198.19.255.1", 10250)
    assert podnet.resolve(tmp_path, "198.20.0.1:8000") is None
    assert podnet.resolve(tmp_path, "10.0.0.7:8000") is None


def test_a_stopped_process_leaves_the_route_of_the_pod_that_took_its_address(tmp_path: Path) -> None:
    # kwok gives a deleted pod's IP to the next pod; the old process is stopped after its preStop,
    # by which time the new pod's process has its own route: that route must survive.
    podnet.write_route(tmp_path, "10.0.0.1", 8000, "127.0.0.1:41001")  # old pod's process
    podnet.write_route(tmp_path, "10.0.0.1", 8000, "127.0.0.1:41002")  # the new pod, same IP
    podnet.remove_route(tmp_path, "10.0.0.1", 8000, "127.0.0.1:41001")
    assert podnet.resolve(tmp_path, "10.0.0.1:8000") == ("127.0.0.1", 41002)
    podnet.remove_route(tmp_path, "10.0.0.1", 8000, "127.0.0.1:41002")
    assert podnet.resolve(tmp_path, "10.0.0.1:8000") is None
    podnet.remove_route(tmp_path, "10.0.0.1", 8000, "127.0.0.1:41002")  # gone already: no error
