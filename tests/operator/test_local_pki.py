"""The local control plane's PKI passes strict X.509 verification (Python 3.13's default: the
operator image's Python rejects a CA without keyUsage), checked with a real TLS handshake."""

from __future__ import annotations

import socket
import ssl
import threading
from pathlib import Path

from batchpilot_localdev.pki import make_pki


def test_apiserver_certificate_verifies_strictly(tmp_path: Path) -> None:
    make_pki(tmp_path)
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(tmp_path / "apiserver.crt", tmp_path / "apiserver.key")
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        errors: list[Exception] = []

        def serve() -> None:
            conn, _ = listener.accept()
            try:
                server.wrap_socket(conn, server_side=True).close()
            except (OSError, ssl.SSLError) as exc:
                errors.append(exc)

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        client = ssl.create_default_context(cafile=str(tmp_path / "ca.crt"))
        client.verify_flags |= ssl.VERIFY_X509_STRICT
        conn = socket.create_connection(listener.getsockname(), timeout=10)
        with client.wrap_socket(conn, server_hostname="127.0.0.1") as tls:  # the kubeconfig's server
            assert tls.version() in ("TLSv1.2", "TLSv1.3")
        thread.join(10)
    assert not errors
