"""A real, local Kubernetes control plane for tests and the local demo.

etcd, kube-apiserver, kube-controller-manager and kube-scheduler (built from the
``k8s.io/kubernetes`` Go module by ``hack/k8s/build.sh``) plus kwok, which plays the kubelet
for fake GPU nodes so that pods are scheduled and become Running/Ready and Deployment status
is real. Everything listens on 127.0.0.1 on free ports and lives under one work directory.

Usage::

    with LocalCluster.start(workdir) as cluster:
        cluster.kubeconfig   # path of an admin kubeconfig (token auth)
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from batchpilot_localdev import checkout, free_port
from batchpilot_localdev.pki import make_pki, write_kubeconfig
from batchpilot_localdev.processes import stop_group, stop_groups

REPO_ROOT = checkout()
DEFAULT_BIN_DIR = REPO_ROOT / ".cache" / "k8s-bin"
POD_ROUTES = "pod-routes"
"""Directory (next to the kubeconfig) of the pod network's routes: see localdev/podnet.py."""
BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl", "kwok")

SERVING_ANNOTATION = "batchpilot.dev/serving"
"""Set to ``"true"`` on a pod by the runtime harness once the pod's process answers its
readiness endpoint: with ``LocalCluster.start(ready_when_serving=True)`` kwok reports the pod
Ready only then, as a kubelet's readiness probe would."""

_SERVING_STAGES_TEMPLATE = """\
# kwok's pod lifecycle with a readiness probe: Running with an IP at once, Ready only once the
# runtime harness marks the pod serving (kwok's own fast stages make every pod Ready at once).
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: pod-running
spec:
  resourceRef: {apiGroup: v1, kind: Pod}
  selector:
    matchExpressions:
    - {key: '.metadata.deletionTimestamp', operator: 'DoesNotExist'}
    - {key: '.status.podIP', operator: 'DoesNotExist'}
  next:
    statusTemplate: |
      {{ $now := Now }}
      conditions:
      - {lastTransitionTime: {{ $now | Quote }}, status: "True", type: Initialized}
      - {lastTransitionTime: {{ $now | Quote }}, status: "False", type: Ready, reason: NotServing}
      - {lastTransitionTime: {{ $now | Quote }}, status: "False", type: ContainersReady, reason: NotServing}
@CONTAINERS_NOT_READY@
      hostIP: {{ NodeIPWith .spec.nodeName | Quote }}
      podIP: {{ PodIPWith .spec.nodeName ( or .spec.hostNetwork false ) ( or .metadata.uid "" ) ( or .metadata.name "" ) ( or .metadata.namespace "" ) | Quote }}
      phase: Running
      startTime: {{ $now | Quote }}
---
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: pod-serving
spec:
  resourceRef: {apiGroup: v1, kind: Pod}
  selector:
    matchExpressions:
    - {key: '.metadata.deletionTimestamp', operator: 'DoesNotExist'}
    - {key: '.metadata.annotations["@SERVING@"]', operator: 'In', values: ['true']}
    - {key: '.status.conditions.[] | select( .type == "Ready" ) | .status', operator: 'In', values: ['False']}
  next:
    statusTemplate: |
      {{ $now := Now }}
      conditions:
      - {lastTransitionTime: {{ $now | Quote }}, status: "True", type: Ready}
      - {lastTransitionTime: {{ $now | Quote }}, status: "True", type: ContainersReady}
@CONTAINERS_READY@
---
apiVersion: kwok.x-k8s.io/v1alpha1
kind: Stage
metadata:
  name: pod-delete
spec:
  resourceRef: {apiGroup: v1, kind: Pod}
  selector:
    matchExpressions:
    - {key: '.metadata.deletionTimestamp', operator: 'Exists'}
  next:
    finalizers: {empty: true}
    delete: true
"""


def _container_statuses(ready: bool) -> str:
    """A kwok status template's containerStatuses: every container running, ready or not."""
    return f"""\
      containerStatuses:
      {{{{ range .spec.containers }}}}
      - image: {{{{ .image | Quote }}}}
        name: {{{{ .name | Quote }}}}
        ready: {"true" if ready else "false"}
        restartCount: 0
        started: true
        state:
          running:
            startedAt: {{{{ $now | Quote }}}}
      {{{{ end }}}}"""


SERVING_STAGES = (
    _SERVING_STAGES_TEMPLATE.replace("@CONTAINERS_NOT_READY@", _container_statuses(False))
    .replace("@CONTAINERS_READY@", _container_statuses(True))
    .replace("@SERVING@", SERVING_ANNOTATION)
)

ADMIN_TOKEN = "batchpilot-local-admin-token"
CONTROLLERS = ",".join(
    [
        "deployment-controller",
        "replicaset-controller",
        "garbage-collector-controller",
        "serviceaccount-controller",
        "namespace-controller",
        "endpointslice-controller",
        "disruption-controller",
        "node-lifecycle-controller",  # lifts the not-ready taint once kwok reports a node Ready
    ]
)


class ClusterError(RuntimeError):
    """The control plane could not be built or started; the message says which part and why."""


def bin_dir() -> Path:
    return Path(os.environ.get("BATCHPILOT_K8S_BIN", DEFAULT_BIN_DIR))


def ensure_binaries() -> Path:
    """Build the control-plane binaries if the pinned versions changed (cheap when up to date)."""
    directory = bin_dir()
    script = REPO_ROOT / "hack" / "k8s" / "build.sh"
    result = subprocess.run(["bash", str(script)], env={**os.environ, "BATCHPILOT_K8S_BIN": str(directory)})
    if result.returncode != 0:
        raise ClusterError(f"building the control plane failed ({script} exited {result.returncode})")
    missing = [b for b in BINARIES if not (directory / b).exists()]
    if missing:
        raise ClusterError(f"control-plane binaries missing from {directory}: {missing}")
    return directory


def egress_selector_config(socket_path: Path) -> str:
    """Send the apiserver's cluster traffic (pod/service/node proxy) through the local pod network.

    Over a Unix socket: kube-apiserver v1.34 accepts an ``http://`` TCP proxy URL in validation
    but then dereferences the absent TLS config and crashes.
    """
    return f"""apiVersion: apiserver.k8s.io/v1beta1
kind: EgressSelectorConfiguration
egressSelections:
- name: cluster
  connection:
    proxyProtocol: HTTPConnect
    transport:
      uds:
        udsName: {socket_path}
"""


AUDIT_POLICY = """apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  - level: Metadata
"""


def gpu_node_manifest(name: str, gpus: int = 8, pods: int = 110) -> str:
    return f"""apiVersion: v1
kind: Node
metadata:
  name: {name}
  annotations:
    kwok.x-k8s.io/node: fake
    node.alpha.kubernetes.io/ttl: "0"
  labels:
    kubernetes.io/hostname: {name}
    kubernetes.io/os: linux
    kubernetes.io/arch: amd64
    type: kwok
    nvidia.com/gpu.present: "true"
status:
  allocatable: {{cpu: "64", memory: 512Gi, pods: "{pods}", nvidia.com/gpu: "{gpus}"}}
  capacity: {{cpu: "64", memory: 512Gi, pods: "{pods}", nvidia.com/gpu: "{gpus}"}}
"""


ESTABLISHED = '{.status.conditions[?(@.type=="Established")].status}'


def wait_established(kubectl: list[str], crds: list[str], timeout: float = 60.0) -> None:
    """Poll until every CRD in ``crds`` (by name) is Established; ``kubectl`` is its argv prefix.

    Not ``kubectl wait --for=condition=Established``: a CRD created moments ago has
    ``status.conditions: null`` until the apiserver's naming controller runs, and kubectl
    (1.34) then fails at once (".status.conditions accessor error: <nil>") instead of waiting.
    """
    deadline = time.monotonic() + timeout
    pending = list(crds)
    last = ""
    while True:
        for crd in list(pending):
            result = subprocess.run(
                [*kubectl, "get", "crd", crd, "-o", f"jsonpath={ESTABLISHED}"],
                capture_output=True,
                text=True,
                check=False,
                timeout=30,
            )
            if result.returncode == 0 and result.stdout.strip() == "True":
                pending.remove(crd)
            else:
                last = f"{crd}: {(result.stderr.strip() or repr(result.stdout.strip()))[-300:]}"
        if not pending:
            return
        if time.monotonic() > deadline:
            raise ClusterError(f"CRDs not Established after {timeout:g}s: {', '.join(pending)} (last: {last})")
        time.sleep(0.2)


@dataclass
class LocalCluster:
    workdir: Path
    server: str
    kubeconfig: Path
    bin_dir: Path
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    commands: dict[str, list[str]] = field(default_factory=dict)
    """Each component's command line, so that :meth:`restart` starts it again as it was."""
    started_in: float = 0.0

    # ---- lifecycle -------------------------------------------------------------------
    @classmethod
    def start(
        cls,
        workdir: Path,
        gpu_nodes: int = 2,
        timeout: float = 120.0,
        *,
        audit: bool = False,
        pods_per_node: int = 110,
        pod_cidr: str = "10.0.0.1/24",
        controller_qps: int | None = None,
        gpus_per_node: int = 8,
        node_monitor_grace_period: int | None = None,
        node_lease_seconds: int = 40,
        service_cidr: str = "198.19.0.0/16",
        ready_when_serving: bool = False,
    ) -> LocalCluster:
        """``audit``: the apiserver writes an audit log (metadata of every request: user agent,
        verb, resource, namespace) to :attr:`audit_log`, to count a client's requests.
        ``pods_per_node``/``pod_cidr``: room for many fake pods; ``controller_qps``: the
        controller-manager's and scheduler's client rate limit (benchmarks with 1000s of pods).
        ``gpus_per_node``: each fake node's ``nvidia.com/gpu``; ``node_monitor_grace_period`` (s)
        and ``node_lease_seconds``: how soon a node kwok stops heart-beating goes NotReady (the
        node-loss drill; the defaults are Kubernetes' and kwok's). ``service_cidr``: where Service
        cluster IPs come from (198.19.0.0/16 of the test networks' 198.18.0.0/15, never 10.x;
        nothing routes them: there is no kube-proxy). ``ready_when_serving``: a pod runs (its IP,
        phase Running) at once but is Ready only once annotated :data:`SERVING_ANNOTATION`
        ``"true"``, which the runtime harness does when the pod's process answers its readiness
        endpoint (a kubelet's readiness probe); otherwise kwok reports every pod Ready at once."""
        directory = ensure_binaries()
        t0 = time.monotonic()
        workdir = cls._fresh_workdir(workdir)
        cls._make_credentials(workdir)
        api_port, etcd_port, etcd_peer = free_port(), free_port(), free_port()
        cluster = cls._with_kubeconfig(workdir, directory, api_port)
        podnet_socket = cluster._write_egress_selector()
        audit_args = cluster._audit_args(audit)
        try:
            cluster._start_podnet(podnet_socket)
            cluster._start_etcd(etcd_port, etcd_peer)
            cluster._start_apiserver(api_port, etcd_port, service_cidr, audit_args)
            cluster.wait_ready(timeout)
            cluster._start_controllers(controller_qps, node_monitor_grace_period)
            cluster._start_kwok(pod_cidr, node_lease_seconds, ready_when_serving)
            cluster._add_gpu_nodes(gpu_nodes, gpus_per_node, pods_per_node, timeout)
        except BaseException:
            cluster.stop()
            raise
        cluster.started_in = time.monotonic() - t0
        return cluster

    # ---- start's phases, in order ------------------------------------------------------
    @staticmethod
    def _fresh_workdir(workdir: Path) -> Path:
        """``workdir`` resolved and emptied (a previous cluster's is removed), with ``logs/``."""
        workdir = workdir.resolve()
        if workdir.exists():
            shutil.rmtree(workdir)
        (workdir / "logs").mkdir(parents=True)
        return workdir

    @staticmethod
    def _make_credentials(workdir: Path) -> None:
        """The CA and the components' certificates (``pki/``) and the admin's token (``tokens.csv``)."""
        pki = workdir / "pki"
        make_pki(pki)
        (workdir / "tokens.csv").write_text(f'{ADMIN_TOKEN},admin,admin-uid,"system:masters"\n')

    @classmethod
    def _with_kubeconfig(cls, workdir: Path, directory: Path, api_port: int) -> LocalCluster:
        """The cluster of the apiserver to come on ``api_port``, its admin kubeconfig written."""
        pki = workdir / "pki"
        server = f"https://127.0.0.1:{api_port}"
        kubeconfig = workdir / "kubeconfig"
        write_kubeconfig(kubeconfig, server, pki / "ca.crt", ADMIN_TOKEN)
        return cls(workdir=workdir, server=server, kubeconfig=kubeconfig, bin_dir=directory)

    def _write_egress_selector(self) -> Path:
        """The apiserver's egress selector (its connections to pods go through the pod network's
        socket); returns that socket's path."""
        workdir = self.workdir
        podnet_socket = workdir / "podnet.sock"
        if len(str(podnet_socket)) > 100:  # a Unix socket path has at most 107 bytes
            podnet_socket = Path(tempfile.mkdtemp(prefix="bp-podnet-")) / "podnet.sock"
        (workdir / "egress-selector.yaml").write_text(egress_selector_config(podnet_socket))
        return podnet_socket

    def _audit_args(self, audit: bool) -> list[str]:
        """The apiserver's audit flags (its policy written) with ``audit``, else none."""
        workdir = self.workdir
        audit_args: list[str] = []
        if audit:
            (workdir / "audit-policy.yaml").write_text(AUDIT_POLICY)
            audit_args = [
                f"--audit-policy-file={workdir / 'audit-policy.yaml'}",
                f"--audit-log-path={self.audit_log}",
                "--audit-log-format=json",
                "--audit-log-maxsize=500",
                "--audit-log-maxbackup=1",
                "--audit-log-mode=batch",
                "--audit-log-batch-max-wait=1s",
            ]
        return audit_args

    def _start_podnet(self, podnet_socket: Path) -> None:
        self._spawn(
            "podnet",
            ["--socket", str(podnet_socket), "--routes", str(self.workdir / POD_ROUTES)],
            command=[sys.executable, "-m", "batchpilot_localdev.podnet"],
        )

    def _start_etcd(self, etcd_port: int, etcd_peer: int) -> None:
        self._spawn(
            "etcd",
            [
                "--name=local",
                f"--data-dir={self.workdir / 'etcd'}",
                f"--listen-client-urls=http://127.0.0.1:{etcd_port}",
                f"--advertise-client-urls=http://127.0.0.1:{etcd_port}",
                f"--listen-peer-urls=http://127.0.0.1:{etcd_peer}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{etcd_peer}",
                f"--initial-cluster=local=http://127.0.0.1:{etcd_peer}",
                "--unsafe-no-fsync",
                "--quota-backend-bytes=2147483648",
                "--log-level=warn",
            ],
        )

    def _start_apiserver(self, api_port: int, etcd_port: int, service_cidr: str, audit_args: list[str]) -> None:
        workdir = self.workdir
        pki = workdir / "pki"
        self._spawn(
            "kube-apiserver",
            [
                f"--etcd-servers=http://127.0.0.1:{etcd_port}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={api_port}",
                f"--tls-cert-file={pki / 'apiserver.crt'}",
                f"--tls-private-key-file={pki / 'apiserver.key'}",
                f"--client-ca-file={pki / 'ca.crt'}",
                f"--token-auth-file={workdir / 'tokens.csv'}",
                "--service-account-issuer=https://kubernetes.default.svc",
                f"--service-account-key-file={pki / 'sa.pub'}",
                f"--service-account-signing-key-file={pki / 'sa.key'}",
                f"--service-cluster-ip-range={service_cidr}",
                # Node: a real node's kubelet (localdev/realnode.py) acts as system:node:<name>.
                "--authorization-mode=Node,RBAC",
                "--allow-privileged=true",
                "--enable-priority-and-fairness=false",
                "--profiling=false",
                "--disable-admission-plugins=ServiceAccount",
                "--enable-admission-plugins=NodeRestriction",
                "--endpoint-reconciler-type=none",
                f"--egress-selector-config-file={workdir / 'egress-selector.yaml'}",
                "--v=1",
                *audit_args,
            ],
        )

    def _start_controllers(self, controller_qps: int | None, node_monitor_grace_period: int | None) -> None:
        """The controller-manager and the scheduler."""
        for name in ("kube-controller-manager", "kube-scheduler"):
            extra = (
                [
                    f"--controllers={CONTROLLERS}",
                    "--use-service-account-credentials=false",
                    "--concurrent-deployment-syncs=10",
                    "--concurrent-replicaset-syncs=10",
                    *(
                        [f"--node-monitor-grace-period={node_monitor_grace_period}s", "--node-monitor-period=1s"]
                        if node_monitor_grace_period
                        else []
                    ),
                ]
                if name == "kube-controller-manager"
                else []
            )
            self._spawn(
                name,
                [
                    f"--kubeconfig={self.kubeconfig}",
                    "--leader-elect=false",
                    "--bind-address=127.0.0.1",
                    "--secure-port=0",
                    *extra,
                    *(
                        [f"--kube-api-qps={controller_qps}", f"--kube-api-burst={2 * controller_qps}"]
                        if controller_qps
                        else []
                    ),
                ],
            )

    def _start_kwok(self, pod_cidr: str, node_lease_seconds: int, ready_when_serving: bool = False) -> None:
        stages: list[str] = []
        if ready_when_serving:
            path = self.workdir / "kwok-stages.yaml"
            path.write_text(SERVING_STAGES)
            stages = [f"--config={path}"]
        self._spawn(
            "kwok",
            [
                *stages,
                f"--kubeconfig={self.kubeconfig}",
                "--manage-all-nodes=false",
                "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
                "--manage-nodes-with-label-selector=",
                "--disregard-status-with-annotation-selector=kwok.x-k8s.io/status=custom",
                f"--cidr={pod_cidr}",
                "--node-ip=10.0.0.1",
                f"--node-lease-duration-seconds={node_lease_seconds}",
                f"--server-address=127.0.0.1:{free_port()}",
            ],
        )

    def _add_gpu_nodes(self, gpu_nodes: int, gpus_per_node: int, pods_per_node: int, timeout: float) -> None:
        """``gpu_nodes`` fake nodes for kwok, and the wait until every one is Ready."""
        nodes = "---\n".join(
            gpu_node_manifest(f"gpu-node-{i}", gpus=gpus_per_node, pods=pods_per_node) for i in range(gpu_nodes)
        )
        if gpu_nodes:  # none for a cluster whose only node is a real kubelet (localdev/realnode.py)
            self.kubectl("apply", "-f", "-", input=nodes)
        self.wait_for(
            lambda: (
                self.kubectl(
                    "get",
                    "nodes",
                    "-o",
                    "jsonpath={.items[*].status.conditions[?(@.type=='Ready')].status}",
                )
                .split()
                .count("True")
                == gpu_nodes
            ),
            timeout,
            "fake GPU nodes to become Ready",
        )

    @property
    def audit_log(self) -> Path:
        return self.workdir / "audit.log"

    def _spawn(self, name: str, args: list[str], command: list[str] | None = None) -> None:
        self.commands[name] = [*(command or [str(self.bin_dir / name)]), *args]
        self._launch(name)

    def _launch(self, name: str) -> None:
        log = (self.workdir / "logs" / f"{name}.log").open("ab")
        self.processes[name] = subprocess.Popen(
            self.commands[name],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def stop_component(self, name: str, sig: int = signal.SIGTERM, timeout: float = 30.0) -> None:
        """Stop one component (``etcd``, ``kube-apiserver``, ``kwok``...), keeping its data
        directory and port, so that :meth:`start_component` brings the same one back (the
        drills restart the apiserver and etcd under a running operator)."""
        if name not in self.commands:
            raise ClusterError(f"no component {name!r}; components: {', '.join(self.commands)}")
        proc = self.processes.pop(name, None)
        if proc is not None:
            stop_group(proc, timeout, sig)

    def start_component(self, name: str, timeout: float = 120.0) -> None:
        """Start a component stopped by :meth:`stop_component` again, with the same command
        line (ports, data directory); waits for the apiserver's /readyz when it is back up."""
        if name not in self.commands:
            raise ClusterError(f"no component {name!r}; components: {', '.join(self.commands)}")
        if name in self.processes and self.processes[name].poll() is None:
            raise ClusterError(f"{name} is already running")
        self._launch(name)
        if "kube-apiserver" in self.processes:
            self.wait_ready(timeout)

    def restart(self, name: str, down_for: float = 0.0, sig: int = signal.SIGTERM) -> None:
        """Stop one component, keep it down ``down_for`` seconds, start it again."""
        self.stop_component(name, sig)
        if down_for > 0:
            time.sleep(down_for)
        self.start_component(name)

    def stop(self) -> None:
        stop_groups(reversed(list(self.processes.values())), timeout=15)
        self.processes.clear()

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- helpers ---------------------------------------------------------------------
    def check_alive(self) -> None:
        for name, proc in self.processes.items():
            if proc.poll() is not None:
                tail = (self.workdir / "logs" / f"{name}.log").read_text(errors="replace")[-3000:]
                raise ClusterError(f"{name} exited with {proc.returncode}; last log lines:\n{tail}")

    def wait_ready(self, timeout: float) -> None:
        ctx = ssl.create_default_context(cafile=str(self.workdir / "pki" / "ca.crt"))
        req = urllib.request.Request(f"{self.server}/readyz", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})

        def ready() -> bool:
            try:
                with urllib.request.urlopen(req, context=ctx, timeout=2) as resp:
                    return bool(resp.status == 200)
            except OSError:
                return False

        self.wait_for(ready, timeout, "kube-apiserver /readyz")

    def wait_for(self, predicate: object, timeout: float, what: str) -> None:
        assert callable(predicate)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                if predicate():
                    return
            except subprocess.CalledProcessError:
                pass
            time.sleep(0.25)
        raise ClusterError(f"timed out after {timeout:.0f}s waiting for {what} (logs in {self.workdir / 'logs'})")

    def wait_established(self, *crds: str, timeout: float = 60.0) -> None:
        wait_established([str(self.bin_dir / "kubectl"), f"--kubeconfig={self.kubeconfig}"], list(crds), timeout)

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> str:
        result = subprocess.run(
            [str(self.bin_dir / "kubectl"), f"--kubeconfig={self.kubeconfig}", *args],
            input=input,
            capture_output=True,
            text=True,
            check=False,
        )
        if check and result.returncode != 0:
            raise subprocess.CalledProcessError(result.returncode, result.args, result.stdout, result.stderr)
        return result.stdout


@contextlib.contextmanager
def local_cluster(workdir: Path, gpu_nodes: int = 2) -> Iterator[LocalCluster]:
    cluster = LocalCluster.start(workdir, gpu_nodes=gpu_nodes)
    try:
        yield cluster
    finally:
        cluster.stop()
