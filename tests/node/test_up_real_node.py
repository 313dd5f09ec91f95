"""`batchpilot up --real-node`: the local stack with its pods on a real node (kubelet +
containerd), Prometheus finding them through Kubernetes service discovery, the trace replayed
against them; `batchpilot down` leaves nothing of it (bridge, processes)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

import bptest
from batchpilot_localdev.nodehost import BRIDGE
from bpnode import real_policy

pytestmark = [pytest.mark.cluster, pytest.mark.realnode, pytest.mark.prometheus, pytest.mark.slow]


def batchpilot(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return bptest.batchpilot(*args, timeout=timeout)


def state(workdir: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((workdir / "state.json").read_text())
    return data


def test_up_real_node_runs_the_policy_on_the_node_and_down_leaves_nothing(tmp_path: Path) -> None:
    workdir = tmp_path / "up"
    up = batchpilot("up", "--real-node", f"--workdir={workdir}", "-n", "shop", "--rate=5", "--timeout=500")
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        assert "real node bp-node-0" in up.stdout, up.stdout
        st = state(workdir)
        assert st["realNode"] is True and {"node/kubelet", "node/containerd"} <= {p["name"] for p in st["parts"]}
        kubectl = [st["kubectl"], f"--kubeconfig={st['kubeconfig']}"]
        applied = subprocess.run(
            [*kubectl, "apply", "-n", "shop", "-f", "-"],
            input=yaml.safe_dump(real_policy()),
            capture_output=True,
            text=True,
            check=False,
        )
        assert applied.returncode == 0, applied.stderr
        deadline = time.monotonic() + 240
        load: dict[str, Any] = {}
        while time.monotonic() < deadline:
            load = state(workdir).get("load", {}).get("shop") or {}
            if load.get("ok", 0) >= 20:
                break
            time.sleep(1)
        assert load.get("ok", 0) >= 20, (load, (workdir / "stack.log").read_text()[-3000:])
        nodes = subprocess.run([*kubectl, "get", "pods", "-n", "shop", "-o", "json"], capture_output=True, text=True)
        assert {p["spec"]["nodeName"] for p in json.loads(nodes.stdout)["items"]} == {"bp-node-0"}
        import urllib.request

        with urllib.request.urlopen(f"{st['prometheusUrl']}/api/v1/query?query=up%7Bnamespace%3D%22shop%22%7D") as r:
            targets = json.loads(r.read())["data"]["result"]
        assert targets and all(t["metric"]["instance"].startswith("198.18.0.") for t in targets), targets
    finally:
        down = batchpilot("down", f"--workdir={workdir}")
    assert down.returncode == 0, down.stdout + down.stderr
    assert state(workdir)["phase"] == "down"
    assert subprocess.run(["ip", "link", "show", BRIDGE], capture_output=True).returncode != 0
    assert not Path("/sys/fs/cgroup/memory/batchpilot-node").exists()
    links = Path("/var/log/containers")
    assert not [p for p in links.iterdir() if str(workdir) in os.readlink(p)] if links.exists() else True
