"""The shipped gateway example, applied as shipped, through the real gateway: good and bad changes.

``manifests/examples/gateway-canary.yaml`` is applied with ``kubectl apply -f`` exactly as it is
in the repository (its 2 replicas, steps 10/25/50 of 5 minutes, a 30 s warm-up and analysis
interval, p99 50 ms and queue age 10 ms, ``minCanaryLoadRatio: 0.5``; device ``cuda`` and
float16), with the HTTPRoute of ``manifests/examples/gateway/httproute.yaml`` in front of it
(only its backend ports are the local track proxies', see ``batchpilot_localdev/gateway.py``),
served by Contour and Envoy as a Gateway named ``models``. Then changes are applied the way a
pull request would change the file: only the lane's batching, everything else as shipped.

* a **good** change (``--good-change aa``, the default): an A/A, a new revision whose batching
  is the stable's: only the queue bound changes (to 1025, 1026, ...: the queue never fills at
  this load). ``--good-change batch-cap`` is the first runs' good change: the batch cap and queue
  bound raised (16 -> 32, 512 -> 1024), or back to the example's own (whichever the stable does
  not run). It assumed a batch holds one or two requests at this load; in 4 of its 5 rollouts
  with batch 32 the canary's share of requests over the queue-age SLO at the 50% step was above
  the stable's (1.4-2.1% against 0.6-0.8% in the one that held), so it is no sure A/A here. A
  longer window is no good change either: on this machine's CPU the model takes 4-9 ms a batch
  (on a GPU, well under 1), the stable's p99 queue age is already 14-16 ms against the example's
  10 ms SLO, and every millisecond of window adds to it;
* a **bad** change: a window of 20 ms (twice the queue-age SLO), or batch 64 with a 45 ms
  window (under the 50 ms p99, so admission lets both through: they fail only in service),
  each with a queue bound one above the last bad change's, so that every one is a new revision.

Each rollout runs until it is promoted, rolled back or stalled (any ``Stalled`` condition), or
``--timeout``; a canary still in flight then (stalled, unfinished) is aborted the way on-call
would (``batchpilot.dev/abort``) and the next change waits for the stable, so every rollout
starts from a stable policy (``aborted`` in its record). Its outcome, its time, its analysis windows (when, the worst objective, why a
window did not pass) and the operator's decisions are written to ``--out`` after each rollout,
appended to what it already holds (runs of several sessions add up; a TERM stops cleanly).

The local stack differs from a cluster in one way that touches the file: kwok's GPU nodes are
fake, so the runtime harness runs the policy's ``cuda`` model on this machine's CPU (the
harness's ``device="auto"``; the policy as applied still says ``cuda``). ``--namespaces N``
runs N copies, each in its own namespace with its own Gateway, under one operator and one
Prometheus (the example's 5-minute pauses make one good rollout take about 17 minutes); on a
2-core machine keep 1: with 3 copies the 9 runtime processes' model calls on the CPU put the
stable's p99 at 285 ms against the example's 50 ms SLO, and no verdict means anything there. The load is Poisson at ``--rate`` per namespace, sent to the Gateway's listener:
Envoy splits it by the route's weights, as in a cluster.

    .venv/bin/python bench/gateway_example.py --good 10 --bad 10 --out bench/results/gateway_example.json
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import platform
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

from batchpilot_localdev.cluster import LocalCluster  # noqa: E402
from batchpilot_localdev.gateway import LocalGateway  # noqa: E402
from batchpilot_localdev.harness import RuntimeHarness  # noqa: E402
from batchpilot_localdev.load import TraceReplay  # noqa: E402
from batchpilot_localdev.prometheus import PrometheusServer, ScrapeTarget  # noqa: E402
from batchpilot_localdev.scenario import start_operator  # noqa: E402
from batchpilot_operator.analysis.objectives import LATENCY_METRIC, QUEUE_AGE_METRIC  # noqa: E402
from batchpilot_operator.rollout.inputs import ABORT_ANNOTATION  # noqa: E402
from batchpilot_operator.spec import parse_spec  # noqa: E402
from canary_eval import make_trace  # noqa: E402
from real_aa import follow  # noqa: E402

EXAMPLE = ROOT / "manifests" / "examples" / "gateway-canary.yaml"
ROUTE = ROOT / "manifests" / "examples" / "gateway" / "httproute.yaml"
GOOD_BATCH_CAP = ({"maxBatchSize": 16, "maxQueueLength": 512}, {"maxBatchSize": 32, "maxQueueLength": 1024})
AA_QUEUE_BOUND = 1025
"""The A/A good change's first queue bound (one more per good change: each a new revision)."""
BAD_CHANGES: tuple[dict[str, Any], ...] = (
    {"maxQueueDelay": "20ms"},
    {"maxQueueDelay": "45ms", "maxBatchSize": 64},
)


class SharedTargets:
    """One Prometheus for several runtime harnesses: each harness's targets (its namespace's
    pods, labelled with the namespace) are kept apart and the union is written."""

    def __init__(self, prom: PrometheusServer) -> None:
        self.prom = prom
        self.lock = threading.Lock()
        self.by_key: dict[str, list[ScrapeTarget]] = {}

    def view(self, key: str) -> PrometheusServer:
        shared = self

        class _View:
            def set_targets(self, targets: Sequence[ScrapeTarget]) -> None:
                with shared.lock:
                    shared.by_key[key] = list(targets)
                    shared.prom.set_targets([t for ts in shared.by_key.values() for t in ts])

        return _View()  # type: ignore[return-value]  # RuntimeHarness only sets targets


def outcome_of(status: dict[str, Any], revision: str) -> str | None:
    """How the rollout of ``revision`` ended, from a status that has seen it (None: not yet).
    A ``Stalled`` condition counts only while this revision's canary is the rollout: after a
    rollback the condition stays True (reason RolledBack) until the next change is reconciled."""
    if status.get("desiredRevision") != revision:
        return None
    if status.get("stableRevision") == revision and status.get("phase") == "Healthy":
        return "Promoted"
    if status.get("phase") == "RolledBack":
        return "RolledBack"
    if (status.get("rollout") or {}).get("revision") != revision:
        return None
    for c in status.get("conditions") or []:
        if c.get("type") == "Stalled" and c.get("status") == "True":
            return f"Stalled:{c.get('reason')}"
    return None


class Lane:
    """One namespace: its Gateway, runtime harness, route, the example policy and its load."""

    def __init__(
        self,
        cluster: LocalCluster,
        prom: PrometheusServer,
        shared: SharedTargets,
        ns: str,
        rate: float,
        seed: int,
        good_change: str = "aa",
    ) -> None:
        self.cluster, self.prom, self.ns, self.rate, self.good_change = cluster, prom, ns, rate, good_change
        self.kubectl_bin = str(cluster.bin_dir / "kubectl")
        self.example = yaml.safe_load(EXAMPLE.read_text())
        self.name = self.example["metadata"]["name"]
        self.kubectl("create", "namespace", ns)
        workdir = cluster.workdir.parent / ns
        self.harness = RuntimeHarness(
            cluster.kubeconfig, ns, workdir / "runtime", shared.view(ns), device="auto"
        ).start()
        self.gateway = LocalGateway(
            cluster.kubeconfig, self.kubectl_bin, workdir / "gateway", ns, self.harness.endpoints
        )
        self.gateway.gateway = yaml.safe_load(ROUTE.read_text())["spec"]["parentRefs"][0]["name"]
        self.gateway.start()
        self.gateway.add_policy(self.name)
        route = yaml.safe_load(ROUTE.read_text())
        route["metadata"]["namespace"] = ns
        for ref in route["spec"]["rules"][0]["backendRefs"]:
            track = ref["name"].rsplit("-", 1)[1]
            ref["port"] = self.gateway.proxy.ports[(self.name, track)]
        self.kubectl("apply", "--server-side", "--field-manager=argocd-controller", "-f", "-", stdin=json.dumps(route))
        # The example exactly as the repository has it.
        self.kubectl("apply", "-n", ns, "-f", str(EXAMPLE))
        self.stable_lane = dict(self.example["spec"]["lanes"][0])
        self.replay: TraceReplay | None = None
        self.seed = seed

    def kubectl(self, *args: str, stdin: str | None = None) -> str:
        return subprocess.run(
            [self.kubectl_bin, f"--kubeconfig={self.cluster.kubeconfig}", *args],
            input=stdin,
            capture_output=True,
            text=True,
            check=True,
        ).stdout

    def status(self) -> dict[str, Any]:
        doc = json.loads(self.kubectl("get", "batchingpolicy", self.name, "-n", self.ns, "-o", "json"))
        status: dict[str, Any] = doc.get("status") or {}
        return status

    def start_load(self, seconds: float) -> None:
        self.harness.wait_ready(self.name, self.example["spec"]["replicas"], timeout=300)
        self.gateway.wait_serving(f"/v2/models/{self.example['spec']['model']['name']}/ready", timeout=120)
        front = [self.gateway.front()]
        arrivals = make_trace("poisson", self.rate, seconds, random.Random(self.seed))
        self.replay = TraceReplay(arrivals, lambda: front, self.example["spec"]["model"]["name"]).start()

    def change(self, kind: str, index: int) -> dict[str, Any]:
        """The example with its one lane changed: good is an A/A (the queue bound only) or the
        GOOD_BATCH_CAP the stable does not run, bad one of BAD_CHANGES (on the stable's lane)."""
        doc: dict[str, Any] = copy.deepcopy(self.example)
        lane = doc["spec"]["lanes"][0]
        lane.update(self.stable_lane)
        if kind == "good" and self.good_change == "aa":
            lane["maxQueueLength"] = AA_QUEUE_BOUND + index
        elif kind == "good":
            lane.update(next(g for g in GOOD_BATCH_CAP if any(self.stable_lane[k] != v for k, v in g.items())))
        else:
            lane.update(BAD_CHANGES[index % len(BAD_CHANGES)])
            # each bad change a new revision: the operator does not retry a revision it rolled
            # back (the 5th bad change here was the 1st again and ended at once, unjudged)
            lane["maxQueueLength"] = int(self.stable_lane["maxQueueLength"]) + 1 + index
        return doc

    def rollout(self, kind: str, index: int, timeout: float) -> dict[str, Any]:
        doc = self.change(kind, index)
        lane = doc["spec"]["lanes"][0]
        revision = parse_spec(doc["spec"]).revision()
        applied = time.time()
        self.kubectl("apply", "-n", self.ns, "-f", "-", stdin=yaml.safe_dump(doc))
        record = follow(self.status, revision, applied, timeout, outcome_of, poll=2.0)
        with contextlib.suppress(Exception):  # a diagnosis: a failed query loses only this
            record["pods"] = self.pod_loads(applied, record["steps"], time.time())
        if record["outcome"] == "Promoted":
            self.stable_lane = dict(lane)
        if record["outcome"] == "RolledBack" and not any(d["kind"] == "CanaryStarted" for d in record["decisions"]):
            record["outcome"] = "NotRetried"  # a revision rolled back before: not a verdict on this change
        if record["outcome"] not in ("Promoted", "RolledBack", "NotRetried"):
            # Still in flight (held, or out of time): the next change would start on its hold
            # and read the same Stalled at once. End it as on-call would, then wait for the stable.
            record["aborted"] = self.abort(revision, timeout)
        return {
            "namespace": self.ns,
            "kind": kind,
            "change": self.good_change if kind == "good" else "bad",
            "lane": {k: lane[k] for k in ("maxBatchSize", "maxQueueDelay", "maxQueueLength")},
            "revision": revision,
            **record,
        }

    def pod_loads(self, applied: float, steps: list[dict[str, Any]], end: float) -> list[dict[str, Any]]:
        """Per step (from its clock's start to the next step's entry), per pod: the requests it
        served and its shares over the example's queue-age and p99 SLOs. The operator judges a
        track's pods pooled; this shows whether the track's load was spread evenly over them."""
        slo = parse_spec(self.example["spec"]).slo
        bounds = {  # name in the record -> (histogram, SLO bound)
            "queue_age": (QUEUE_AGE_METRIC, float(slo.max_queue_age)),
            "latency": (LATENCY_METRIC, float(slo.p99_latency)),
        }
        sel = f'namespace="{self.ns}",policy="{self.name}"'
        out = []
        for i, step in enumerate(steps):
            if step.get("clock_started") is None:
                continue
            start = applied + step["clock_started"]
            stop = applied + steps[i + 1]["entered"] if i + 1 < len(steps) and steps[i + 1].get("entered") else end
            span = f"{max(1, round(stop - start))}s"
            pods: dict[str, dict[str, Any]] = {}
            for metric, (series, bound) in bounds.items():
                for r in self.prom.query(
                    f"sum by (pod, track, le) (increase({series}_bucket{{{sel}}}[{span}]))", at=stop
                ):
                    le, n = r["metric"]["le"], float(r["value"][1])
                    pod = pods.setdefault(r["metric"]["pod"], {"track": r["metric"]["track"]})
                    if le == "+Inf":
                        pod["requests"] = round(n)
                    elif abs(float(le) - bound) < 1e-9:
                        pod[f"{metric}_within"] = n
            for pod in pods.values():
                total = pod.get("requests") or 0
                for metric in bounds:
                    within = pod.pop(f"{metric}_within", None)
                    pod[f"over_{metric}_pct"] = (
                        round(100 * (1 - within / total), 2) if total and within is not None else None
                    )
            out.append({"step": step["step"], "seconds": round(stop - start), "pods": dict(sorted(pods.items()))})
        return out

    def abort(self, revision: str, timeout: float) -> bool:
        """``kubectl batchpilot abort``'s annotation; whether the canary was rolled back in time."""
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.kubectl(
            "annotate", "batchingpolicy", self.name, "-n", self.ns, "--overwrite",
            f"{ABORT_ANNOTATION}=gateway-example@{stamp}",
        )  # fmt: skip
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            st = self.status()
            if st.get("phase") == "RolledBack" or (st.get("rollout") or {}).get("revision") != revision:
                return True
            time.sleep(2.0)
        return False

    def stop(self) -> None:
        if self.replay is not None:
            self.replay.stop()
        self.gateway.stop()
        self.harness.stop()


def summarize(rollouts: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind, want in (("good:aa", "Promoted"), ("good:batch-cap", "Promoted"), ("bad", "RolledBack")):
        rs = [r for r in rollouts if kind == ("bad" if r["kind"] == "bad" else f"good:{r.get('change', 'batch-cap')}")]
        hit = [r for r in rs if r["outcome"] == want]
        out[kind] = {
            "rollouts": len(rs),
            want.lower(): len(hit),
            "other": sorted({r["outcome"] for r in rs if r["outcome"] != want}),
            "mean_seconds": round(sum(r["seconds"] for r in hit) / len(hit), 1) if hit else None,
            "mean_analyses": round(sum(len(r["windows"]) for r in hit) / len(hit), 2) if hit else None,
        }
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--good", type=int, default=10)
    p.add_argument("--bad", type=int, default=10)
    p.add_argument(
        "--good-change",
        choices=("aa", "batch-cap"),
        default="aa",
        help="aa: only the queue bound changes; batch-cap: 16/512 <-> 32/1024 (the first runs')",
    )
    p.add_argument("--namespaces", type=int, default=1, help="copies of the example run in parallel")
    p.add_argument("--rate", type=float, default=30.0, help="Poisson req/s through each namespace's Gateway")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds a rollout may take before it is unfinished")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/batchpilot-gateway-example"))
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    # a TERM (a kill, a CI timeout) unwinds through the finally below: every process stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    started = time.time()
    earlier = json.loads(args.out.read_text()) if args.out.exists() else {}
    previous: list[dict[str, Any]] = earlier.get("rollouts", [])

    def write(rollouts: list[dict[str, Any]]) -> dict[str, Any]:
        """The results so far, earlier runs' included: written after every rollout, so an
        interrupted run (or a session's end) keeps what it measured and the next run appends."""
        this_run = {
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "started": started,
            "elapsed_s": round(time.time() - started, 1),
            "rollouts": len(rollouts),
            "namespaces": args.namespaces,
            "rate": args.rate,
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        }
        doc = {
            "runs": [*earlier.get("runs", []), this_run],
            "example": yaml.safe_load(EXAMPLE.read_text()),
            "summary": summarize(previous + rollouts),
            "rollouts": previous + rollouts,
        }
        args.out.write_text(json.dumps(doc, indent=1))
        return doc

    queue = [k for pair in zip(["good"] * args.good, ["bad"] * args.bad, strict=False) for k in pair]
    queue += ["good"] * (args.good - args.bad) + ["bad"] * (args.bad - args.good)
    with contextlib.suppress(FileNotFoundError):
        subprocess.run(["rm", "-rf", str(args.workdir)], check=True)
    cluster = LocalCluster.start(args.workdir / "cluster", gpu_nodes=3)
    prom: PrometheusServer | None = None
    operator: subprocess.Popen[bytes] | None = None
    lanes: list[Lane] = []
    rollouts: list[dict[str, Any]] = []
    lock = threading.Lock()
    try:
        kubectl = [str(cluster.bin_dir / "kubectl"), f"--kubeconfig={cluster.kubeconfig}"]
        subprocess.run([*kubectl, "apply", "-f", str(ROOT / "crds" / "batchingpolicy.yaml")], check=True)
        cluster.wait_established("batchingpolicies.batchpilot.dev")
        prom = PrometheusServer(args.workdir / "prometheus", scrape_interval="1s")
        prom.start()
        shared = SharedTargets(prom)
        operator = start_operator(cluster.kubeconfig, prom.url, args.workdir / "operator.log")
        for i in range(args.namespaces):
            lanes.append(Lane(cluster, prom, shared, f"gw{i + 1}", args.rate, seed=i + 1, good_change=args.good_change))
        for lane in lanes:
            lane.start_load(args.timeout * (len(queue) + 2))
        time.sleep(60)  # the stable's first windows fill before the first change (load, not a wait)

        def work(lane: Lane) -> None:
            while True:
                with lock:
                    if not queue:
                        return
                    kind = queue.pop(0)
                    # the A/A queue bounds count this run's good changes (a fresh cluster), the bad
                    # changes every run's (they cycle through BAD_CHANGES)
                    index = sum(r["kind"] == kind for r in (rollouts if kind == "good" else previous + rollouts))
                r = lane.rollout(kind, index, args.timeout)
                with lock:
                    rollouts.append(r)
                    write(rollouts)
                print(
                    f"[gateway_example] {lane.ns} {kind} {r['lane']}: {r['outcome']} in {r['seconds']}s, "
                    f"{len(r['windows'])} analyses",
                    flush=True,
                )

        threads = [threading.Thread(target=work, args=(lane,), daemon=True) for lane in lanes]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        for lane in lanes:
            with contextlib.suppress(Exception):
                lane.stop()
        if operator is not None and operator.poll() is None:
            operator.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                operator.wait(timeout=15)
        if prom is not None:
            prom.stop()
        cluster.stop()
    print(json.dumps(write(rollouts)["summary"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
