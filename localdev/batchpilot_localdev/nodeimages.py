"""The binaries and images the real node (:mod:`.realnode`) runs, and where they live.

containerd, runc, the CNI plugins and the pause binary (``hack/node/build.sh``), the kubelet
(``hack/k8s/build.sh``) and Prometheus are built before a start (:func:`ensure_node_binaries`);
the images of ``make images`` are rebuilt when podman lacks one or has it from other sources
(:func:`ensure_images`). containerd's root (:data:`CONTAINERD_ROOT`) keeps the imported images
between runs, with the podman image ID of each (:data:`IMPORTED`) and the second names given to
them (:data:`ALIASES`). :func:`run_command` runs a tool and raises :class:`RealNodeError`, the
real node's error, with its output when it fails.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path

from batchpilot_localdev.cluster import REPO_ROOT, bin_dir

PAUSE_IMAGE = "localhost/batchpilot/pause:3.10"
NODE_BIN = Path(os.environ.get("BATCHPILOT_NODE_BIN", REPO_ROOT / ".cache" / "node-bin"))
CONTAINERD_ROOT = Path(os.environ.get("BATCHPILOT_CONTAINERD_ROOT", REPO_ROOT / ".cache" / "node" / "containerd"))
ALIASES = CONTAINERD_ROOT.parent / "aliases.json"
"""Second names given to images (:meth:`.realnode.RealNode.alias`), to remove."""
IMPORTED = CONTAINERD_ROOT.parent / "imported.json"
"""podman's image ID of each image last imported into containerd's root."""
CONTAINERS_CONF = REPO_ROOT / "hack" / "images" / "containers.conf"
PODMAN = ["podman", "--storage-driver", "vfs", "--runtime", "runc"]
BUILDAH = ["buildah", "--storage-driver", "vfs"]
VERSION = next(
    line.split('"')[1]
    for line in (REPO_ROOT / "pyproject.toml").read_text().splitlines()
    if line.startswith("version = ")
)
RUNTIME_IMAGE = f"localhost/batchpilot/runtime:{VERSION}"
OPERATOR_IMAGE = f"localhost/batchpilot/operator:{VERSION}"
REGISTRY_RUNTIME_IMAGE = f"ghcr.io/batchpilot/runtime:{VERSION}"
"""The runtime image as the manifests name it (a registry would serve it)."""


class RealNodeError(RuntimeError):
    """The real node could not be set up or started; the message says which part and why."""


def run_command(
    cmd: Sequence[str],
    *,
    check: bool = True,
    timeout: float = 600,
    env: dict[str, str] | None = None,
    input: str | None = None,
) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        list(cmd), capture_output=True, text=True, timeout=timeout, check=False, env=env, input=input
    )
    if check and result.returncode != 0:
        raise RealNodeError(f"{' '.join(cmd)} exited {result.returncode}: {result.stderr.strip()[-2000:]}")
    return result


def images_env() -> dict[str, str]:
    return {**os.environ, "CONTAINERS_CONF": os.environ.get("CONTAINERS_CONF", str(CONTAINERS_CONF))}


def ensure_node_binaries() -> None:
    """containerd, runc (apt), the CNI plugins and the pause binary (``hack/node/build.sh``), the
    kubelet (``hack/k8s/build.sh``, with the control plane) and upstream Prometheus
    (``hack/prometheus/build.sh``: Debian's has no Kubernetes service discovery); cheap when up to date."""
    for script in ("k8s/build.sh", "node/build.sh", "prometheus/build.sh"):
        result = subprocess.run(["bash", str(REPO_ROOT / "hack" / script)], check=False)
        if result.returncode != 0:
            raise RealNodeError(f"hack/{script} exited {result.returncode}")
    missing = [
        str(p) for p in (bin_dir() / "kubelet", NODE_BIN / "pause", NODE_BIN / "cni" / "bridge") if not p.exists()
    ]
    missing += [tool for tool in ("containerd", "runc", "ctr") if shutil.which(tool) is None]
    if missing:
        raise RealNodeError(f"real node parts missing after the builds: {missing}")


def image_sources(kind: str) -> str:
    """The hash of the sources of the ``operator`` or ``runtime`` image (``hack/images/source-hash.sh``)."""
    return run_command(["bash", str(REPO_ROOT / "hack" / "images" / "source-hash.sh"), kind]).stdout.strip()


def stale_images(images: Sequence[str]) -> list[str]:
    """Those of ``images`` (the operator's and the runtime's of ``make images``) that podman
    lacks or built from other sources (their ``dev.batchpilot.source`` label, set by
    ``hack/images.sh``, names another hash)."""
    if shutil.which("podman") is None:
        return list(images)
    stale = []
    for image in images:
        kind = {RUNTIME_IMAGE: "runtime", OPERATOR_IMAGE: "operator"}.get(image)
        if kind is None:
            raise RealNodeError(f"{image} is none of the images of make images ({RUNTIME_IMAGE}, {OPERATOR_IMAGE})")
        label = run_command(
            [*PODMAN, "image", "inspect", "--format", '{{index .Labels "dev.batchpilot.source"}}', image],
            check=False,
            env=images_env(),
        ).stdout.strip()
        if label.split(" ", 1)[0] != image_sources(kind):
            stale.append(image)
    return stale


def ensure_images(images: Sequence[str]) -> None:
    """Build the images of ``make images`` (``hack/images.sh``, which rebuilds only what is
    stale) when podman lacks one of ``images`` or has it from other sources: the real node runs
    the code of the working tree, never an old image."""
    stale = stale_images(images)
    if stale:
        result = subprocess.run(["bash", str(REPO_ROOT / "hack" / "images.sh")], check=False, env=images_env())
        if result.returncode != 0:
            raise RealNodeError(f"hack/images.sh exited {result.returncode} (building {', '.join(stale)})")
        still = stale_images(images)
        if still:
            raise RealNodeError(f"hack/images.sh left these images stale: {', '.join(still)}")
