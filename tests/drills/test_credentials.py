"""Drill 5: credential rotation and expiry, for the Kubernetes API and for Prometheus.

The operator runs as a ServiceAccount whose token it reads from a file named by its kubeconfig
(``tokenFile``), as a projected token is read in a pod. Tokens are minted by the local
apiserver's TokenRequest API (``kubectl create token``), bound to a Secret so that deleting the
Secret revokes the token at once (the apiserver's 10-minute minimum lifetime rules out waiting
for a real expiry in a drill; to the operator a revoked and an expired token look the same: 401).

Prometheus sits behind a bearer-token check (``batchpilot_localdev.authproxy``, what kube-rbac-proxy does in
a cluster); the operator sends ``--prometheus-bearer-token-file``.

Expected: a rotated file is used without a restart (same process, no 401); a revoked token is a
clear error (one log line, ``batchpilot_operator_auth_errors_total`` and ``auth_ok`` 0, which the
BatchpilotOperatorAuthFailing alert reads) and the operator recovers as soon as a valid token is
in the file; a revoked Prometheus token holds the canary (MetricsUnavailable), a valid one
resumes it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from batchpilot_localdev.authproxy import BearerAuthProxy
from batchpilot_localdev.prometheus import PrometheusServer
from bpdrill import Drill
from bpdrill_deps import Stage, condition, policy, stage, stalled
from bptest import Kube

pytestmark = [pytest.mark.cluster, pytest.mark.prometheus, pytest.mark.slow]

SA = "batchpilot-drill"
HELD_STEP_S = 60  # the pause of the change made under a revoked token (step 2): outlasts steps 2-3


def write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".new")
    tmp.write_text(text)
    os.replace(tmp, path)


class Tokens:
    """ServiceAccount tokens minted by the apiserver, each bound to its own Secret."""

    def __init__(self, kube: Kube, namespace: str, token_file: Path) -> None:
        self.kube, self.namespace, self.file = kube, namespace, token_file
        self.count = 0

    def mint(self) -> str:
        self.count += 1
        secret = f"{SA}-bind-{self.count}"
        self.kube.kubectl("create", "secret", "generic", secret, "-n", self.namespace)
        out = self.kube.kubectl(
            "create", "token", SA, "-n", self.namespace, "--duration=10m",
            "--bound-object-kind=Secret", f"--bound-object-name={secret}",
        ).stdout.strip()  # fmt: skip
        assert out.count(".") == 2, f"not a JWT: {out[:40]}"
        return out

    def rotate(self) -> None:
        write_atomically(self.file, self.mint() + "\n")

    def revoke(self, n: int) -> None:
        self.kube.kubectl("delete", "secret", f"{SA}-bind-{n}", "-n", self.namespace, "--wait=true")


def sa_kubeconfig(kube: Kube, token_file: Path, out: Path) -> Path:
    config: dict[str, Any] = yaml.safe_load(kube.kubeconfig.read_text())
    config["users"] = [{"name": SA, "user": {"tokenFile": str(token_file)}}]
    for ctx in config["contexts"]:
        ctx["context"]["user"] = SA
    out.write_text(yaml.safe_dump(config))
    return out


@pytest.fixture
def creds(kube: Kube, namespace: str, tmp_path: Path) -> Iterator[tuple[Stage, Tokens, Path, Path]]:
    kube.kubectl("create", "serviceaccount", SA, "-n", namespace)
    binding = f"{SA}-{namespace}"
    kube.kubectl(
        "create", "clusterrolebinding", binding, "--clusterrole=cluster-admin", f"--serviceaccount={namespace}:{SA}"
    )
    token_file = tmp_path / "sa-token"
    tokens = Tokens(kube, namespace, token_file)
    tokens.rotate()
    kubeconfig = sa_kubeconfig(kube, token_file, tmp_path / "kubeconfig-sa")
    prom_valid = tmp_path / "prometheus-valid-tokens"
    prom_token = tmp_path / "prometheus-token"
    prom_valid.write_text("prom-token-1\n")
    prom_token.write_text("prom-token-1\n")
    guards: list[BearerAuthProxy] = []

    def front(prom: PrometheusServer) -> str:
        guards.append(BearerAuthProxy(prom.url, prom_valid))
        return guards[0].url

    try:
        for s in stage(
            kube,
            namespace,
            tmp_path,
            prometheus_timeout=5.0,
            kubeconfig=kubeconfig,
            prometheus_front=front,
            extra_args=(f"--prometheus-bearer-token-file={prom_token}",),
        ):
            yield s, tokens, prom_valid, prom_token
    finally:
        for guard in guards:
            guard.stop()
        kube.kubectl("delete", "clusterrolebinding", binding, check=False)


def auth_errors(s: Stage, target: str) -> float:
    return s.op.metric("batchpilot_operator_auth_errors_total", target=target)


def auth_ok(s: Stage, target: str) -> float:
    return s.op.metric("batchpilot_operator_auth_ok", target=target)


def promoted(s: Stage, canary: str, what: str) -> None:
    s.wait(lambda st: st.get("stableRevision") == canary and st.get("phase") == "Healthy", 180, what)


def test_credential_rotation_and_revocation(creds: tuple[Stage, Tokens, Path, Path], drill: Drill) -> None:
    s, tokens, prom_valid, prom_token = creds
    drill.fault = (
        "ServiceAccount token file rotated, then its token revoked (bound Secret deleted) and a new one written; "
        "the same for the Prometheus bearer token"
    )
    drill.expected = (
        "rotation: used without restart, no 401; revocation: log line + auth_errors_total + auth_ok 0, "
        "recovery once a valid token is in the file; Prometheus: canary held (MetricsUnavailable), resumes"
    )
    pid = s.op.proc.pid
    assert auth_errors(s, "kubernetes") == 0 and auth_ok(s, "kubernetes") == 1

    # 1. Rotation: token 2 in the file, token 1 revoked. The next change needs the new token.
    tokens.rotate()
    tokens.revoke(1)
    _, canary = s.start_canary("3ms")
    promoted(s, canary, "promotion with the rotated token")
    assert s.op.proc.pid == pid and s.op.proc.poll() is None
    assert auth_errors(s, "kubernetes") == 0, "a rotated token file caused 401s"

    # 2. Revocation: token 2 revoked, nothing valid in the file. A change must fail clearly.
    # The apiserver caches a token's verdict for 10 s, so the operator may still carry this change
    # to its 50% step before the first 401; a 6 s pause could then end (and the change be
    # promoted) before step 4 revokes Prometheus mid-canary. The step waits long enough for that.
    tokens.revoke(2)
    stable = canary
    s.apply(policy(window="4ms", steps=[{"weight": 50, "pause": f"{HELD_STEP_S}s"}]))
    t0 = time.monotonic()
    s.kube.wait_for(lambda: auth_errors(s, "kubernetes") > 0, 60, "the 401 counted")
    detect = time.monotonic() - t0
    assert auth_ok(s, "kubernetes") == 0
    log = s.op.log()
    assert "kubernetes rejected the operator's credentials (HTTP 401" in log, log[-2000:]
    assert log.count("kubernetes rejected the operator's credentials") == 1, "logged once, not per request"
    assert s.status().get("stableRevision") == stable

    # 3. A valid token back in the file: the operator recovers without a restart.
    tokens.rotate()
    t1 = time.monotonic()
    s.kube.wait_for(lambda: auth_ok(s, "kubernetes") == 1, 60, "the API accepting the operator again")
    recover = time.monotonic() - t1
    canary2 = s.wait(lambda st: st.get("canaryRevision") not in (None, stable), 90, "the canary after recovery")[
        "canaryRevision"
    ]
    assert "kubernetes accepts the operator's credentials again" in s.op.log()
    s.wait(lambda st: st.get("canaryWeight") == 50, 120, "the canary at 50%")

    # 4. Prometheus token revoked mid-canary: Error analyses, held; a new valid token resumes it.
    prom_errors0 = auth_errors(s, "prometheus")
    prom_valid.write_text("")
    t2 = time.monotonic()
    held = s.wait(stalled, 60, "Stalled on the rejected Prometheus token")
    prom_detect = time.monotonic() - t2
    assert (condition(held, "Stalled") or {}).get("reason") == "MetricsUnavailable"
    assert auth_errors(s, "prometheus") > prom_errors0 and auth_ok(s, "prometheus") == 0
    assert held.get("stableRevision") == stable
    entries = [e for e in held.get("ledger", []) if e.get("outcome") == "Error"]
    assert any("rejected the operator's credentials: HTTP 401" in e.get("evidence", "") for e in entries), entries[-3:]
    prom_valid.write_text("prom-token-2\n")
    write_atomically(prom_token, "prom-token-2\n")
    t3 = time.monotonic()
    s.wait(lambda st: not stalled(st), 60, "the canary resumed on the new Prometheus token")
    prom_recover = time.monotonic() - t3
    promoted(s, canary2, "promotion after the Prometheus token was replaced")
    assert s.op.proc.pid == pid, "no restart"

    drill.detected(detect)
    drill.recovered(recover)
    drill.figures.update(
        {
            "kube_auth_errors": int(auth_errors(s, "kubernetes")),
            "prometheus_auth_errors": int(auth_errors(s, "prometheus") - prom_errors0),
            "prometheus_detect_s": round(prom_detect, 1),
            "prometheus_recover_s": round(prom_recover, 1),
        }
    )
    drill.observed = (
        f"rotation: promoted on the new token, same pid, 0 401s; revocation: 401 counted {detect:.1f} s after the "
        f"change, logged once, auth_ok 0; valid token back: accepted {recover:.1f} s later, canary proceeded; "
        f"Prometheus token revoked: Stalled {prom_detect:.1f} s later, resumed {prom_recover:.1f} s after a new token, then promoted"
    )
