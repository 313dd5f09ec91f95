"""The Python lock files that hack/setup.sh installs from are current with pyproject.toml.

Every requirement of batchpilot (all extras) must be pinned, at a version its specifier allows,
in hack/requirements.lock or (torch and its closure) hack/requirements-torch.lock, with hashes.
A dependency added to pyproject.toml without `bash hack/lock.sh` fails here, not in a fresh set-up.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
MAIN, TORCH = REPO / "hack" / "requirements.lock", REPO / "hack" / "requirements-torch.lock"
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)\s*(?:;\s*([^\\]+?))?\s*\\?$")


def pins(path: Path) -> dict[str, list[Version]]:
    """Pinned versions by package, for this interpreter (markers evaluated)."""
    out: dict[str, list[Version]] = {}
    for line in path.read_text().splitlines():
        m = PIN.match(line)
        if m and (m.group(3) is None or Marker(m.group(3)).evaluate()):
            out.setdefault(canonicalize_name(m.group(1)), []).append(Version(m.group(2)))
    return out


def requirements() -> list[Requirement]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    reqs = [*project["dependencies"], *(r for extra in project["optional-dependencies"].values() for r in extra)]
    return [Requirement(r) for r in reqs]


@pytest.mark.parametrize("req", requirements(), ids=str)
def test_every_requirement_is_pinned_within_its_specifier(req: Requirement) -> None:
    locked = pins(MAIN) | pins(TORCH)
    name = canonicalize_name(req.name)
    assert name in locked, f"{req} is not in the lock files: run `bash hack/lock.sh`"
    (version,) = locked[name]
    assert req.specifier.contains(version, prereleases=True), f"{req}: locked {version}; run `bash hack/lock.sh`"


def test_torch_is_locked_apart_and_every_pin_has_hashes() -> None:
    assert "torch" in pins(TORCH) and "torch" not in pins(MAIN), "set-up may install a local torch wheel instead"
    for path in (MAIN, TORCH):
        text = path.read_text()
        entries = re.split(r"\n(?=[A-Za-z0-9])", text.split("\n", 2)[2])
        assert entries and all("--hash=sha256:" in e for e in entries if e.strip()), path.name
    assert "uv" in pins(MAIN), "hack/setup.sh takes uv's version from the lock"
