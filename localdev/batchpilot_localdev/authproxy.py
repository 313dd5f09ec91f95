"""An authenticating reverse proxy in front of the local Prometheus, for the credential drill.

Prometheus itself authenticates only with basic auth (``--web.config.file``); installs that
take bearer tokens put a proxy in front of it (kube-rbac-proxy, oauth2-proxy, a managed
service's gateway). This is the smallest such proxy: a request whose ``Authorization: Bearer``
token is one of the lines of ``tokens_file`` (re-read on every request, so a test revokes a
token by rewriting the file) is forwarded to ``upstream``; any other gets 401. GET only (the
query API the operator uses).
"""

from __future__ import annotations

import threading
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from batchpilot_localdev import free_port


class BearerAuthProxy:
    def __init__(self, upstream: str, tokens_file: Path) -> None:
        self.upstream = upstream.rstrip("/")
        self.tokens_file = tokens_file
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.rejected = 0
        self.forwarded = 0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                header = self.headers.get("Authorization", "")
                token = header[len("Bearer ") :].strip() if header.startswith("Bearer ") else ""
                if not token or token not in proxy.valid_tokens():
                    proxy.rejected += 1
                    self._answer(401, b'{"error":"unauthorized"}', {"WWW-Authenticate": "Bearer"})
                    return
                proxy.forwarded += 1
                try:
                    with urllib.request.urlopen(proxy.upstream + self.path, timeout=30) as resp:
                        self._answer(resp.status, resp.read(), {"Content-Type": resp.headers.get("Content-Type", "")})
                except urllib.error.HTTPError as exc:
                    self._answer(exc.code, exc.read(), {})
                except OSError:
                    self._answer(502, b'{"error":"upstream unreachable"}', {})

            def _answer(self, status: int, body: bytes, headers: dict[str, str]) -> None:
                self.send_response(status)
                for key, value in headers.items():
                    if value:
                        self.send_header(key, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever, name="bearer-auth-proxy", daemon=True)
        self._thread.start()

    def valid_tokens(self) -> set[str]:
        try:
            return {line.strip() for line in self.tokens_file.read_text().splitlines() if line.strip()}
        except OSError:
            return set()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
