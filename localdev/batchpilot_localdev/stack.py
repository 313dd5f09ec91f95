"""`batchpilot up` / `batchpilot down`: the local stack, left running to try things by hand.

``up`` starts a supervisor process in its own session and returns once the stack is ready. The
supervisor brings up what the demo brings up, from the same parts: the local control plane
(:mod:`.cluster`), Prometheus (:mod:`.prometheus`), the operator (all namespaces), the runtime
harness for one namespace (:mod:`.harness`: one runtime process per pod) and a trace replay
(:mod:`.load`) against every policy of that namespace at a chosen rate. Then it watches them:
every half second it checks that each part still runs, applies a new load rate
(``batchpilot load --rate R``), and writes ``state.json`` in the work directory.

``state.json`` is the contract between the supervisor and the commands: the supervisor's pid,
``phase`` (starting, up, stopping, down, failed), the kubeconfig and Prometheus URL, each part
with its pid, state and log, the load per policy, and ``problems``: every part that died, with
its exit code and log (a crash is reported, never silent; the part is not restarted).

``down`` sends SIGTERM to the supervisor, which stops everything it started in reverse order;
then any process still holding the work directory in its command line (a part orphaned by a
killed supervisor) is terminated too, so nothing is left running.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from batchpilot_localdev.processes import cmdline, pid_alive, stop_pids, stop_process

STATE_FILE = "state.json"
LOAD_FILE = "load.json"
SUPERVISOR_LOG = "stack.log"
CRD_NAME = "batchingpolicies.batchpilot.dev"


# --------------------------------------------------------------------------- state files


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def write_json(path: Path, data: Mapping[str, Any]) -> None:
    """Atomically: a reader never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, path)


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def recorded_processes(workdir: Path, state: Mapping[str, Any] | None) -> list[tuple[int, str]]:
    """The supervisor and the parts a state file records that still run as the stack's.

    Only these are ever signalled (a pid is checked to still name the work directory, so a
    reused pid or the user's own `tail -f` of a log is left alone).
    """
    if state is None:
        return []
    needle = str(workdir.resolve())
    pids = [state.get("pid"), *[p.get("pid") for p in state.get("parts") or []]]
    found: list[tuple[int, str]] = []
    for pid in pids:
        if not isinstance(pid, int) or pid == os.getpid() or not pid_alive(pid):
            continue
        cmd = cmdline(pid)
        if cmd is not None and needle in cmd:
            found.append((pid, cmd))
    return found


# --------------------------------------------------------------------------- the supervisor


@dataclass
class Part:
    """One process of the stack, for the state file."""

    name: str
    pid: int | None
    returncode: int | None
    log: str

    def as_json(self) -> dict[str, Any]:
        state = "running" if self.returncode is None else f"exited {self.returncode}"
        return {"name": self.name, "pid": self.pid, "state": state, "log": self.log}


class Supervisor:
    """Runs inside the detached ``python -m batchpilot_localdev.stack serve`` process."""

    def __init__(
        self, workdir: Path, namespace: str, rate: float, trace: Path, device: str | None, real_node: bool = False
    ) -> None:
        self.workdir, self.namespace, self.rate, self.trace, self.device = workdir, namespace, rate, trace, device
        self.real_node = real_node
        self.node: Any = None
        """The real node (localdev/realnode.py) with ``real_node``: pods run there, no harness."""
        self.endpoints: dict[str, Any] = {}
        self.state_path = workdir / STATE_FILE
        self.load_path = workdir / LOAD_FILE
        self.cluster: Any = None
        self.prom: Any = None
        self.harness: Any = None
        self.operator: subprocess.Popen[bytes] | None = None
        self.replays: dict[str, Any] = {}
        self.replay_rate: float | None = None
        self.problems: dict[str, dict[str, Any]] = {}
        self.state: dict[str, Any] = {
            "pid": os.getpid(),
            "phase": "starting",
            "since": _now(),
            "workdir": str(workdir),
            "namespace": namespace,
            "trace": str(trace),
            "runtimeDevice": None if real_node else device,
            "realNode": real_node,
            "log": str(workdir / SUPERVISOR_LOG),
        }
        self._stop = threading.Event()

    def log(self, text: str) -> None:
        sys.stdout.write(f"{_now()} {text}\n")
        sys.stdout.flush()

    def save(self, **changes: Any) -> None:
        self.state.update(changes)
        write_json(self.state_path, self.state)

    # ---- lifecycle ---------------------------------------------------------------------
    def run(self) -> int:
        def terminate(signum: int, _frame: object) -> None:
            self._stop.set()
            raise SystemExit(0)

        signal.signal(signal.SIGTERM, terminate)
        signal.signal(signal.SIGINT, terminate)
        code = 0
        try:
            self.save()
            self.start()
            self.save(phase="up", since=_now(), rate=self.rate)
            self.log("up")
            while not self._stop.is_set():
                self.tick()
                self._stop.wait(0.5)
        except SystemExit:
            pass
        except BaseException as exc:
            code = 1
            detail = f"{type(exc).__name__}: {exc}"
            if isinstance(exc, subprocess.CalledProcessError) and exc.stderr:
                # what the command said: a failed `kubectl wait` is otherwise only its exit code
                detail += f" ({str(exc.stderr).strip()[-500:]})"
            self.log(f"failed: {detail}")
            self.save(phase="failed", error=detail)
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second `down` must not interrupt the stop
            self.log("stopping")
            if self.state.get("phase") != "failed":
                self.save(phase="stopping")
            self.stop()
            if self.state.get("phase") != "failed":
                self.save(phase="down", since=_now(), parts=[], load={})
            self.log("stopped")
        return code

    def start(self) -> None:
        from batchpilot_localdev.cluster import REPO_ROOT, LocalCluster
        from batchpilot_localdev.harness import RuntimeHarness
        from batchpilot_localdev.prometheus import PrometheusServer
        from batchpilot_localdev.scenario import start_operator

        if self.real_node:
            self.start_real_node()
            return
        self.log("starting the local control plane")
        self.cluster = LocalCluster.start(self.workdir / "cluster", gpu_nodes=2)
        self.save(kubeconfig=str(self.cluster.kubeconfig), kubectl=str(self.cluster.bin_dir / "kubectl"))
        self.cluster.kubectl("apply", "-f", str(REPO_ROOT / "crds" / "batchingpolicy.yaml"))
        self.cluster.wait_established(CRD_NAME)
        if self.cluster.kubectl("get", "namespace", self.namespace, "--ignore-not-found", "-o", "name") == "":
            self.cluster.kubectl("create", "namespace", self.namespace)
        self.log("starting Prometheus")
        self.prom = PrometheusServer(self.workdir / "prometheus", scrape_interval="1s")
        self.prom.start()
        self.save(prometheusUrl=self.prom.url)
        self.harness = RuntimeHarness(
            self.cluster.kubeconfig, self.namespace, self.workdir / "runtime", self.prom, device=self.device
        ).start()
        self.log("starting the operator")
        self.operator = start_operator(self.cluster.kubeconfig, self.prom.url, self.workdir / "operator.log")
        self.tick()

    def start_real_node(self) -> None:
        """The control plane with no kwok node, the real node beside it (kubelet + containerd:
        the operator's pods run the runtime image), Prometheus finding them through Kubernetes
        service discovery, the operator."""
        from batchpilot_localdev.cluster import LocalCluster
        from batchpilot_localdev.realnode import prepare_namespace, start_beside
        from batchpilot_localdev.scenario import start_operator

        self.log("starting the local control plane (no kwok node)")
        self.cluster = LocalCluster.start(self.workdir / "cluster", gpu_nodes=0)
        self.save(kubeconfig=str(self.cluster.kubeconfig), kubectl=str(self.cluster.bin_dir / "kubectl"))
        self.log("starting the real node (kubelet + containerd; builds and imports the images when stale)")
        self.node = start_beside(self.cluster, self.workdir / "node")
        self.save(node=self.node.name)
        self.log("starting Prometheus (Kubernetes service discovery)")
        self.prom = prepare_namespace(self.cluster, self.namespace, self.workdir / "prometheus")
        self.save(prometheusUrl=self.prom.url)
        self.log("starting the operator")
        self.operator = start_operator(self.cluster.kubeconfig, self.prom.url, self.workdir / "operator.log")
        self.tick()

    def stop_replays(self) -> None:
        """Stop every replay at once (each waits for its requests in flight, up to 10 s)."""
        threads = [threading.Thread(target=r.stop) for r in self.replays.values()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self.replays.clear()
        for endpoints in self.endpoints.values():
            endpoints.stop()
        self.endpoints.clear()

    def stop(self) -> None:
        self.stop_replays()
        if self.operator is not None:
            stop_process(self.operator, 15)
        if self.harness is not None:
            self.harness.stop()
        if self.prom is not None:
            self.prom.stop()
        if self.node is not None:
            problems = self.node.stop()
            if problems:
                self.log(f"real node clean-up left: {problems}")
        if self.cluster is not None:
            self.cluster.stop()

    # ---- one look at everything ----------------------------------------------------------
    def parts(self) -> list[Part]:
        parts: list[Part] = []
        if self.cluster is not None:
            for name, proc in self.cluster.processes.items():
                parts.append(Part(name, proc.pid, proc.poll(), str(self.cluster.workdir / "logs" / f"{name}.log")))
        if self.node is not None:
            for name, proc in self.node.processes.items():
                parts.append(
                    Part(f"node/{name}", proc.pid, proc.poll(), str(self.node.workdir / "logs" / f"{name}.log"))
                )
        if self.prom is not None and self.prom.process is not None:
            parts.append(Part("prometheus", self.prom.process.pid, self.prom.process.poll(), str(self.prom.log_file)))
        if self.operator is not None:
            parts.append(Part("operator", self.operator.pid, self.operator.poll(), str(self.workdir / "operator.log")))
        if self.harness is not None:
            for p in self.harness.processes():
                log = str(self.harness.workdir / f"{p.pod}.log")
                parts.append(Part(f"runtime/{p.pod}", p.proc.pid, p.proc.poll(), log))
        return parts

    def tick(self) -> None:
        try:
            self._tick()
        except Exception as exc:  # the supervisor outlives a transient fault; the log says what
            self.log(f"check failed: {type(exc).__name__}: {exc}")

    def _tick(self) -> None:
        parts = self.parts()
        for part in parts:
            if part.returncode is not None and part.name not in self.problems:
                self.problems[part.name] = {
                    "part": part.name,
                    "exitCode": part.returncode,
                    "at": _now(),
                    "log": part.log,
                }
                self.log(f"{part.name} (pid {part.pid}) exited with {part.returncode}; log: {part.log}")
        self.apply_load()
        load = {}
        for policy, replay in self.replays.items():
            alive = replay.running
            if not alive and f"load/{policy}" not in self.problems:
                self.problems[f"load/{policy}"] = {"part": f"load/{policy}", "at": _now(), "log": self.state["log"]}
            load[policy] = {
                "rate": self.replay_rate,
                "sent": sum(s.sent for s in replay.stats.values()),
                "ok": sum(s.ok for s in replay.stats.values()),
                "errors": sum(s.errors for s in replay.stats.values()),
                "running": alive,
            }
        self.save(
            parts=[p.as_json() for p in parts],
            problems=list(self.problems.values()),
            load=load,
            rate=self.rate,
            harnessErrors=sorted(set(self.harness.errors))[-20:] if self.harness is not None else [],
        )

    def apply_load(self) -> None:
        """Replay the trace at the asked rate against every policy that has ready runtime processes."""
        wanted = read_json(self.load_path)
        if wanted is not None and isinstance(wanted.get("rate"), int | float) and wanted["rate"] != self.rate:
            self.log(f"load rate {self.rate:g} -> {wanted['rate']:g} req/s per policy")
            self.rate = float(wanted["rate"])
        if self.rate != self.replay_rate:
            self.stop_replays()
            self.replay_rate = self.rate
        if self.rate > 0 and self.node is not None:
            self.apply_load_real_node()
            return
        if self.rate <= 0 or self.harness is None:
            return
        ready: dict[str, list[Any]] = {}
        for p in self.harness.processes():
            if p.ready:
                ready.setdefault(p.policy, []).append(p)
        for policy, procs in ready.items():
            if policy not in self.replays:
                try:
                    self.replays[policy] = self.start_replay(policy, procs[0])
                except (OSError, ValueError, KeyError) as exc:  # tried again at the next check
                    self.log(f"load: cannot start against {policy} yet: {type(exc).__name__}: {exc}")

    def start_replay(self, policy: str, example: Any) -> Any:
        from batchpilot_localdev.load import TraceReplay
        from batchpilot_operator.tune.trace import load_trace

        harness = self.harness
        body = infer_body(example.url, example.model)
        arrivals = load_trace(self.trace).scaled_arrivals(self.rate)
        self.log(f"load: replaying {self.trace.name} at {self.rate:g} req/s against {policy}")
        return TraceReplay(arrivals, lambda: harness.endpoints(policy), example.model, body=body).start()

    def apply_load_real_node(self) -> None:
        """Replay the trace against every policy with a ready pod on the real node (at the pods'
        own addresses, as the policy's Service would route)."""
        from batchpilot_localdev.load import TraceReplay
        from batchpilot_localdev.realnode import PodEndpoints
        from batchpilot_operator.tune.trace import load_trace

        out = self.cluster.kubectl("get", "batchingpolicies", "-n", self.namespace, "-o", "json")
        for policy in json.loads(out)["items"]:
            name = policy["metadata"]["name"]
            if name in self.replays:
                continue
            endpoints = self.endpoints.get(name) or PodEndpoints(self.cluster.kubeconfig, self.namespace, name).start()
            self.endpoints[name] = endpoints
            ready = endpoints()
            if not ready:
                continue
            model = policy["spec"]["model"]["name"]
            try:
                body = infer_body(ready[0].url, model)
            except (OSError, ValueError, KeyError) as exc:  # tried again at the next check
                self.log(f"load: cannot start against {name} yet: {type(exc).__name__}: {exc}")
                continue
            arrivals = load_trace(self.trace).scaled_arrivals(self.rate)
            self.log(f"load: replaying {self.trace.name} at {self.rate:g} req/s against {name} (real pods)")
            self.replays[name] = TraceReplay(arrivals, endpoints, model, body=body).start()


def infer_body(url: str, model: str) -> dict[str, Any]:
    """One row of zeros shaped as the model's input says (its metadata), as an infer request."""
    with urllib.request.urlopen(f"{url}/v2/models/{model}", timeout=10) as resp:
        meta = json.loads(resp.read())
    spec = meta["inputs"][0]
    shape = [1, *[int(d) for d in spec["shape"][1:]]]
    count = 1
    for d in shape:
        count *= d
    zero: float | int = 0.0 if spec["datatype"].startswith("FP") else 0
    return {"inputs": [{"name": spec["name"], "datatype": spec["datatype"], "shape": shape, "data": [zero] * count}]}


# --------------------------------------------------------------------------- the commands


class StackError(Exception):
    """Reported in one paragraph, exit code 1."""


def _state(workdir: Path) -> dict[str, Any] | None:
    return read_json(workdir / STATE_FILE)


def running_state(workdir: Path) -> dict[str, Any] | None:
    """The state of a stack whose supervisor still runs, else None."""
    state = _state(workdir)
    if state is None or not pid_alive(state.get("pid")) or state.get("phase") in ("down", "failed"):
        return None
    return state


def up(
    workdir: Path,
    namespace: str,
    rate: float,
    trace: Path,
    device: str | None,
    timeout: float,
    say: Callable[[str], None],
    real_node: bool = False,
) -> int:
    workdir = workdir.resolve()
    state = running_state(workdir)
    if state is not None:
        say(f"already up (supervisor pid {state['pid']}, since {state.get('since')}; `batchpilot down` stops it)")
        return report(state, say)
    if not trace.exists():
        raise StackError(f"arrival trace {trace} not found (--trace)")
    previous = _state(workdir)
    if previous is not None and previous.get("phase") in ("starting", "up", "stopping"):
        say(
            f"CRASHED: the previous stack's supervisor (pid {previous.get('pid')}) is gone without stopping it "
            f"(log: {workdir / SUPERVISOR_LOG}); starting a new one"
        )
    leftovers = recorded_processes(workdir, previous)
    if leftovers:
        say(f"stopping {len(leftovers)} processes left over from an earlier stack in {workdir}")
        stop_pids(leftovers)
    workdir.mkdir(parents=True, exist_ok=True)
    for name in (STATE_FILE, LOAD_FILE):
        (workdir / name).unlink(missing_ok=True)
    write_json(workdir / LOAD_FILE, {"rate": rate})
    cmd = [
        sys.executable,
        "-m",
        "batchpilot_localdev.stack",
        "serve",
        f"--workdir={workdir}",
        f"--namespace={namespace}",
        f"--rate={rate}",
        f"--trace={trace.resolve()}",
    ]
    if device and not real_node:
        cmd.append(f"--runtime-device={device}")
    if real_node:
        cmd.append("--real-node")
    with (workdir / SUPERVISOR_LOG).open("ab") as log:
        proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # outlives this command and the terminal it ran in
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    say(f"starting the local stack in {workdir} (supervisor pid {proc.pid}, log {workdir / SUPERVISOR_LOG})")
    deadline = time.monotonic() + timeout
    while True:
        state = _state(workdir) or {}
        if state.get("phase") == "up":
            break
        if proc.poll() is not None or state.get("phase") == "failed":
            tail = (workdir / SUPERVISOR_LOG).read_text(errors="replace")[-3000:]
            raise StackError(f"the stack did not come up: {state.get('error') or 'supervisor exited'}\n{tail}")
        if time.monotonic() > deadline:
            os.kill(proc.pid, signal.SIGTERM)
            raise StackError(
                f"the stack was not up after {timeout:.0f}s (log: {workdir / SUPERVISOR_LOG}); stopping it"
            )
        time.sleep(0.2)
    return report(state, say)


def report(state: Mapping[str, Any], say: Callable[[str], None]) -> int:
    """What the user needs to use the stack; exit code 1 when a part has died."""
    kubectl_dir = Path(str(state.get("kubectl", "kubectl"))).parent
    say(f"export KUBECONFIG={state['kubeconfig']}")
    say(f"export PATH={kubectl_dir}:{Path(sys.executable).parent}:$PATH   # kubectl and kubectl-batchpilot")
    say(f"Prometheus: {state['prometheusUrl']}")
    load = state.get("load") or {}
    if state.get("realNode"):
        say(
            f"real node {state.get('node')}: the operator's pods run there (kubelet + containerd, runtime image of "
            "`make images`; a policy's model.device must be cpu or auto: the node has no GPU, only nvidia.com/gpu "
            f"to schedule on); namespace {state['namespace']!r} enforces the restricted Pod Security Standard"
        )
    say(
        f"runtime harness and load serve namespace {state['namespace']!r}: the trace at {state.get('rate', 0):g} req/s "
        f"per policy (`batchpilot load --rate R` changes it){'; now: ' + ', '.join(sorted(load)) if load else ''}"
    )
    say(f"try: kubectl apply -n {state['namespace']} -k manifests/examples && kubectl batchpilot list -A")
    problems = state.get("problems") or []
    for p in problems:
        code = f" with {p['exitCode']}" if p.get("exitCode") is not None else ""
        say(f"CRASHED: {p['part']} exited{code} at {p['at']} (log: {p['log']})")
    return 1 if problems else 0


def set_rate(workdir: Path, rate: float, timeout: float, say: Callable[[str], None]) -> int:
    workdir = workdir.resolve()
    if running_state(workdir) is None:
        raise StackError(f"no local stack is up in {workdir} (`batchpilot up` starts one)")
    write_json(workdir / LOAD_FILE, {"rate": rate})
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = running_state(workdir)
        if state is None:
            raise StackError("the stack went down while changing the rate")
        if state.get("rate") == rate and all(v.get("rate") == rate for v in (state.get("load") or {}).values()):
            say(f"load: {rate:g} req/s per policy ({', '.join(sorted(state.get('load') or {})) or 'no policy yet'})")
            return 0
        time.sleep(0.2)
    raise StackError(f"the supervisor did not apply the new rate within {timeout:.0f}s")


def down(workdir: Path, timeout: float, say: Callable[[str], None]) -> int:
    workdir = workdir.resolve()
    state = _state(workdir)
    pid = state.get("pid") if state else None
    if state is not None and pid_alive(pid) and state.get("phase") not in ("down", "failed"):
        assert isinstance(pid, int)
        say(f"stopping the local stack in {workdir} (supervisor pid {pid})")
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while pid_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if pid_alive(pid):
            say(f"the supervisor did not stop within {timeout:.0f}s; killing what is left")
    elif not recorded_processes(workdir, state):
        say(f"no local stack is up in {workdir}")
        return 0
    leftovers = recorded_processes(workdir, state)
    if leftovers:
        say(f"terminating {len(leftovers)} leftover processes: " + ", ".join(str(p) for p, _ in leftovers))
        stop_pids(leftovers)
    final = _state(workdir)
    if final is not None and final.get("phase") != "down":
        write_json(workdir / STATE_FILE, {**final, "phase": "down", "since": _now(), "parts": [], "load": {}})
    say("down: nothing of the stack is running")
    return 0


def main(argv: list[str] | None = None) -> int:
    """The supervisor's entry point (``python -m batchpilot_localdev.stack serve ...``)."""
    p = argparse.ArgumentParser(prog="batchpilot-stack")
    p.add_argument("mode", choices=["serve"])
    p.add_argument("--workdir", type=Path, required=True)
    p.add_argument("--namespace", required=True)
    p.add_argument("--rate", type=float, required=True)
    p.add_argument("--trace", type=Path, required=True)
    p.add_argument("--runtime-device", default=None)
    p.add_argument("--real-node", action="store_true")
    args = p.parse_args(argv)
    return Supervisor(args.workdir, args.namespace, args.rate, args.trace, args.runtime_device, args.real_node).run()


if __name__ == "__main__":
    sys.exit(main())
