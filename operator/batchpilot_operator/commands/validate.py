"""`batchpilot validate`: check BatchingPolicy files offline, as a CI step before merge.

Each document of kind BatchingPolicy in each file (multi-document YAML; other kinds are
skipped) is validated with the same pydantic models the operator uses
(:mod:`batchpilot_operator.spec`, the twin of the CRD's schema and CEL rules), then, given
latency profiles (``--profile``, matched to a policy by model source), checked for
feasibility against its SLOs (:mod:`batchpilot_operator.feasibility`).

The latency model's measured error (``status.recommendation.calibration`` of the live policy:
``--calibration`` with ``kubectl get batchingpolicy NAME -o yaml``, matched by name, or the
status in the file itself) is stated per lane as a notice next to the feasibility verdict; a last
error beyond 25% and an idle-executor latency that the measured correction puts over the SLO are
warnings.

Output: ``-o text`` (default; ``file:line: severity: policy[/lane] field: message``),
``-o json`` (``{"ok", "files", "policies", "findings": [...]}``), ``-o github`` (workflow
commands, ``::error file=...,line=...::message``, shown as annotations on the pull request).
Exit code 1 when any error was found, 0 otherwise (warnings do not fail).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

import yaml
from pydantic import ValidationError

from batchpilot_operator.commands import add_command
from batchpilot_operator.feasibility import check_policy, check_rollout, lane_budget, ms
from batchpilot_operator.spec import API_VERSION, KIND, parse_spec
from batchpilot_operator.tune.calibration import (
    TOLERANCE,
    UNMEASURED,
    LaneCalibration,
    load_calibration,
    policy_calibration,
)
from batchpilot_operator.tune.profile import LatencyProfile, load_profile

NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


@dataclass
class Problem:
    file: str
    severity: str
    message: str
    line: int | None = None
    policy: str | None = None
    lane: str | None = None
    field: str | None = None
    check: str = "schema"


@dataclass
class Report:
    files: int = 0
    policies: int = 0
    problems: list[Problem] | None = None

    @property
    def errors(self) -> int:
        return sum(1 for p in self.problems or [] if p.severity == "error")

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.errors == 0,
            "files": self.files,
            "policies": self.policies,
            "errors": self.errors,
            "warnings": sum(1 for p in self.problems or [] if p.severity == "warning"),
            "findings": [asdict(p) for p in self.problems or []],
        }


def register(sub: Any) -> None:
    p = add_command(
        sub,
        "validate",
        "validate BatchingPolicy files offline (schema, CEL-equivalent rules, SLO feasibility)",
        __doc__,
    )
    p.add_argument("files", nargs="+", type=Path, help="YAML files (multi-document); directories: their *.yaml")
    p.add_argument(
        "--profile",
        action="append",
        default=[],
        type=Path,
        help="a latency profile (`batchpilot profile`); repeatable, matched to policies by model source",
    )
    p.add_argument(
        "--calibration",
        action="append",
        default=[],
        type=Path,
        help="a live BatchingPolicy with its status (kubectl get batchingpolicy NAME -o yaml): the model's "
        "measured error per lane, matched to policies by name; repeatable",
    )
    p.add_argument("-o", "--output", choices=["text", "json", "github"], default="text")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    report = validate_paths(list(args.files), list(args.profile), list(args.calibration))
    render(report, args.output, sys.stdout)
    return 1 if report.errors else 0


# --------------------------------------------------------------------------- validation


def expand(paths: list[Path]) -> list[Path]:
    out: list[Path] = []
    for path in paths:
        if path.is_dir():
            out.extend(sorted(p for p in path.iterdir() if p.suffix in (".yaml", ".yml") and p.is_file()))
        else:
            out.append(path)
    return out


def validate_paths(paths: list[Path], profile_paths: list[Path], calibration_paths: list[Path] | None = None) -> Report:
    report = Report(problems=[])
    problems: list[Problem] = report.problems  # type: ignore[assignment]
    calibrations: dict[str, dict[str, LaneCalibration]] = {}
    for cp in calibration_paths or []:
        try:
            for live in yaml.safe_load_all(cp.read_text()):
                if isinstance(live, dict) and live.get("kind") == KIND:
                    calibrations[str((live.get("metadata") or {}).get("name"))] = load_calibration(live)
        except (OSError, ValueError, yaml.YAMLError) as exc:
            problems.append(
                Problem(str(cp), "error", f"cannot read the calibration: {_one_line(exc)}", check="calibration")
            )
    profiles: dict[str, LatencyProfile] = {}
    for pp in profile_paths:
        try:
            prof = load_profile(pp)
        except (OSError, ValueError, yaml.YAMLError) as exc:
            problems.append(
                Problem(str(pp), "error", f"cannot read the latency profile: {_one_line(exc)}", check="profile")
            )
            continue
        profiles[prof.model.source] = prof
    for path in expand(paths):
        report.files += 1
        problems.extend(validate_file(path, profiles, report, calibrations))
    return report


def validate_file(
    path: Path,
    profiles: dict[str, LatencyProfile],
    report: Report | None = None,
    calibrations: dict[str, dict[str, LaneCalibration]] | None = None,
) -> list[Problem]:
    name = str(path)
    try:
        text = path.read_text()
    except OSError as exc:
        return [Problem(name, "error", f"cannot read: {exc.strerror or exc}")]
    try:
        nodes = list(yaml.compose_all(text, Loader=yaml.SafeLoader))
        docs = list(yaml.safe_load_all(text))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = mark.line + 1 if mark is not None else None
        return [Problem(name, "error", f"not valid YAML: {_one_line(exc)}", line=line, check="yaml")]
    problems: list[Problem] = []
    for node, doc in zip(nodes, docs, strict=True):
        if not isinstance(doc, dict) or doc.get("kind") != KIND:
            continue
        if report is not None:
            report.policies += 1
        problems.extend(validate_document(name, node, doc, profiles, calibrations))
    return problems


def validate_document(
    file: str,
    node: yaml.Node,
    doc: dict[str, Any],
    profiles: dict[str, LatencyProfile],
    calibrations: dict[str, dict[str, LaneCalibration]] | None = None,
) -> list[Problem]:
    meta = doc.get("metadata") if isinstance(doc.get("metadata"), dict) else {}
    assert isinstance(meta, dict)
    policy = meta.get("name") if isinstance(meta.get("name"), str) else None
    doc_line = node.start_mark.line + 1
    problems: list[Problem] = []

    def problem(severity: str, message: str, path: tuple[Any, ...] = (), **kw: Any) -> None:
        problems.append(Problem(file, severity, message, line=_line_of(node, path) or doc_line, policy=policy, **kw))

    if doc.get("apiVersion") != API_VERSION:
        problem(
            "error",
            f"apiVersion must be {API_VERSION}, got {doc.get('apiVersion')!r}",
            ("apiVersion",),
            field="apiVersion",
        )
    if policy is None:
        problem("error", "metadata.name is required", ("metadata",), field="metadata.name")
    elif len(policy) > 253 or not NAME_RE.match(policy):
        problem("error", f"metadata.name {policy!r} is not a valid Kubernetes name (RFC 1123 subdomain)",
                ("metadata", "name"), field="metadata.name")  # fmt: skip
    spec_raw = doc.get("spec")
    if not isinstance(spec_raw, dict):
        problem("error", "spec is required and must be a mapping", ("spec",), field="spec")
        return problems
    try:
        spec = parse_spec(spec_raw)
    except ValidationError as exc:
        for err in exc.errors():
            loc = tuple(err["loc"])
            field = _field_path(loc)
            msg = str(err["msg"]).removeprefix("Value error, ")
            lane = _lane_at(spec_raw, loc)
            text = msg if msg.startswith("spec.") else f"{field}: {msg}"
            problem("error", text, ("spec", *loc), field=field, lane=lane)
        return problems
    for finding in check_rollout(spec):
        problem(
            finding.severity, finding.message, _loc_of_field(finding.field), field=finding.field, check=finding.check
        )
    profile = profiles.get(spec.model.source)
    if profile is None:
        if profiles:
            problem(
                "warning",
                f"no latency profile for model source {spec.model.source} was given: SLO feasibility not checked",
                ("spec", "model", "source"),
                field="spec.model.source",
                check="profile",
            )
        return problems
    for finding in check_policy(spec, profile):
        path = _loc_of_field(finding.field)
        problem(finding.severity, finding.message, path, field=finding.field, lane=finding.lane, check=finding.check)
    lanes_cal = (calibrations or {}).get(str(policy)) or policy_calibration(doc)
    if lanes_cal is None:
        problem("info", UNMEASURED, check="calibration")
        return problems
    for i, lane_spec in enumerate(spec.lanes):
        cal = lanes_cal.get(lane_spec.name)
        if cal is None:
            continue
        path = ("spec", "lanes", i)
        problem("info", cal.summary(), path, lane=lane_spec.name, check="calibration")
        if cal.within_tolerance is False:
            problem(
                "warning",
                f"the latency model missed this lane's p99 by more than {TOLERANCE:.0%} in its last live window: "
                "the feasibility figures above rest on the profile and may be off by as much",
                path,
                lane=lane_spec.name,
                check="calibration",
            )
        b = lane_budget(spec, lane_spec, profile)
        if cal.correction > 1 and b.best_case_worst <= b.slo < b.best_case_worst * cal.correction:
            problem(
                "warning",
                f"window + full batch + overhead = {ms(b.best_case_worst)} is {ms(b.best_case_worst * cal.correction)} "
                f"with the lane's measured correction x{cal.correction:.3g}, over the p99 SLO {ms(b.slo)}",
                (*path, "maxQueueDelay"),
                field=f"spec.lanes[{i}].maxQueueDelay",
                lane=lane_spec.name,
                check="calibration",
            )
    return problems


def _field_path(loc: tuple[Any, ...]) -> str:
    out = "spec"
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}"
    return out


def _loc_of_field(field: str | None) -> tuple[Any, ...]:
    if not field:
        return ()
    parts: list[Any] = []
    for token in re.findall(r"[^.\[\]]+|\[\d+\]", field):
        parts.append(int(token[1:-1]) if token.startswith("[") else token)
    return tuple(parts)


def _lane_at(spec: dict[str, Any], loc: tuple[Any, ...]) -> str | None:
    if len(loc) >= 2 and loc[0] == "lanes" and isinstance(loc[1], int):
        lanes = spec.get("lanes")
        if isinstance(lanes, list) and loc[1] < len(lanes) and isinstance(lanes[loc[1]], dict):
            name = lanes[loc[1]].get("name")
            return str(name) if name is not None else None
    return None


def _line_of(node: yaml.Node, path: tuple[Any, ...]) -> int | None:
    """1-based line of the deepest node along ``path`` that exists in the document."""
    line = node.start_mark.line + 1
    current = node
    for part in path:
        nxt: yaml.Node | None = None
        if isinstance(current, yaml.MappingNode) and isinstance(part, str):
            for key, value in current.value:
                if isinstance(key, yaml.ScalarNode) and key.value == part:
                    line = key.start_mark.line + 1
                    nxt = value
                    break
        elif isinstance(current, yaml.SequenceNode) and isinstance(part, int) and part < len(current.value):
            nxt = current.value[part]
            line = nxt.start_mark.line + 1
        if nxt is None:
            break
        current = nxt
    return line


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


# --------------------------------------------------------------------------- output


def render(report: Report, output: str, out: TextIO) -> None:
    problems = report.problems or []
    if output == "json":
        json.dump(report.to_json(), out, indent=2)
        out.write("\n")
        return
    if output == "github":
        for p in problems:
            level = {"error": "error", "warning": "warning"}.get(p.severity, "notice")
            props = f"file={_gh_prop(p.file)}"
            if p.line:
                props += f",line={p.line}"
            title = "batchpilot validate" + (f": {p.policy}" if p.policy else "") + (f"/{p.lane}" if p.lane else "")
            props += f",title={_gh_prop(title)}"
            out.write(f"::{level} {props}::{_gh_data(p.message)}\n")
        out.write(_summary(report) + "\n")
        return
    for p in problems:
        where = f"{p.file}:{p.line}" if p.line else p.file
        who = (p.policy or "") + (f"/{p.lane}" if p.lane else "")
        out.write(f"{where}: {p.severity}: {who + ': ' if who else ''}{p.message}\n")
    out.write(_summary(report) + "\n")


def _summary(report: Report) -> str:
    warnings = sum(1 for p in report.problems or [] if p.severity == "warning")
    verdict = "FAILED" if report.errors else "OK"
    return (
        f"{verdict}: {report.policies} polic{'y' if report.policies == 1 else 'ies'} in {report.files} "
        f"file(s), {report.errors} error(s), {warnings} warning(s)"
    )


def _gh_data(text: str) -> str:
    return text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")


def _gh_prop(text: str) -> str:
    return _gh_data(text).replace(":", "%3A").replace(",", "%2C")
