"""The Argo CD health check (manifests/argocd/health.lua) run by a real Lua 5.1 interpreter over
BatchingPolicy objects captured from real operator runs (fixtures/status/*.json, written by
make_status_fixtures.py), plus edge cases derived from them (a generation the operator has not
observed yet, no status at all, Degraded)."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from bptest import REPO, lua_literal

LUA = shutil.which("lua5.1") or "/usr/bin/lua5.1"
HEALTH = REPO / "manifests" / "argocd" / "health.lua"
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "status"
CM_KEY = "resource.customizations.health.batchpilot.dev_BatchingPolicy"

DRIVER = """
obj = dofile(arg[1])
local check = assert(loadfile(arg[2]))
local hs = check()
io.write(hs.status, "\\n", hs.message or "", "\\n")
"""


def health(obj: dict[str, Any], tmp_path: Path, script: Path = HEALTH) -> tuple[str, str]:
    if not Path(LUA).exists():
        pytest.fail("lua5.1 not installed: run hack/setup.sh (apt-get install lua5.1)")
    (tmp_path / "obj.lua").write_text("return " + lua_literal(obj) + "\n")
    (tmp_path / "driver.lua").write_text(DRIVER)
    result = subprocess.run(
        [LUA, str(tmp_path / "driver.lua"), str(tmp_path / "obj.lua"), str(script)],
        capture_output=True,
        text=True,
        timeout=10,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    status, message = result.stdout.split("\n", 1)
    return status, message.rstrip("\n")


def load(case: str) -> tuple[str, dict[str, Any]]:
    doc = json.loads((FIXTURES / f"{case}.json").read_text())
    return doc["expect"], doc["object"]


CASES = sorted(p.stem for p in FIXTURES.glob("*.json"))


def test_fixtures_cover_every_verdict() -> None:
    assert {load(c)[0] for c in CASES} == {"Healthy", "Progressing", "Suspended", "Degraded"}
    phases = {load(c)[1]["status"]["phase"] for c in CASES}
    assert phases >= {"Pending", "Healthy", "Progressing", "Paused", "RolledBack"}


@pytest.mark.parametrize("case", CASES)
def test_verdict_on_real_status(case: str, tmp_path: Path) -> None:
    expect, obj = load(case)
    status, message = health(obj, tmp_path)
    assert status == expect
    assert message == obj["status"]["message"], "the operator's message is shown as is"


def test_rolled_back_message_carries_the_reason(tmp_path: Path) -> None:
    _, obj = load("rolled-back")
    status, message = health(obj, tmp_path)
    assert status == "Degraded"
    assert "rolled back (Aborted)" in message and "fixture@" in message


def test_unobserved_generation_is_progressing_not_healthy(tmp_path: Path) -> None:
    # What Argo CD sees right after a sync changed the spec: the old status, a newer generation.
    for case in ("healthy", "rolled-back", "paused"):
        _, obj = load(case)
        obj = copy.deepcopy(obj)
        obj["metadata"]["generation"] = obj["status"]["observedGeneration"] + 1
        status, message = health(obj, tmp_path)
        assert status == "Progressing", case
        assert f"generation {obj['metadata']['generation']}" in message


def test_no_status_yet_is_progressing(tmp_path: Path) -> None:
    _, obj = load("healthy")
    obj = {k: v for k, v in obj.items() if k != "status"}
    assert health(obj, tmp_path)[0] == "Progressing"


def test_degraded_phase_is_degraded(tmp_path: Path) -> None:
    # Degraded (stable track without ready pods) is not produced by the fixture run; the
    # status shape is the healthy one with the planner's Degraded phase and message.
    _, obj = load("healthy")
    obj = copy.deepcopy(obj)
    obj["status"]["phase"] = "Degraded"
    obj["status"]["message"] = "stable revision b655f302b3 has no ready pods (0/2)"
    assert health(obj, tmp_path) == ("Degraded", "stable revision b655f302b3 has no ready pods (0/2)")


def kubectl_bin() -> str:
    from batchpilot_localdev.cluster import bin_dir

    local = bin_dir() / "kubectl"
    return str(local) if local.exists() else (shutil.which("kubectl") or "kubectl")


def test_argocd_cm_embeds_the_tested_script(tmp_path: Path) -> None:
    rendered = subprocess.run(
        [kubectl_bin(), "kustomize", str(REPO / "manifests" / "argocd")], capture_output=True, text=True, check=True
    ).stdout
    cms = [d for d in yaml.safe_load_all(rendered) if d and d["kind"] == "ConfigMap"]
    assert [cm["metadata"]["name"] for cm in cms] == ["argocd-cm"]
    assert cms[0]["metadata"]["namespace"] == "argocd"
    assert cms[0]["data"][CM_KEY] == HEALTH.read_text()
    # and the embedded copy gives the same verdicts
    embedded = tmp_path / "embedded.lua"
    embedded.write_text(cms[0]["data"][CM_KEY])
    for case in CASES:
        expect, obj = load(case)
        assert health(obj, tmp_path, embedded)[0] == expect
