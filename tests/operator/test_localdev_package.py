"""The development stack as its own package: it finds the checkout by its files (or
$BATCHPILOT_CHECKOUT), and the operator's CLI takes its commands from entry points, skipping them
where the package is not installed (the images)."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest

import batchpilot_localdev
from batchpilot_localdev import CHECKOUT_ENV, CHECKOUT_MARKERS, checkout
from batchpilot_operator import cli
from bptest import REPO


def commands() -> list[str]:
    sub = next(a for a in cli.build_parser()._actions if a.dest == "command")
    return list(sub.choices)  # type: ignore[arg-type]


def test_the_checkout_is_found_by_its_files_wherever_the_process_runs(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(CHECKOUT_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    assert checkout() == REPO.resolve()
    assert all((checkout() / m).is_file() for m in CHECKOUT_MARKERS)


def test_the_checkout_can_be_named_and_a_wrong_one_says_what_is_missing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv(CHECKOUT_ENV, str(REPO))
    assert checkout() == REPO.resolve()
    (tmp_path / "pyproject.toml").write_text("[project]\n")
    monkeypatch.setenv(CHECKOUT_ENV, str(tmp_path))
    with pytest.raises(RuntimeError, match=r"BATCHPILOT_CHECKOUT=.* is not a batchpilot checkout \(no hack/setup.sh"):
        checkout()


def test_outside_a_checkout_the_stack_says_how_to_get_one(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv(CHECKOUT_ENV, raising=False)
    monkeypatch.setattr(batchpilot_localdev, "__file__", str(tmp_path / "site-packages" / "x" / "__init__.py"))
    with pytest.raises(RuntimeError, match="install the checkout editable"):
        checkout()


def test_a_checkout_install_adds_the_stacks_commands_after_the_operators() -> None:
    assert commands() == ["run", "validate", "profile", "tune", "demo", "up", "down", "load"]


def test_without_the_stack_installed_the_cli_offers_the_operators_commands_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # What an image holds: the distribution's entry points name a package that is not there.
    absent = [
        importlib.metadata.EntryPoint("demo", "batchpilot_not_installed.commands.demo", cli.PLUGINS),
        importlib.metadata.EntryPoint("up", "batchpilot_not_installed.commands.up", cli.PLUGINS),
    ]
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: absent if group == cli.PLUGINS else [])
    assert commands() == ["run", "validate", "profile", "tune"]


def test_a_plugin_whose_own_dependency_is_missing_fails_loudly(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # Only an absent plugin is skipped; an installed one that cannot import is not hidden.
    (tmp_path / "bp_broken_plugin.py").write_text("import bp_no_such_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    broken = [importlib.metadata.EntryPoint("bad", "bp_broken_plugin", cli.PLUGINS)]
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: broken if group == cli.PLUGINS else [])
    with pytest.raises(ModuleNotFoundError, match="bp_no_such_dependency"):
        cli.build_parser()


def test_outside_a_checkout_the_stacks_commands_explain_instead_of_breaking_the_cli(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv(CHECKOUT_ENV, raising=False)
    monkeypatch.setattr(batchpilot_localdev, "__file__", str(tmp_path / "site-packages" / "x" / "__init__.py"))
    assert commands() == ["run", "validate", "profile", "tune", "demo", "up", "down", "load"]
    assert cli.main(["demo"]) == 2
    assert "runs from a batchpilot checkout" in capsys.readouterr().err
