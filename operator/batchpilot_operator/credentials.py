"""Credentials read from files that rotate under the process: ServiceAccount tokens.

In a pod the kubelet rewrites a projected ServiceAccount token well before it expires (by an
atomic symlink swap), and a Prometheus behind an authenticating proxy takes such a token too.
A token read once at start-up is rejected an hour later. :class:`TokenFile` re-reads the file
whenever it changed (inode, size or modification time; one ``stat`` per use) so the operator
takes up a rotated token without a restart.

:func:`auth_failed` / :func:`auth_ok` keep the operator's view of each target's credentials in
``batchpilot_operator_auth_errors_total`` and ``batchpilot_operator_auth_ok`` and log the change
once (an error when a target starts rejecting us, an info line when it accepts us again), so a
revoked or expired token is a clear log line, a metric and an alert, not a stream of tracebacks.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)


class CredentialError(RuntimeError):
    """A credential file is missing, unreadable or empty."""


class TokenFile:
    """A bearer token kept in a file, re-read when the file changes."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._seen: tuple[int, int, int] | None = None
        self._token = ""
        self.reads = 0
        """How often the file was (re-)read: once at start, once per rotation."""
        self.token()  # a missing or empty file is an error at start-up, not at the first request

    def token(self) -> str:
        """The current token (re-read if the file changed since the last call)."""
        try:
            st = self.path.stat()
        except OSError as exc:
            raise CredentialError(f"token file {self.path}: {exc.strerror or exc}") from exc
        key = (st.st_ino, st.st_size, st.st_mtime_ns)
        with self._lock:
            if key != self._seen:
                try:
                    text = self.path.read_text().strip()
                except OSError as exc:
                    raise CredentialError(f"token file {self.path}: {exc.strerror or exc}") from exc
                if not text:
                    raise CredentialError(f"token file {self.path} is empty")
                if text != self._token and self._seen is not None:
                    log.info("token file %s changed: using the new token", self.path)
                self._token, self._seen = text, key
                self.reads += 1
            return self._token


_state: dict[str, bool] = {}
_state_lock = threading.Lock()


def auth_failed(target: str, detail: str) -> None:
    """``target`` (``kubernetes``, ``prometheus``) rejected our credentials (HTTP 401/403)."""
    from batchpilot_operator import opmetrics

    opmetrics.AUTH_OK.labels(target).set(0)  # first: whoever sees the error counted sees auth_ok 0
    opmetrics.AUTH_ERRORS.labels(target).inc()
    with _state_lock:
        was_ok = _state.get(target, True)
        _state[target] = False
    if was_ok:
        log.error(
            "%s rejected the operator's credentials (%s): the token expired or was revoked; "
            "retrying, and re-reading the token file on every request",
            target,
            detail,
        )


def auth_ok(target: str) -> None:
    """``target`` answered a request of ours (any status but 401/403)."""
    with _state_lock:
        was_failing = _state.get(target) is False
        known = target in _state
        _state[target] = True
    if was_failing or not known:
        from batchpilot_operator import opmetrics

        opmetrics.AUTH_OK.labels(target).set(1)
        if was_failing:
            log.info("%s accepts the operator's credentials again", target)


def fresh_token(
    token_file: TokenFile,
    rejected: str | None,
    target: str = "kubernetes",
    poll: float = 1.0,
    sleep: Callable[[float], None] = time.sleep,
) -> str:
    """The file's token, once it differs from ``rejected`` (the token the server refused).

    For a client that logs in again after a 401 (kopf does): handing it the refused token again
    makes it give up ("ran out of valid credentials") and the operator exit; waiting here for
    the file to change keeps the process up, and it resumes as soon as a valid token is written
    (the kubelet rotates a projected token; an operator of the cluster replaces a revoked one).
    """
    token = _read_or_none(token_file)
    if rejected is not None and token in (None, rejected):
        auth_failed(target, f"HTTP 401 with the token of {token_file.path}")
        log.error("%s: waiting for a new token in %s", target, token_file.path)
        while token in (None, rejected):
            sleep(poll)
            token = _read_or_none(token_file)
        auth_ok(target)
    assert token is not None
    return token


def _read_or_none(token_file: TokenFile) -> str | None:
    try:
        return token_file.token()
    except CredentialError as exc:
        log.warning("%s", exc)
        return None
