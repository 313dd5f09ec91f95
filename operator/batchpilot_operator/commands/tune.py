"""`batchpilot tune`: batching settings for one lane, derived from a real arrival trace.

Simulates the runtime's batcher over the trace (time-scaled, bursts kept) with the model's
latency profile, searches max batch size and window for the highest sustainable rate
within the lane's p99 and queue-age SLOs less a safety margin, and prints the
recommendation as a policy patch. It never applies anything: commit the patch, and let
the rollout (canary + analysis) check the prediction against real traffic.

With ``--policy`` the SLOs, lane limits, replicas and expected rate come from the
BatchingPolicy, and the patch is an RFC 6902 JSON patch against it (guarded by a ``test``
of the lane's name, for ``kubectl patch --type json`` or a kustomize ``patches:`` entry).
Without it, the output is the lane block to paste under ``spec.lanes``.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
from pathlib import Path
from typing import Any

import yaml

from batchpilot_operator.commands import add_command
from batchpilot_operator.spec import KIND, LaneSpec, PolicySpec, parse_spec
from batchpilot_operator.tune.calibration import UNMEASURED, LaneCalibration, load_calibration, policy_calibration
from batchpilot_operator.tune.profile import load_profile
from batchpilot_operator.tune.search import SLOTargets, TuneResult, result_dict, search
from batchpilot_operator.tune.trace import load_trace
from batchpilot_runtime.config import format_duration, parse_duration

DEFAULT_LANE = "interactive"


def register(subparsers: Any) -> None:
    p = add_command(
        subparsers,
        "tune",
        "recommend a lane's max batch size and window from an arrival trace (a policy patch)",
        __doc__,
    )
    p.add_argument("--trace", required=True, help="arrival trace: Azure CSV or one timestamp (s) per line")
    p.add_argument("--profile", required=True, help="latency profile from `batchpilot profile`")
    p.add_argument(
        "--spread-buckets",
        help="the trace's timestamps are rounded to buckets of this length (e.g. 3s): spread each bucket's "
        "requests uniformly over it (seeded by --seed) instead of replaying them as one burst",
    )
    p.add_argument("--policy", help="a BatchingPolicy YAML: SLOs, lane and replicas from it; patch against it")
    p.add_argument("--lane", help=f"lane name (default: the policy's default lane, else {DEFAULT_LANE!r})")
    p.add_argument("--p99", help="lane p99 latency SLO, e.g. 50ms (overrides the policy)")
    p.add_argument("--queue-age", help="lane p99 queue-age SLO, e.g. 20ms (overrides the policy)")
    p.add_argument("--replicas", type=int, help="runtime replicas sharing the traffic (default: policy's, else 1)")
    p.add_argument(
        "--rate",
        type=float,
        help="target mean rate, requests/s, all replicas (default: the lane's expectedRate, else the trace's own rate)",
    )
    p.add_argument("--margin", type=float, default=0.2, help="safety margin: predicted p99 <= (1-margin) x SLO")
    p.add_argument("--max-batch", type=int, help="largest batch size to consider (default: profile's largest)")
    p.add_argument("--max-queue-length", type=int, help="default: the policy lane's, else 1024")
    p.add_argument("--request-timeout", help="default: the policy lane's, else 4 x p99 SLO")
    p.add_argument(
        "--split",
        choices=["random", "round-robin"],
        default="random",
        help="how the Service spreads requests over replicas (default random, as kube-proxy)",
    )
    p.add_argument("--exec-quantile", choices=["p50", "p90", "p99", "mean"], help="default: the profile's")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-o", "--output", choices=["text", "json", "yaml"], default="text")
    p.add_argument("--patch-out", help="also write the patch (YAML) to this file")
    p.add_argument(
        "--calibration",
        help="the model's measured error for this lane, to apply and print: a BatchingPolicy with its status "
        "(kubectl get batchingpolicy NAME -o yaml) or its status.recommendation.calibration "
        "(default: the --policy file's status, if it has one)",
    )
    p.set_defaults(func=run)


def _load_policy(path: str) -> tuple[dict[str, Any], PolicySpec, str]:
    """(the whole document, its parsed spec, its metadata.name) from a YAML file."""
    docs = [d for d in yaml.safe_load_all(Path(path).read_text()) if isinstance(d, dict)]
    for doc in docs:
        if doc.get("kind") == KIND and isinstance(doc.get("spec"), dict):
            name = str((doc.get("metadata") or {}).get("name", ""))
            return doc, parse_spec(doc["spec"]), name
    raise ValueError(f"{path}: no {KIND} document with a spec found")


def _duration(text: str | None) -> float | None:
    return None if text is None else parse_duration(text)


def _lane_fields(result: TuneResult) -> dict[str, Any]:
    s = result.recommended
    return {"maxBatchSize": s.max_batch_size, "maxQueueDelay": format_duration(s.max_queue_delay)}


def _prediction_comment(out: dict[str, Any], result: TuneResult, lane: str) -> str:
    p = out["predicted_at_target"]
    t = out["targets_s"]
    lines = [
        f"batchpilot tune: lane {lane}, replicas {result.replicas}",
        f"predicted at {result.target_rate:.4g} req/s: p99 {p['p99_latency_s'] * 1e3:.3g} ms, "
        f"p99 queue age {p['p99_queue_age_s'] * 1e3:.3g} ms, mean batch {p['mean_batch_size']:.3g}, "
        f"utilization {p['utilization']:.1%}",
        f"predicted capacity {result.capacity:.4g} req/s (p99 <= {t['p99_latency'] * 1e3:.3g} ms, "
        f"queue age <= {t['queue_age'] * 1e3:.3g} ms, SLO less margin)",
        out["model"]["summary"],
    ]
    return "".join(f"# {line}\n" for line in lines)


def build_patch(
    result: TuneResult,
    doc: dict[str, Any] | None,
    spec: PolicySpec | None,
    lane: str,
    lane_defaults: dict[str, Any],
) -> tuple[Any, Any]:
    """(JSON patch ops or lane block, the merge patch {spec: {lanes: [...]}}), both validated."""
    fields = _lane_fields(result)
    if doc is None or spec is None:
        block = {"name": lane, **fields, **lane_defaults}
        LaneSpec.model_validate(block)  # the block is a valid lane on its own
        return {"spec": {"lanes": [block]}}, {"spec": {"lanes": [block]}}
    index = next(i for i, ln in enumerate(doc["spec"]["lanes"]) if ln.get("name") == lane)
    ops: list[dict[str, Any]] = [{"op": "test", "path": f"/spec/lanes/{index}/name", "value": lane}]
    for key, value in fields.items():
        op = "replace" if key in doc["spec"]["lanes"][index] else "add"
        ops.append({"op": op, "path": f"/spec/lanes/{index}/{key}", "value": value})
    patched = copy.deepcopy(doc["spec"])
    patched["lanes"][index].update(fields)
    parse_spec(patched)  # the patched policy passes the same rules as admission
    return ops, {"spec": {"lanes": patched["lanes"]}}


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except (ValueError, OSError) as exc:
        print(f"tune: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    doc: dict[str, Any] | None = None
    spec: PolicySpec | None = None
    policy_name = ""
    lane = args.lane
    p99 = _duration(args.p99)
    queue_age = _duration(args.queue_age)
    replicas = args.replicas
    rate = args.rate
    max_queue_length = args.max_queue_length
    request_timeout = _duration(args.request_timeout)
    if args.policy:
        doc, spec, policy_name = _load_policy(args.policy)
        lane = lane or spec.default_lane or spec.lanes[0].name
        lane_spec = next((ln for ln in spec.lanes if ln.name == lane), None)
        if lane_spec is None:
            raise ValueError(f"lane {lane!r} is not in the policy (lanes: {[ln.name for ln in spec.lanes]})")
        slo = spec.lane_slo(lane)
        p99 = p99 if p99 is not None else slo.p99_latency
        queue_age = queue_age if queue_age is not None else slo.max_queue_age
        replicas = replicas if replicas is not None else spec.replicas
        rate = rate if rate is not None else lane_spec.expected_rate
        max_queue_length = max_queue_length or lane_spec.max_queue_length
        request_timeout = request_timeout if request_timeout is not None else lane_spec.request_timeout
    lane = lane or DEFAULT_LANE
    if p99 is None or queue_age is None:
        raise ValueError("give --p99 and --queue-age (or --policy with an SLO)")
    if not 0 <= args.margin < 1:
        raise ValueError("--margin must be in [0, 1)")
    replicas = replicas or 1
    max_queue_length = max_queue_length or 1024
    request_timeout = request_timeout if request_timeout is not None else 4 * p99

    calibration = _calibration(args.calibration, doc, policy_name, lane)
    correction = calibration.correction if calibration is not None else 1.0
    trace = load_trace(args.trace)
    if args.spread_buckets:
        trace = trace.spread(parse_duration(args.spread_buckets), args.seed)
    profile = load_profile(args.profile)
    notes: list[str] = []
    if spec is not None and spec.model.source != profile.model.source:
        notes.append(
            f"the profile measured {profile.model.source}, the policy serves {spec.model.source}: "
            "profile the policy's model on its device"
        )
    if spec is not None and spec.model.device != "auto" and not profile.model.device.startswith(spec.model.device):
        notes.append(
            f"the profile was measured on {profile.model.device!r}, the policy runs on {spec.model.device!r}: "
            "predictions hold for the profiled device only"
        )
    if correction != 1.0:
        notes.append(
            f"p99 predictions carry the lane's measured correction x{correction:.3g} (observed / model); "
            "the search ran under the SLO divided by it"
        )
    result = search(
        trace,
        profile,
        # The model's p99 times the correction must meet the SLO: search under the SLO / correction.
        SLOTargets(p99_latency=p99 / correction, queue_age=queue_age, margin=args.margin),
        replicas=replicas,
        target_rate=rate,
        max_queue_length=max_queue_length,
        request_timeout=request_timeout,
        max_batch=args.max_batch,
        split=args.split,
        seed=args.seed,
        quantile=args.exec_quantile,
    )
    result.notes[:0] = notes
    lane_defaults = {
        "maxQueueLength": max_queue_length,
        "requestTimeout": format_duration(request_timeout),
    }
    patch, merge_patch = build_patch(result, doc, spec, lane, lane_defaults)
    out = result_dict(result)
    # Stated as corrected figures against the real SLO less margin.
    out["predicted_at_target"]["p99_latency_s"] *= correction
    out["targets_s"]["p99_latency"] = p99 * (1 - args.margin)
    out["model"] = (
        {"measured": False, "correction": 1.0, "summary": UNMEASURED}
        if calibration is None
        else {"measured": bool(calibration.checks)} | calibration.to_dict()
    )
    comment = _prediction_comment(out, result, lane)
    if doc is not None:
        target = f"{KIND}/{policy_name}" if policy_name else KIND
        comment += f"# RFC 6902 patch for {target}: kubectl patch --type json, or a kustomize patches: entry\n"
    else:
        comment += "# lane block for spec.lanes of the BatchingPolicy (merge by lane name)\n"
    patch_yaml = comment + yaml.safe_dump(patch, sort_keys=False)
    if args.patch_out:
        Path(args.patch_out).write_text(patch_yaml)

    out["lane"] = lane
    out["policy"] = policy_name or None
    out["slo_s"] = {"p99_latency": p99, "queue_age": queue_age}
    out["margin"] = args.margin
    out["trace"] = {
        "source": trace.source,
        "requests": trace.count,
        "duration_s": trace.duration,
        "mean_rate_rps": trace.mean_rate,
        "gap_cv": trace.gap_cv(),
    }
    out["profile"] = {
        "model": profile.model.name,
        "device": profile.model.device,
        "quantile": args.exec_quantile or profile.quantile,
    }
    out["patch"] = patch
    out["merge_patch"] = merge_patch
    if args.output == "json":
        print(json.dumps(out, indent=2, default=_json_default))
    elif args.output == "yaml":
        print(yaml.safe_dump(json.loads(json.dumps(out, default=_json_default)), sort_keys=False))
    else:
        _print_text(out, result, patch_yaml)
    return 0


def _calibration(path: str | None, doc: dict[str, Any] | None, policy: str, lane: str) -> LaneCalibration | None:
    """The lane's calibration from ``--calibration``, else from the policy file's status (None: neither)."""
    if path is not None:
        source = yaml.safe_load(Path(path).read_text())
        if not isinstance(source, dict):
            raise ValueError(f"{path}: expected a BatchingPolicy or its status.recommendation.calibration")
        lanes = load_calibration(source, policy or None)
    else:
        found = policy_calibration(doc) if doc is not None else None
        if found is None:
            return None
        lanes = found
    if lane not in lanes:
        raise ValueError(f"the calibration has no lane {lane!r} (lanes: {sorted(lanes)})")
    return lanes[lane]


def _json_default(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    raise TypeError(type(value).__name__)


def _ms(x: float) -> str:
    return "inf" if not math.isfinite(x) else f"{x * 1e3:.3g} ms"


def _print_text(out: dict[str, Any], result: TuneResult, patch_yaml: str) -> None:
    p = out["predicted_at_target"]
    s = result.recommended
    t = out["trace"]
    srch = out["search"]
    print(
        f"trace: {t['requests']} requests over {t['duration_s']:.0f}s "
        f"(mean {t['mean_rate_rps']:.3g} req/s, gap CV {t['gap_cv']:.3g})"
    )
    print(
        f"lane {out['lane']}: SLO p99 {_ms(out['slo_s']['p99_latency'])}, queue age "
        f"{_ms(out['slo_s']['queue_age'])}; margin {out['margin']:.0%}; replicas {result.replicas}"
    )
    print(f"recommended: maxBatchSize {s.max_batch_size}, maxQueueDelay {format_duration(s.max_queue_delay)}")
    print(f"predicted capacity: {result.capacity:.4g} req/s (all replicas)")
    print(out["model"]["summary"])
    print(
        f"predicted at {result.target_rate:.4g} req/s: p99 {_ms(p['p99_latency_s'])}, "
        f"p99 queue age {_ms(p['p99_queue_age_s'])}, mean batch {p['mean_batch_size']:.3g}, "
        f"utilization {p['utilization']:.1%}, dropped {p['dropped']}, timed out {p['timeouts']}"
    )
    if out["replicas_needed"]:
        print(f"needs {out['replicas_needed']} replicas to meet the SLO at the target rate")
    print(
        f"search: {srch['candidates']} settings, {srch['simulated']} simulated, {srch['pruned']} pruned, "
        f"{srch['runs']} runs in {srch['elapsed_s']:.2f}s"
    )
    for note in result.notes:
        print(f"note: {note}")
    print()
    print(patch_yaml, end="")
