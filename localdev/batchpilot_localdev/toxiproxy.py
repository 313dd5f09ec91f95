"""A real Toxiproxy (github.com/Shopify/toxiproxy/v2, built by hack/build-toxiproxy.sh) for the
dependency drills: a TCP proxy in front of Prometheus or the apiserver whose faults (latency,
connection resets, a cut link) are switched on and off through its REST API.

Toxiproxy works on TCP, so TLS to the apiserver passes through untouched; only timing and
connection faults are injected. The REST API is small enough to drive with ``urllib``:
``POST /proxies`` creates a proxy, ``POST /proxies/{name}/toxics`` adds a toxic,
``DELETE /proxies/{name}/toxics/{toxic}`` removes it, ``POST /reset`` removes every toxic.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from batchpilot_localdev import checkout, free_port
from batchpilot_localdev.processes import stop_process

REPO = checkout()
TOXIPROXY_BIN = Path(
    os.environ.get("BATCHPILOT_TOXIPROXY_BIN", str(REPO / ".cache" / "toxiproxy-bin" / "toxiproxy-server"))
)

Stream = Literal["downstream", "upstream"]


class ToxiproxyError(RuntimeError):
    """The Toxiproxy API refused a request (the message carries its answer)."""


@dataclass(frozen=True)
class Proxy:
    name: str
    listen: str
    """``127.0.0.1:PORT`` the proxy listens on: point the client here."""
    upstream: str


class Toxiproxy:
    """A ``toxiproxy-server`` process on a free 127.0.0.1 port and a client of its API."""

    def __init__(self, workdir: Path, binary: Path = TOXIPROXY_BIN) -> None:
        if not os.access(binary, os.X_OK):
            raise FileNotFoundError(f"toxiproxy-server not found at {binary}: run hack/build-toxiproxy.sh")
        workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.api = f"http://127.0.0.1:{self.port}"
        self.log_file = workdir / "toxiproxy.log"
        with self.log_file.open("ab") as log:
            self.process = subprocess.Popen(
                [str(binary), "-host", "127.0.0.1", "-port", str(self.port)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        deadline = time.monotonic() + 20
        while True:
            if self.process.poll() is not None:
                raise ToxiproxyError(f"toxiproxy-server exited {self.process.returncode}: {self.log_tail()}")
            try:
                self._call("GET", "/version")
                return
            except (urllib.error.URLError, OSError):
                if time.monotonic() > deadline:
                    self.stop()
                    raise ToxiproxyError(f"toxiproxy-server not answering on {self.api}: {self.log_tail()}") from None
                time.sleep(0.1)

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        stop_process(self.process, 10)

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.api + path, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                text = resp.read()
        except urllib.error.HTTPError as exc:
            raise ToxiproxyError(f"{method} {path}: HTTP {exc.code}: {exc.read().decode(errors='replace')}") from exc
        return json.loads(text) if text.strip() else None

    # -- proxies -----------------------------------------------------------------------------

    def proxy(self, name: str, upstream: str, listen_port: int | None = None) -> Proxy:
        """Create a proxy ``name`` from a free local port to ``upstream`` (``host:port``)."""
        listen = f"127.0.0.1:{listen_port or free_port()}"
        answer = self._call("POST", "/proxies", {"name": name, "listen": listen, "upstream": upstream, "enabled": True})
        return Proxy(name=name, listen=str(answer["listen"]), upstream=upstream)

    def set_enabled(self, name: str, enabled: bool) -> None:
        """Disable (every connection is closed and refused) or re-enable a proxy."""
        self._call("POST", f"/proxies/{name}", {"enabled": enabled})

    # -- toxics ------------------------------------------------------------------------------

    def add_toxic(
        self,
        proxy: str,
        name: str,
        type_: str,
        attributes: dict[str, int | float],
        stream: Stream = "downstream",
        toxicity: float = 1.0,
    ) -> None:
        if not 0.0 <= toxicity <= 1.0:
            raise ValueError(f"toxicity is a probability in [0, 1], got {toxicity}")
        body = {"name": name, "type": type_, "stream": stream, "toxicity": toxicity, "attributes": attributes}
        self._call("POST", f"/proxies/{proxy}/toxics", body)

    def latency(self, proxy: str, ms: int, jitter_ms: int = 0, name: str = "latency") -> None:
        """Delay every chunk of data from upstream by ``ms`` (± ``jitter_ms``)."""
        self.add_toxic(proxy, name, "latency", {"latency": ms, "jitter": jitter_ms})

    def reset_peer(self, proxy: str, after_ms: int = 0, name: str = "reset") -> None:
        """Answer every connection with a TCP RST ``after_ms`` after it opens."""
        self.add_toxic(proxy, name, "reset_peer", {"timeout": after_ms}, stream="upstream")

    def remove_toxic(self, proxy: str, name: str) -> None:
        self._call("DELETE", f"/proxies/{proxy}/toxics/{name}")

    def toxics(self, proxy: str) -> list[str]:
        answer = self._call("GET", f"/proxies/{proxy}/toxics")
        return [str(t["name"]) for t in answer]

    def reset(self) -> None:
        """Remove every toxic and enable every proxy."""
        self._call("POST", "/reset")
