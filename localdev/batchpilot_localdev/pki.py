"""The local control plane's certificates and kubeconfigs, made with ``openssl``.

:func:`make_pki`: the cluster's CA, the apiserver's serving certificate for 127.0.0.1 and
localhost, and the service-account keys; :func:`make_node_credentials`: a kubelet's client
certificate signed by that CA (``system:node:<name>``); :func:`write_kubeconfig` (the admin's
token) and :func:`write_cert_kubeconfig` (a client certificate): a kubeconfig of one cluster,
one user and one context.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _new_key_and_csr(pki: Path, subject: str, key: str, csr: str) -> None:
    """A new RSA key and a certificate signing request for ``subject``, in ``pki``."""
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", subject, "-keyout", key, "-out", csr, cwd=pki)


def _sign_with_ca(pki: Path, csr: str, extfile: str, out: str) -> None:
    """Sign ``csr`` with the cluster's CA in ``pki`` (ten years), with the ``[ext]`` section of
    ``extfile``."""
    _openssl(
        "x509",
        "-req",
        "-in",
        csr,
        "-CA",
        "ca.crt",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-days",
        "3650",
        "-extfile",
        extfile,
        "-extensions",
        "ext",
        "-out",
        out,
        cwd=pki,
    )


def make_pki(pki: Path) -> None:
    """A CA, an apiserver serving cert for 127.0.0.1/localhost, and service-account keys."""
    pki.mkdir(parents=True, exist_ok=True)
    if (pki / "apiserver.crt").exists():
        return
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "3650",
        "-subj",
        "/CN=batchpilot-local-ca",
        # What strict X.509 verification (Python 3.13's default, OpenSSL's X509_STRICT) demands.
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        cwd=pki,
    )
    (pki / "san.cnf").write_text(
        "[req]\ndistinguished_name=dn\n[dn]\n[ext]\n"
        "subjectAltName=IP:127.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default.svc\n"
        "keyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n"
        "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid,issuer\n"
    )
    _new_key_and_csr(pki, "/CN=kube-apiserver", "apiserver.key", "apiserver.csr")
    _sign_with_ca(pki, "apiserver.csr", "san.cnf", "apiserver.crt")
    _openssl("genrsa", "-out", "sa.key", "2048", cwd=pki)
    _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)


def make_node_credentials(pki: Path, node: str) -> tuple[Path, Path]:
    """A client certificate for the kubelet of ``node``, signed by the cluster's CA in ``pki``:
    user ``system:node:<node>`` in group ``system:nodes``, so the apiserver's Node authorizer
    and NodeRestriction admission confine it to its own Node and the pods bound to it (as
    kubeadm's kubelets are), instead of the admin's token. Returns (certificate, key)."""
    crt, key = pki / f"node-{node}.crt", pki / f"node-{node}.key"
    if crt.exists() and key.exists():
        return crt, key
    ext = pki / f"node-{node}.cnf"
    ext.write_text(
        "[ext]\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=clientAuth\n"
        "authorityKeyIdentifier=keyid,issuer\n"
    )
    csr = pki / f"node-{node}.csr"
    _new_key_and_csr(pki, f"/O=system:nodes/CN=system:node:{node}", key.name, csr.name)
    _sign_with_ca(pki, csr.name, ext.name, crt.name)
    return crt, key


def _write_kubeconfig(path: Path, server: str, ca: Path, user: str, credentials: dict[str, str]) -> None:
    """A kubeconfig of one cluster, one user (authenticated by ``credentials``) and one context."""
    lines = "".join(f"    {key}: {value}\n" for key, value in credentials.items())
    path.write_text(
        f"""apiVersion: v1
kind: Config
clusters:
- name: local
  cluster:
    server: {server}
    certificate-authority: {ca}
users:
- name: {json.dumps(user)}
  user:
{lines}contexts:
- name: local
  context: {{cluster: local, user: {json.dumps(user)}}}
current-context: local
"""
    )


def write_cert_kubeconfig(path: Path, server: str, ca: Path, user: str, cert: Path, key: Path) -> None:
    """A kubeconfig authenticating with a client certificate (a node's, :func:`make_node_credentials`)."""
    _write_kubeconfig(path, server, ca, user, {"client-certificate": str(cert), "client-key": str(key)})


def write_kubeconfig(path: Path, server: str, ca: Path, token: str) -> None:
    _write_kubeconfig(path, server, ca, "admin", {"token": token})
