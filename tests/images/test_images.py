"""The images `make images` builds, started the way the cluster would start them (podman, host
network, vfs storage, runc): the operator image answers its health endpoint against the local
control plane; the runtime image serves an inference request with a config file mounted where the
operator mounts it (/etc/batchpilot/config.json).

Needs buildah, podman, mmdebstrap and runc (apt, installed by hack/setup.sh); the test runs
`bash hack/images.sh` first, which builds the images the first time (a few minutes) and after that
rebuilds only an image whose sources changed (seconds when none did): never a skip, never stale.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from batchpilot_localdev import free_port
from bptest import INTERACTIVE_LANE, REPO, Kube

pytestmark = [pytest.mark.slow, pytest.mark.images]

VERSION = next(
    line.split('"')[1] for line in (REPO / "pyproject.toml").read_text().splitlines() if line.startswith("version = ")
)
OPERATOR = f"localhost/batchpilot/operator:{VERSION}"
RUNTIME = f"localhost/batchpilot/runtime:{VERSION}"
ENV = {**os.environ, "CONTAINERS_CONF": str(REPO / "hack" / "images" / "containers.conf")}
PODMAN = ["podman", "--storage-driver", "vfs", "--runtime", "runc"]


def podman(*args: str, check: bool = True, timeout: float | None = None) -> subprocess.CompletedProcess[str]:
    # A hang guard, not a timing claim. `run` gets more: the vfs driver copies the image's whole
    # root filesystem for every container and deletes it at --rm, and the 1.5 GB runtime image's
    # probe, its output already complete, was still being removed after 120 s beside the other
    # half of make test (2026-12-07).
    if timeout is None:
        timeout = 600 if args[0] == "run" else 120
    result = subprocess.run([*PODMAN, *args], capture_output=True, text=True, env=ENV, timeout=timeout, check=False)
    if check and result.returncode != 0:
        raise AssertionError(f"podman {' '.join(args)}: {result.stderr}")
    return result


@pytest.fixture(scope="module")
def images() -> None:
    # hack/setup.sh installs the tools (hack/node/build.sh); images.sh installs them too when
    # missing, and rebuilds only an image whose sources changed (seconds when none did).
    subprocess.run(["bash", str(REPO / "hack" / "images.sh")], check=True, timeout=1800, env=ENV)
    missing = [t for t in ("buildah", "podman", "mmdebstrap", "runc") if shutil.which(t) is None]
    assert not missing, f"make images left {', '.join(missing)} uninstalled"


@pytest.fixture
def containers() -> Iterator[list[str]]:
    started: list[str] = []
    yield started
    for name in started:
        podman("rm", "--force", "--time", "5", name, check=False)


def wait_http(url: str, timeout: float, container: str) -> bytes:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                body: bytes = resp.read()
                return body
        except (urllib.error.URLError, OSError):
            pass
        state = podman("inspect", "--format", "{{.State.Status}}", container, check=False).stdout.strip()
        if state not in ("running", "created", "configured"):
            logs = podman("logs", container, check=False)
            raise AssertionError(f"{container} is {state}:\n{logs.stdout}{logs.stderr}")
        if time.monotonic() > deadline:
            logs = podman("logs", container, check=False)
            raise AssertionError(f"{url} did not answer within {timeout}s:\n{logs.stdout}{logs.stderr}")
        time.sleep(0.5)


def test_runtime_image_serves_an_inference_with_a_mounted_config(
    images: None, containers: list[str], tmp_path: Path
) -> None:
    port = free_port()
    config = tmp_path / "config"
    config.mkdir()
    (config / "config.json").write_text(
        json.dumps(
            {
                "policy": "p",
                "revision": "abc123",
                "model": {"name": "mlp", "source": "builtin:tiny-mlp", "device": "auto", "dtype": "float32"},
                "lanes": [dict(INTERACTIVE_LANE, requestTimeout="1s")],
            }
        )
    )
    config.chmod(0o755)
    (config / "config.json").chmod(0o644)
    name = f"bp-runtime-{port}"
    containers.append(name)
    # What the operator's pod spec does: the revision's ConfigMap at /etc/batchpilot, read-only.
    podman(
        "run", "--detach", "--name", name, "--network", "host",
        "--volume", f"{config}:/etc/batchpilot:ro", "--read-only",
        RUNTIME, "--config", "/etc/batchpilot/config.json", "--track", "canary", "--port", str(port),
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/v2/health/ready", 120, name)
    body = json.dumps({"inputs": [{"name": "input", "datatype": "FP32", "shape": [2, 512], "data": [0.5] * 1024}]})
    req = urllib.request.Request(f"{url}/v2/models/mlp/infer", data=body.encode(), method="POST")
    with urllib.request.urlopen(req, timeout=30) as resp:
        out = json.loads(resp.read())
    assert out["model_version"] == "abc123" and out["outputs"][0]["shape"] == [2, 512]
    meta = json.loads(wait_http(f"{url}/v2/models/mlp", 10, name))
    assert meta["parameters"]["track"] == "canary" and meta["parameters"]["device"] == "cpu"
    torch = podman("run", "--rm", "--entrypoint", "cat", RUNTIME, "/etc/batchpilot-torch-version").stdout.strip()
    source = podman("image", "inspect", "--format", '{{index .Labels "dev.batchpilot.torch-source"}}', RUNTIME)
    assert torch.startswith("2.") and source.stdout.strip() in ("debian", "pypi")
    user = podman("inspect", "--format", "{{.Config.User}}", name).stdout.strip()
    assert user == "65532:65532"


BLAS_PROBE = """
import torch
torch.ones(64, 64) @ torch.ones(64, 64)
blas = sorted({line.split()[-1] for line in open("/proc/self/maps") if "libblas" in line or "libopenblas" in line})
print(torch.backends.mkl.is_available(), *blas)
"""


def test_runtime_images_torch_multiplies_on_an_optimized_blas(images: None) -> None:
    # Debian's torch calls BLAS through libblas.so.3: left at netlib's reference build, a batch of
    # 32 rows of the reference MLP took 367 ms instead of 19. PyPI's torch carries MKL instead.
    mkl, *blas = podman(
        "run", "--rm", "--network", "none", "--entrypoint", "python3", RUNTIME, "-c", BLAS_PROBE
    ).stdout.split()
    if mkl == "True":
        return
    assert blas and all("openblas" in path for path in blas), blas


# Every file of the installed distribution whose path names the development stack, and the
# commands the image's CLI offers (its --help lists them as {run,validate,...}).
STACK_PROBE = """
import importlib.metadata, importlib.util, subprocess
files = importlib.metadata.distribution("batchpilot").files or []
print([str(f) for f in files if "localdev" in str(f)], importlib.util.find_spec("batchpilot_localdev") is None)
print(subprocess.run(["batchpilot", "--help"], capture_output=True, text=True).stdout.partition("{")[2].partition("}")[0])
"""


@pytest.mark.parametrize("image", [OPERATOR, RUNTIME])
def test_images_carry_no_development_stack(images: None, image: str) -> None:
    # The development stack (localdev/: the local control plane, the demo) is its own package that
    # only a checkout installs: no image file of it, and the CLI in the image offers no demo or up.
    found, commands = podman(
        "run", "--rm", "--network", "none", "--entrypoint", "python3", image, "-c", STACK_PROBE
    ).stdout.splitlines()
    assert found == "[] True", found
    if image == OPERATOR:  # the runtime image carries the operator's package without its dependencies
        assert commands.split(",") == ["run", "validate", "profile", "tune"], commands


@pytest.mark.cluster
def test_operator_image_is_healthy_against_the_local_control_plane(
    images: None, containers: list[str], kube: Kube, tmp_path: Path
) -> None:
    # A self-contained kubeconfig (CA inline) in a directory the container's user can read.
    flat = kube.kubectl("config", "view", "--raw", "--flatten").stdout
    conf = tmp_path / "kube"
    conf.mkdir()
    (conf / "config").write_text(flat)
    conf.chmod(0o755)
    (conf / "config").chmod(0o644)
    health, metrics = free_port(), free_port()
    name = f"bp-operator-{health}"
    containers.append(name)
    podman(
        "run", "--detach", "--name", name, "--network", "host", "--read-only",
        "--volume", f"{conf}:/kube:ro",
        OPERATOR, "run", "--kubeconfig", "/kube/config", "--namespace", "default",
        f"--health-port={health}", f"--metrics-port={metrics}", "--prometheus-url", "http://127.0.0.1:9",
    )  # fmt: skip
    wait_http(f"http://127.0.0.1:{health}/healthz", 120, name)
    metrics_text = wait_http(f"http://127.0.0.1:{metrics}/metrics", 30, name).decode()
    assert "batchpilot_operator_reconciles_total" in metrics_text
