"""Real A/A rollouts on the local stack, against the simulator's cell at the same traffic.

``bench/canary_eval.py`` estimates the verdict's false-rollback rate from simulated rollouts.
This checks the simulator against reality: the local control plane, a real Prometheus
scraping every second, the operator, one runtime process per pod (``batchpilot_localdev/harness.py``),
and the code trace replayed open loop at ``--rate`` (``canary_eval.make_trace``, cycled) over
the policy's ready pods (the replica ratio: each request to a uniformly chosen ready pod, as a
Service routes). The policy is the simulator's (``canary_eval.policy``: 4 replicas, batch 8, window 2 ms, steps 25% and 50% of
20 s, an analysis every 15 s, failureLimit 2). Each A/A rollout changes only
``maxQueueLength`` (a new revision that batches exactly as the old one: the queue never fills
at this load) and runs until it is promoted, rolled back or held (Stalled), or ``--timeout``.

Then ``canary_eval.py`` runs the same cell (code trace, 4 replicas, replica ratio, A/A) at the
same rate, and both are written side by side: the share rolled back, the analyses and seconds
to promotion.

    .venv/bin/python bench/real_aa.py --rollouts 20 --rate 24 --out bench/results/real_aa.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from batchpilot_localdev.cluster import LocalCluster  # noqa: E402
from batchpilot_localdev.harness import RuntimeHarness  # noqa: E402
from batchpilot_localdev.load import TraceReplay  # noqa: E402
from batchpilot_localdev.prometheus import PrometheusServer  # noqa: E402
from batchpilot_localdev.scenario import start_operator  # noqa: E402
from batchpilot_operator.analysis import Outcome, combine  # noqa: E402
from batchpilot_operator.spec import parse_spec  # noqa: E402
from canary_eval import make_trace  # noqa: E402

POLICY, NAMESPACE, MODEL = "aa", "bench", "mlp"
QUEUE = 512


def manifest(queue: int) -> dict[str, Any]:
    """``canary_eval.policy(8, 2, queue)`` as a manifest, on the local runtime image."""
    return {
        "apiVersion": "batchpilot.dev/v1alpha1",
        "kind": "BatchingPolicy",
        "metadata": {"name": POLICY, "namespace": NAMESPACE},
        "spec": {
            "model": {
                "name": MODEL,
                "image": "ghcr.io/batchpilot/runtime:0.1.0",
                "source": "builtin:mlp",
                "device": "cpu",
                "dtype": "float32",
                "threads": 1,
            },
            "replicas": 4,
            "resources": {"gpus": 1},
            "lanes": [
                {
                    "name": "interactive",
                    "maxBatchSize": 8,
                    "maxQueueDelay": "2ms",
                    "maxQueueLength": queue,
                    "requestTimeout": "1s",
                }
            ],
            "slo": {"p99Latency": "120ms", "maxQueueAge": "60ms", "maxErrorRate": 0.01},
            "rollout": {
                "steps": [{"weight": 25, "pause": "20s"}, {"weight": 50, "pause": "20s"}],
                "analysisInterval": "15s",
                "failureLimit": 2,
                "minSamples": 100,
                "maxInconclusive": 10,
            },
        },
    }


class Stack:
    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.cluster = LocalCluster.start(workdir / "cluster", gpu_nodes=2)
        self.prom: PrometheusServer | None = None
        self.harness: RuntimeHarness | None = None
        self.operator: subprocess.Popen[bytes] | None = None
        try:
            self.kubectl("apply", "-f", str(ROOT / "crds" / "batchingpolicy.yaml"))
            self.cluster.wait_established("batchingpolicies.batchpilot.dev")
            self.kubectl("create", "namespace", NAMESPACE)
            self.prom = PrometheusServer(workdir / "prometheus", scrape_interval="1s")
            self.prom.start()
            self.harness = RuntimeHarness(self.cluster.kubeconfig, NAMESPACE, workdir / "runtime", self.prom).start()
            self.operator = start_operator(self.cluster.kubeconfig, self.prom.url, workdir / "operator.log", NAMESPACE)
        except BaseException:
            self.stop()
            raise

    def kubectl(self, *args: str, stdin: str | None = None) -> str:
        result = subprocess.run(
            [str(self.cluster.bin_dir / "kubectl"), f"--kubeconfig={self.cluster.kubeconfig}", *args],
            input=stdin,
            capture_output=True,
            text=True,
            check=True,
        )
        return result.stdout

    def apply(self, doc: dict[str, Any]) -> None:
        self.kubectl("apply", "--server-side", "--field-manager=argocd-controller", "-f", "-", stdin=json.dumps(doc))

    def status(self) -> dict[str, Any]:
        doc = json.loads(self.kubectl("get", "batchingpolicy", POLICY, "-n", NAMESPACE, "-o", "json"))
        status: dict[str, Any] = doc.get("status") or {}
        return status

    def stop(self) -> None:
        if self.operator is not None and self.operator.poll() is None:
            self.operator.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.operator.wait(timeout=15)
        if self.harness is not None:
            self.harness.stop()
        if self.prom is not None:
            self.prom.stop()
        self.cluster.stop()


def outcome_of(status: dict[str, Any], revision: str) -> str | None:
    if status.get("stableRevision") == revision and status.get("phase") == "Healthy":
        return "Promoted"
    if status.get("phase") == "RolledBack" and status.get("desiredRevision") == revision:
        return "RolledBack"
    for c in status.get("conditions") or []:
        if c.get("type") == "Stalled" and c.get("status") == "True" and c.get("reason") == "InconclusiveLimit":
            return "Held"
    return None


def one_rollout(stack: Stack, queue: int, timeout: float) -> dict[str, Any]:
    doc = manifest(queue)
    revision = parse_spec(doc["spec"]).revision()
    applied = time.time()
    stack.apply(doc)
    return {"revision": revision, **follow(stack.status, revision, applied, timeout, outcome_of)}


def follow(
    status: Callable[[], dict[str, Any]],
    revision: str,
    applied: float,
    timeout: float,
    ended: Callable[[dict[str, Any], str], str | None],
    poll: float = 1.0,
) -> dict[str, Any]:
    """Read the policy's status every ``poll`` seconds until ``ended`` says how the rollout of
    ``revision`` (applied at ``applied``) ended, or ``timeout``; the record of a real rollout
    (this bench's and ``gateway_example.py``'s): its outcome and time, its analyses, where the
    time went (each step's entry and the start of its clock: its canary pods all ready, plus the
    warm-up; every analysis window: when, and its worst objective) and the decisions."""
    t0 = time.monotonic()
    seen: dict[str, dict[str, Any]] = {}
    steps: dict[int, dict[str, float | None]] = {}  # per step: entered, clock started (s after apply)
    outcome, st = None, {}
    load_max = 0.0  # the machine's busiest minute while the rollout ran: the benches need it to themselves
    while time.monotonic() - t0 < timeout:
        load_max = max(load_max, os.getloadavg()[0])
        st = status()
        for entry in st.get("ledger") or []:
            if entry.get("kind") == "Analysis" and entry.get("revision") == revision:
                seen[f"{entry.get('time')}/{entry.get('metric')}/{entry.get('tenant')}"] = entry
        rollout = st.get("rollout") or {}
        if rollout.get("revision") == revision:
            step = steps.setdefault(int(rollout.get("stepIndex", 0)), {"entered": None, "clock_started": None})
            step["entered"] = since(applied, rollout.get("stepEnteredAt"))
            step["clock_started"] = since(applied, rollout.get("stepStartedAt"))
        outcome = ended(st, revision)
        if outcome is not None:
            break
        time.sleep(poll)
    decided = [e for e in st.get("ledger") or [] if e.get("revision") == revision and e.get("kind") != "Analysis"]
    analysed = windows(seen.values(), applied)
    return {
        "outcome": outcome or "unfinished",
        "seconds": round(time.monotonic() - t0, 1),
        "analyses": len(analysed),
        "failed_analyses": sum(w["outcome"] == Outcome.FAILED for w in analysed),
        "evidence": [e.get("evidence") for e in decided if e.get("kind") in ("RolledBack", "Stalled")][:3],
        "steps": [{"step": i, **v} for i, v in sorted(steps.items())],
        "windows": analysed,
        "decisions": [
            {"kind": e.get("kind"), "at": since(applied, e.get("time")), "reason": e.get("reason")} for e in decided
        ],
        "loadavg_1m": os.getloadavg()[0],
        "loadavg_1m_max": round(load_max, 2),
    }


def since(applied: float, stamp: Any) -> float | None:
    """Seconds from the apply to a status timestamp (RFC 3339), or None."""
    if not stamp:
        return None
    return round(datetime.fromisoformat(str(stamp).replace("Z", "+00:00")).timestamp() - applied, 1)


def windows(entries: Any, applied: float) -> list[dict[str, Any]]:
    """One row per analysis window: seconds after the apply, the worst objective's outcome, and
    the evidence of the objectives that were not Successful (why a window did not pass)."""
    by_time: dict[str, list[dict[str, Any]]] = {}
    for e in entries:
        by_time.setdefault(str(e.get("time")), []).append(e)
    rows = []
    for stamp, group in sorted(by_time.items()):
        rows.append(
            {
                "at": since(applied, stamp),
                "outcome": combine([Outcome(str(e.get("outcome"))) for e in group]).value,
                "why": sorted(
                    {f"{e.get('metric')}: {e.get('evidence')}" for e in group if e.get("outcome") != "Successful"}
                ),
            }
        )
    return rows


def simulator_cell(rate: float, rollouts: int, out: Path) -> dict[str, Any]:
    """canary_eval's cell code/4r/ratio, A/A, at ``rate``."""
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "canary_eval.py"),
            "--rollouts",
            str(rollouts),
            "--traces",
            "code",
            "--replicas",
            "4",
            "--routings",
            "ratio",
            "--scenarios",
            "aa",
            "--rate",
            str(rate),
            "--workers",
            "1",
            "--out",
            str(out),
        ],
        check=True,
    )
    rows: list[dict[str, Any]] = json.loads(out.read_text())["rows"]
    return rows[0]


def mean(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 1) if values else None


def summarize_real(rollouts: list[dict[str, Any]], late_sends: int | None) -> dict[str, Any]:
    """The real rollouts' outcomes, as canary_eval writes a cell's (shares of the rollouts)."""
    n = len(rollouts)
    promoted = [r for r in rollouts if r["outcome"] == "Promoted"]
    return {
        "rollouts": n,
        # shares, as canary_eval writes them
        "rolled_back": round(sum(r["outcome"] == "RolledBack" for r in rollouts) / max(1, n), 4),
        "promoted": round(len(promoted) / max(1, n), 4),
        "held": round(sum(r["outcome"] == "Held" for r in rollouts) / max(1, n), 4),
        "unfinished": round(sum(r["outcome"] == "unfinished" for r in rollouts) / max(1, n), 4),
        "mean_seconds_to_promotion": round(sum(r["seconds"] for r in promoted) / len(promoted), 1)
        if promoted
        else None,
        "mean_analyses_to_promotion": round(sum(r["analyses"] for r in promoted) / len(promoted), 2)
        if promoted
        else None,
        "failed_analyses": sum(r["failed_analyses"] for r in rollouts),
        "analyses": sum(r["analyses"] for r in rollouts),
        # where a promoted rollout's time went (the simulator has every pod ready at once)
        "mean_seconds_waiting_for_canary_pods": mean(
            [
                s["clock_started"] - s["entered"]
                for r in promoted
                for s in r.get("steps", [])
                if s["clock_started"] is not None and s["entered"] is not None
            ]
        ),
        "windows_by_outcome": dict(
            sorted(Counter(w["outcome"] for r in rollouts for w in r.get("windows", [])).items())
        ),
        "replay_late_sends": late_sends,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rollouts", type=int, default=20)
    p.add_argument("--rate", type=float, default=24.0, help="req/s of the replayed code trace over the policy")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds a rollout may take before it is unfinished")
    p.add_argument("--sim-rollouts", type=int, default=100)
    p.add_argument("--workdir", type=Path, default=Path("/tmp/batchpilot-real-aa"))
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    started = time.time()
    stack = Stack(args.workdir)
    replay: TraceReplay | None = None
    rollouts: list[dict[str, Any]] = []
    try:
        stack.apply(manifest(QUEUE))
        assert stack.harness is not None
        stack.harness.wait_ready(POLICY, 4, timeout=300)
        harness = stack.harness
        # The simulator's arrivals: the code trace at --rate, cycled for as long as the rollouts
        # can take (the trace alone lasts a few minutes).
        arrivals = make_trace("code", args.rate, 60 + args.rollouts * args.timeout, random.Random(0))
        replay = TraceReplay(arrivals, lambda: harness.endpoints(POLICY), MODEL).start()
        time.sleep(20)  # the stable's first windows fill before the first change (load, not a wait)
        for i in range(1, args.rollouts + 1):
            r = one_rollout(stack, QUEUE + i, args.timeout)
            rollouts.append(r)
            # what has run so far survives an interrupted run
            partial = {"rate": args.rate, "real": summarize_real(rollouts, len(replay.late)), "rollouts": rollouts}
            args.out.with_suffix(".partial.json").write_text(json.dumps(partial, indent=1))
            print(
                f"[real_aa] {i}/{args.rollouts}: {r['outcome']} in {r['seconds']}s, {r['analyses']} analyses",
                flush=True,
            )
    finally:
        if replay is not None:
            replay.stop()
        stack.stop()
    real = summarize_real(rollouts, len(replay.late) if replay is not None else None)
    sim = simulator_cell(args.rate, args.sim_rollouts, args.out.with_suffix(".sim.json"))
    doc = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "started": started,
        "elapsed_s": round(time.time() - started, 1),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "rate": args.rate,
        "policy": manifest(QUEUE)["spec"],
        "real": real,
        "simulated": sim,
        "rollouts": rollouts,
    }
    args.out.write_text(json.dumps(doc, indent=1))
    print(json.dumps({"real": real, "simulated": sim}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
