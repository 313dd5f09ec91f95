"""Rotating credentials: the token file re-read on change, the Kubernetes client's token hook,
the kubeconfig's tokenFile, and PrometheusBackend's bearer token against a real HTTP check
(the local authenticating proxy in front of a stub Prometheus API)."""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from batchpilot_localdev import free_port
from batchpilot_localdev.authproxy import BearerAuthProxy
from batchpilot_operator import opmetrics
from batchpilot_operator.credentials import CredentialError, TokenFile
from batchpilot_operator.kube import kubeconfig_token_file, use_token_file
from batchpilot_operator.prom import PrometheusBackend, _status_code


def rotate(path: Path, token: str) -> None:
    """As the kubelet does: write aside, then rename over (a new inode)."""
    tmp = path.with_suffix(".new")
    tmp.write_text(token + "\n")
    os.replace(tmp, path)


def test_token_file_rereads_only_when_the_file_changes(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("one\n")
    tf = TokenFile(path)
    assert tf.token() == "one" and tf.token() == "one"
    assert tf.reads == 1
    rotate(path, "two")
    assert tf.token() == "two"
    assert tf.reads == 2


def test_token_file_missing_or_empty_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(CredentialError, match=r"token file .*missing"):
        TokenFile(tmp_path / "missing")
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(CredentialError, match="is empty"):
        TokenFile(tmp_path / "empty")
    path = tmp_path / "token"
    path.write_text("one")
    tf = TokenFile(path)
    path.unlink()
    with pytest.raises(CredentialError, match="No such file"):
        tf.token()


def test_kubernetes_client_sends_the_current_token(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("one")
    cfg = client.Configuration()
    use_token_file(cfg, TokenFile(path))
    assert cfg.auth_settings()["BearerToken"]["value"] == "Bearer one"
    rotate(path, "two")
    assert cfg.auth_settings()["BearerToken"]["value"] == "Bearer two"


def test_kubeconfig_token_file_of_the_current_user(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "config"
    kubeconfig.write_text(
        json.dumps(
            {
                "current-context": "b",
                "contexts": [{"name": "a", "context": {"user": "ua"}}, {"name": "b", "context": {"user": "ub"}}],
                "users": [{"name": "ua", "user": {"token": "x"}}, {"name": "ub", "user": {"tokenFile": "sa/token"}}],
            }
        )
    )
    assert kubeconfig_token_file(str(kubeconfig)) == str(tmp_path / "sa" / "token")
    kubeconfig.write_text(json.dumps({"current-context": "a", "contexts": [{"name": "a", "context": {"user": "u"}}]}))
    assert kubeconfig_token_file(str(kubeconfig)) is None


def test_status_code_of_client_errors() -> None:
    assert _status_code("HTTP Status Code 401 (b'unauthorized')") == 401
    assert _status_code("something else") is None


class StubPrometheus:
    """Answers every instant query with the scalar 1."""

    def __init__(self) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = json.dumps({"status": "success", "data": {"resultType": "scalar", "result": [0, "1"]}})
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(body.encode())

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.port = free_port()
        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def guarded(tmp_path: Path) -> Iterator[tuple[BearerAuthProxy, Path]]:
    stub = StubPrometheus()
    valid = tmp_path / "valid-tokens"
    valid.write_text("good-1\n")
    proxy = BearerAuthProxy(f"http://127.0.0.1:{stub.port}", valid)
    yield proxy, valid
    proxy.stop()
    stub.server.shutdown()


def auth_errors() -> float:
    return opmetrics.AUTH_ERRORS.labels("prometheus")._value.get()


def test_prometheus_bearer_token_rotation_and_revocation(guarded: tuple[BearerAuthProxy, Path], tmp_path: Path) -> None:
    proxy, valid = guarded
    token = tmp_path / "token"
    token.write_text("good-1")
    backend = PrometheusBackend(proxy.url, timeout=5, bearer_token_file=token)
    assert backend.measure(["q"])["q"].value == 1.0
    # Rotated: the proxy accepts the new token only; the backend uses it without a restart.
    valid.write_text("good-2\n")
    rotate(token, "good-2")
    assert backend.measure(["q"])["q"].value == 1.0
    # Revoked: an Error measurement that names the cause, counted as an auth error.
    before = auth_errors()
    valid.write_text("")
    m = backend.measure(["q", "q2"])
    assert m["q"].error and "rejected the operator's credentials: HTTP 401" in m["q"].error
    assert m["q2"].error == m["q"].error, "one rejection marks the whole batch"
    assert auth_errors() == before + 1
    assert opmetrics.AUTH_OK.labels("prometheus")._value.get() == 0
    # A valid token again: recovered at the next query.
    valid.write_text("good-3\n")
    rotate(token, "good-3")
    assert backend.measure(["q"])["q"].value == 1.0
    assert opmetrics.AUTH_OK.labels("prometheus")._value.get() == 1
    # The token file gone: an Error naming the file, no request sent.
    forwarded = proxy.forwarded
    token.unlink()
    m = backend.measure(["q"])
    assert m["q"].error and "prometheus credentials: token file" in m["q"].error
    assert proxy.forwarded == forwarded


def test_fresh_token_waits_for_the_file_to_replace_a_refused_token(tmp_path: Path) -> None:
    from batchpilot_operator.credentials import fresh_token

    path = tmp_path / "token"
    path.write_text("old")
    tf = TokenFile(path)
    assert fresh_token(tf, None) == "old"  # first login: whatever the file holds
    sleeps: list[float] = []

    def sleep(seconds: float) -> None:  # the kubelet rotates the file while we wait
        sleeps.append(seconds)
        if len(sleeps) == 2:
            path.unlink()  # mid-rotation: missing for a moment, not an error
        if len(sleeps) == 3:
            rotate(path, "new")

    before = opmetrics.AUTH_ERRORS.labels("kubernetes")._value.get()
    assert fresh_token(tf, "old", sleep=sleep) == "new"
    assert len(sleeps) == 3
    assert opmetrics.AUTH_ERRORS.labels("kubernetes")._value.get() == before + 1
    assert opmetrics.AUTH_OK.labels("kubernetes")._value.get() == 1


def test_kubernetes_401_is_counted_and_a_new_token_file_recovers(tmp_path: Path) -> None:
    """api_client against a stub apiserver that accepts only the token "good"."""
    from kubernetes.client.exceptions import ApiException

    from batchpilot_operator.kube import api_client

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            ok = self.headers.get("Authorization") == "Bearer good"
            body = json.dumps({"kind": "NamespaceList", "apiVersion": "v1", "items": []} if ok else {"code": 401})
            self.send_response(200 if ok else 401)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, format: str, *args: Any) -> None:
            pass

    port = free_port()
    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    token = tmp_path / "token"
    token.write_text("bad\n")
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "current-context": "c",
                "clusters": [{"name": "k", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
                "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
                "users": [{"name": "u", "user": {"tokenFile": "token"}}],
            }
        )
    )
    try:
        core = client.CoreV1Api(api_client(str(kubeconfig)))
        before = opmetrics.AUTH_ERRORS.labels("kubernetes")._value.get()
        with pytest.raises(ApiException) as err:
            core.list_namespace()
        assert err.value.status == 401
        assert opmetrics.AUTH_ERRORS.labels("kubernetes")._value.get() == before + 1
        assert opmetrics.AUTH_OK.labels("kubernetes")._value.get() == 0
        rotate(token, "good")  # same client, no restart
        assert core.list_namespace().items == []
        assert opmetrics.AUTH_OK.labels("kubernetes")._value.get() == 1
    finally:
        server.shutdown()
