"""Peer model servers for the side-by-side benchmark, each in its own venv.

Each venv lives under ``.cache/bench-venvs/<peer>`` (git-ignored) and reuses the base venv's
torch and numpy through a ``.pth`` file that appends the base venv's site-packages to its path
(PyPI's torch is a multi-GB download: install it once). Packages are installed by
:func:`ensure_venv` with the ordinary ``pip`` client; a marker file makes it idempotent.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

from benchlib import BENCH, REPO, free_port, wait_http

VENVS = REPO / ".cache" / "bench-venvs"
PEERS: dict[str, list[str]] = {
    "ray": ["ray[serve]==2.60.0"],
    # 1.7.1 with uvloop 0.23 crashes its worker; 0.21.0 works
    "mlserver": ["mlserver==1.7.1", "uvloop==0.21.0"],
    "bentoml": ["bentoml==1.4.40"],
}


def ensure_venv(name: str) -> Path:
    venv = VENVS / name
    marker = venv / ".batchpilot-installed"
    pkgs = PEERS[name]
    if marker.exists() and marker.read_text() == json.dumps(pkgs):
        return venv
    VENVS.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    site = next((venv / "lib").glob("python3*/site-packages"))
    base_site = sysconfig.get_paths()["purelib"]
    (site / "_batchpilot_base.pth").write_text(base_site + "\n")
    print(f"  installing {pkgs} into {venv}", file=sys.stderr)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", *pkgs], check=True)
    marker.write_text(json.dumps(pkgs))
    return venv


def _env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "runtime"), str(BENCH / "peers")])
    env["OMP_NUM_THREADS"] = str(threads)
    env["BENCH_THREADS"] = str(threads)
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    return env


def start_ray(max_batch: int, wait_s: float, threads: int, log: Path) -> tuple[subprocess.Popen[Any], str]:
    venv = ensure_venv("ray")
    port = free_port()
    proc = subprocess.Popen(
        [str(venv / "bin" / "python"), str(BENCH / "peers" / "ray_app.py"), str(port), str(max_batch),
         str(wait_s), str(threads)],
        env=_env(threads), stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}/v2/models/m/infer"
    _wait_post(url, proc, 180)
    return proc, url


def start_mlserver(max_batch: int, wait_s: float, threads: int, log: Path) -> tuple[subprocess.Popen[Any], str]:
    venv = ensure_venv("mlserver")
    port = free_port()
    d = Path(tempfile.mkdtemp(prefix="bp-mlserver-"))
    (d / "settings.json").write_text(
        json.dumps(
            {
                "http_port": port,
                "grpc_port": free_port(),
                "metrics_port": free_port(),
                "host": "127.0.0.1",
                "debug": False,
                "parallel_workers": 1,
            }
        )
    )
    (d / "model-settings.json").write_text(
        json.dumps(
            {
                "name": "m",
                "implementation": "mlserver_mlp.MLPRuntime",
                "max_batch_size": max_batch,
                "max_batch_time": wait_s,
            }
        )
    )
    proc = subprocess.Popen(
        [str(venv / "bin" / "mlserver"), "start", str(d)],
        env=_env(threads), stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True, cwd=d,
    )  # fmt: skip
    wait_http(f"http://127.0.0.1:{port}/v2/models/m/ready", 180, proc)
    return proc, f"http://127.0.0.1:{port}/v2/models/m/infer"


def start_bentoml(max_batch: int, wait_s: float, threads: int, log: Path) -> tuple[subprocess.Popen[Any], str]:
    """``wait_s`` is BentoML's ``max_latency_ms`` (its latency goal), not a fixed window."""
    venv = ensure_venv("bentoml")
    port = free_port()
    home = Path(tempfile.mkdtemp(prefix="bp-bentoml-"))
    env = dict(
        _env(threads), BENCH_MAX_BATCH=str(max_batch), BENCH_MAX_LATENCY_MS=str(round(wait_s * 1000)),
        BENTOML_HOME=str(home), BENTOML_DO_NOT_TRACK="True",
        # no access log line per request: what a user tuning for throughput sets
        BENTOML_CONFIG_OPTIONS="api_server.logging.access.enabled=false",
    )  # fmt: skip
    proc = subprocess.Popen(
        [str(venv / "bin" / "bentoml"), "serve", "bentoml_mlp:MLP", "--host", "127.0.0.1", "--port", str(port)],
        env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True, cwd=BENCH / "peers",
    )  # fmt: skip
    wait_http(f"http://127.0.0.1:{port}/readyz", 180, proc)
    return proc, f"http://127.0.0.1:{port}/infer"


def _wait_post(url: str, proc: subprocess.Popen[Any], timeout: float) -> None:
    import time
    import urllib.request

    from benchlib import mlp_body

    deadline = time.monotonic() + timeout
    body = mlp_body().encode()
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"peer exited with {proc.returncode}")
        try:
            req = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not serving after {timeout}s")


def request_body(peer: str) -> str:
    """The one-row request each peer takes: Open Inference Protocol JSON, or BentoML's own JSON for
    an ndarray argument (the same 512 values)."""
    from benchlib import mlp_body

    if peer != "bentoml":
        return mlp_body()
    doc = json.loads(mlp_body())
    return json.dumps({"x": [doc["inputs"][0]["data"]]})


STARTERS = {"ray": start_ray, "mlserver": start_mlserver, "bentoml": start_bentoml}
