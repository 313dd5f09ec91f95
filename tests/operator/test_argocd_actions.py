"""The Argo CD resource actions (manifests/argocd/actions.yaml) run by a real Lua 5.1 interpreter.

Over objects captured from real operator runs (fixtures/status/) for which actions are offered;
and end to end: each action's output turned into the JSON merge patch Argo CD sends for a
custom resource, applied to the real apiserver while a real operator runs, walking a canary
through pause, resume, abort, retry and promote as `kubectl batchpilot` does in
test_kubectl_plugin.py, with the operator crediting `argocd@<time>` in its ledger.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from batchpilot_operator.rollout import command_time
from bptest import INTERACTIVE_LANE, REPO, Kube, OperatorProcess, lua_literal, policy, wait_policy_status

LUA = shutil.which("lua5.1") or "/usr/bin/lua5.1"
ACTIONS_FILE = REPO / "manifests" / "argocd" / "actions.yaml"
CM_KEY = "resource.customizations.actions.batchpilot.dev_BatchingPolicy"
FIXTURES = Path(__file__).resolve().parent / "fixtures" / "status"
VERBS = ["promote", "abort", "retry", "pause", "resume"]
VALUE = re.compile(r"^argocd@\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")

# Runs a script with `obj` set, as Argo CD does, and writes what it returns as JSON.
DRIVER = r"""
obj = dofile(arg[1])
local script = assert(loadfile(arg[2]))
local function is_array(t)
  local n = 0
  for k, _ in pairs(t) do
    if type(k) ~= "number" then return false end
    n = n + 1
  end
  for i = 1, n do
    if t[i] == nil then return false end
  end
  return n > 0
end
local function enc(v)
  local kind = type(v)
  if kind == "nil" then return "null" end
  if kind == "boolean" then return tostring(v) end
  if kind == "number" then
    if v == math.floor(v) and math.abs(v) < 2^53 then return string.format("%d", v) end
    return string.format("%.17g", v)
  end
  if kind == "string" then
    local escaped = string.gsub(v, '[%c"\\]', function(c) return string.format("\\u%04x", string.byte(c)) end)
    return '"' .. escaped .. '"'
  end
  local parts = {}
  if is_array(v) then
    for _, item in ipairs(v) do table.insert(parts, enc(item)) end
    return "[" .. table.concat(parts, ",") .. "]"
  end
  for k, item in pairs(v) do table.insert(parts, enc(tostring(k)) .. ":" .. enc(item)) end
  return "{" .. table.concat(parts, ",") .. "}"
end
io.write(enc(script()))
"""


def scripts() -> dict[str, str]:
    """Script name ('discovery' or a verb) -> Lua source, read from the file argocd-cm embeds."""
    doc = yaml.safe_load(ACTIONS_FILE.read_text())
    out = {"discovery": doc["discovery.lua"]}
    out |= {d["name"]: d["action.lua"] for d in doc["definitions"]}
    return out


def run_lua(script: str, obj: dict[str, Any], tmp_path: Path) -> Any:
    if not Path(LUA).exists():
        pytest.fail("lua5.1 not installed: run hack/setup.sh (apt-get install lua5.1)")
    (tmp_path / "obj.lua").write_text("return " + lua_literal(obj) + "\n")
    (tmp_path / "script.lua").write_text(script)
    (tmp_path / "driver.lua").write_text(DRIVER)
    result = subprocess.run(
        [LUA, str(tmp_path / "driver.lua"), str(tmp_path / "obj.lua"), str(tmp_path / "script.lua")],
        capture_output=True,
        text=True,
        timeout=10,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def offered(obj: dict[str, Any], tmp_path: Path) -> set[str]:
    actions = run_lua(scripts()["discovery"], obj, tmp_path)
    assert set(actions) == set(VERBS)
    assert all(a["iconClass"].startswith("fa ") for a in actions.values())
    return {verb for verb, a in actions.items() if not a["disabled"]}


def merge_patch(live: Any, new: Any) -> Any:
    """RFC 7386 merge patch from live to new: what Argo CD sends for a custom resource's action."""
    if not (isinstance(live, dict) and isinstance(new, dict)):
        empty = ({}, [])
        return None if (live in empty and new in empty) or live == new else new
    patch: dict[str, Any] = {}
    for key in live.keys() - new.keys():
        patch[key] = None
    for key, value in new.items():
        if key not in live:
            patch[key] = value
        else:
            sub = merge_patch(live[key], value)
            if sub is not None and sub != {}:
                patch[key] = sub
    return patch


def action_patch(verb: str, live: dict[str, Any], tmp_path: Path) -> dict[str, Any]:
    """Run the action over the live object; the patch must touch batchpilot annotations only."""
    patch = merge_patch(live, run_lua(scripts()[verb], copy.deepcopy(live), tmp_path))
    assert set(patch) == {"metadata"} and set(patch["metadata"]) == {"annotations"}, patch
    assert all(k.startswith("batchpilot.dev/") for k in patch["metadata"]["annotations"]), patch
    result: dict[str, Any] = patch
    return result


def load(case: str) -> dict[str, Any]:
    obj: dict[str, Any] = json.loads((FIXTURES / f"{case}.json").read_text())["object"]
    return obj


# ---- Lua over captured objects ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("case", "actions"),
    [
        ("pending", {"pause"}),
        ("healthy", {"pause"}),
        ("canary-stalled", {"promote", "abort", "pause"}),
        ("paused", {"promote", "abort", "resume"}),
        ("rolled-back", {"retry", "pause"}),
    ],
)
def test_discovery_offers_what_the_operator_would_act_on(case: str, actions: set[str], tmp_path: Path) -> None:
    assert offered(load(case), tmp_path) == actions


def test_discovery_without_status_or_annotations(tmp_path: Path) -> None:
    obj = load("healthy")
    obj.pop("status")
    obj["metadata"].pop("annotations", None)
    assert offered(obj, tmp_path) == {"pause"}


@pytest.mark.parametrize("verb", ["promote", "abort", "retry", "pause"])
def test_command_actions_write_the_plugins_annotation(verb: str, tmp_path: Path) -> None:
    obj = load("canary-stalled")
    obj["metadata"].pop("annotations", None)  # the action creates the map when there is none
    patch = action_patch(verb, obj, tmp_path)
    value = patch["metadata"]["annotations"][f"batchpilot.dev/{verb}"]
    assert VALUE.match(value), value
    assert command_time(value) is not None, "the planner reads the time of the command"
    assert set(patch["metadata"]["annotations"]) == {f"batchpilot.dev/{verb}"}


def test_resume_drops_the_pause_and_records_who(tmp_path: Path) -> None:
    patch = action_patch("resume", load("paused"), tmp_path)
    annotations = patch["metadata"]["annotations"]
    assert annotations["batchpilot.dev/pause"] is None  # merge patch: delete
    assert VALUE.match(annotations["batchpilot.dev/resume"])


def test_argocd_cm_embeds_the_tested_actions() -> None:
    from batchpilot_localdev.cluster import bin_dir

    kubectl = bin_dir() / "kubectl"
    exe = str(kubectl) if kubectl.exists() else (shutil.which("kubectl") or "kubectl")
    rendered = subprocess.run(
        [exe, "kustomize", str(REPO / "manifests" / "argocd")], capture_output=True, text=True, check=True
    ).stdout
    cm = next(d for d in yaml.safe_load_all(rendered) if d and d["kind"] == "ConfigMap")
    assert cm["data"][CM_KEY] == ACTIONS_FILE.read_text()


# ---- applied to the real apiserver, acted on by a real operator -------------------------------

POLICY: dict[str, Any] = policy(
    "ranker",
    lanes=[dict(INTERACTIVE_LANE)],
    rollout={
        "steps": [{"weight": 25, "pause": "1h"}, {"weight": 50, "pause": "1h"}],
        "analysisInterval": "1s",
        "onMetricsUnavailable": {"action": "Hold"},
    },
)


@pytest.mark.cluster
def test_actions_walk_a_rollout_on_the_real_apiserver(
    kube: Kube, namespace: str, operator_without_prometheus: OperatorProcess, tmp_path: Path
) -> None:
    ns = namespace

    def live() -> dict[str, Any]:
        obj = kube.get("batchingpolicy", "ranker", ns)
        assert obj is not None
        obj["metadata"].pop("managedFields", None)  # Argo CD acts on the object without them
        return obj

    def wait(pred: Any, what: str) -> dict[str, Any]:
        return wait_policy_status(kube, ns, "ranker", pred, what, operator_without_prometheus)

    def act(verb: str) -> str:
        obj = live()
        assert verb in offered(obj, tmp_path), f"{verb} not offered on phase {obj['status'].get('phase')}"
        patch = action_patch(verb, obj, tmp_path)
        kube.kubectl("patch", "batchingpolicy", "ranker", "-n", ns, "--type", "merge", "-p", json.dumps(patch))
        value: str = patch["metadata"]["annotations"][f"batchpilot.dev/{verb}"]
        return value

    kube.apply(POLICY, "-n", ns)
    first = wait(lambda s: s.get("phase") == "Healthy", "Healthy")["stableRevision"]
    assert offered(live(), tmp_path) == {"pause"}

    changed = copy.deepcopy(POLICY)
    changed["spec"]["lanes"][0]["maxQueueDelay"] = "3ms"
    kube.apply(changed, "-n", ns)
    rev = wait(lambda s: s.get("canaryRevision") and s.get("rollout"), "a held canary")["canaryRevision"]
    assert rev != first

    by = act("pause")
    st = wait(lambda s: s.get("phase") == "Paused", "Paused")
    assert st["ledger"][-1]["kind"] == "Paused" and st["ledger"][-1]["evidence"] == by

    by = act("resume")
    st = wait(lambda s: s.get("phase") == "Progressing", "resumed")
    annotations = live()["metadata"]["annotations"]
    assert "batchpilot.dev/pause" not in annotations and annotations["batchpilot.dev/resume"] == by
    resumed = wait(lambda s: any(e["kind"] == "Resumed" for e in s["ledger"]), "the Resumed entry")
    assert next(e for e in reversed(resumed["ledger"]) if e["kind"] == "Resumed")["evidence"].startswith(f"by {by};")

    by = act("abort")
    st = wait(lambda s: s.get("phase") == "RolledBack", "RolledBack")
    assert st["history"][-1]["outcome"] == "Aborted" and by in st["history"][-1]["evidence"]
    assert offered(live(), tmp_path) == {"retry", "pause"}

    act("retry")
    wait(lambda s: s.get("canaryRevision") == rev and s.get("phase") == "Progressing", "the retried canary")
    by = act("promote")
    done = wait(lambda s: s.get("stableRevision") == rev, "promoted")
    assert done["history"][-1]["outcome"] == "Promoted" and by in done["history"][-1]["evidence"]
