"""A real Kubernetes node beside the local control plane: a kubelet and containerd run our images.

kwok only pretends (localdev/cluster.py). This node is real: the kubelet built from the same
pinned ``k8s.io/kubernetes`` as the control plane (``hack/k8s/build.sh``), Debian's containerd
with runc and the cgroupfs driver (there is no systemd here), and the CNI bridge and host-local
plugins (``hack/node/build.sh``) on the project's own bridge ``bp-br0`` with addresses from
198.18.0.0/24 (the node itself is 198.18.0.1, the bridge's address). Nothing is pulled from a
registry: the sandbox (pause) image is made here from a static Go binary, and the images of
``make images`` are copied from podman's store into containerd (``podman save | ctr import``),
once: containerd's root lies in ``.cache/node/containerd`` and keeps them between runs; an image
is imported again only when podman's copy has another ID. The node advertises ``nvidia.com/gpu``
(an extended resource standing in for GPUs) by a patch of its status.

What this machine needs, and why (each was an error first):

* containerd runs with ``restrict_oom_score_adj = true``: this machine's root has no
  CAP_SYS_RESOURCE, so a negative ``oom_score_adj`` (the CRI gives sandboxes -998) is refused
  and runc fails with "can't get final child's PID from pipe: EOF"
  (nsexec: "failed to update /proc/self/oom_score_adj: Permission denied").
* the bridge exists before the kubelet starts: ``--node-ip`` must be an address of the host.
* the kubelet's ``cgroupRoot`` (one cgroup per v1 hierarchy) is made first, and removed after.

Pods have no default route (only 198.18.0.0/15 via the bridge), no cluster DNS and no service
account token: nothing in them can reach past the bridge. The kubelet is ``system:node:bp-node-0``
(a client certificate from the cluster's CA), held to its own node by the Node authorizer and
NodeRestriction admission, not the admin. One real node at a time per machine
(the bridge, its subnet and ``/var/run/netns`` are machine-wide): a lock file says so.

Usage::

    with RealNode.start(cluster.kubeconfig, cluster.workdir / "pki" / "ca.crt", workdir,
                        images=[RUNTIME_IMAGE]) as node:
        node.name  # schedule pods here
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import yaml

from batchpilot_localdev import free_port
from batchpilot_localdev.cluster import ADMIN_TOKEN, REPO_ROOT, LocalCluster, bin_dir
from batchpilot_localdev.nodehost import (
    BRIDGE,
    CGROUP_ROOT,
    NETNS_DIR,
    NODE_IP,
    cgroup_hierarchies,
    cni_config,
    containerd_config,
    kubelet_config,
    mounts_under,
    netns_set,
    remove_cgroup_tree,
    shims,
)
from batchpilot_localdev.nodeimages import (
    ALIASES,
    BUILDAH,
    CONTAINERD_ROOT,
    IMPORTED,
    NODE_BIN,
    PAUSE_IMAGE,
    PODMAN,
    REGISTRY_RUNTIME_IMAGE,
    RUNTIME_IMAGE,
    RealNodeError,
    ensure_images,
    ensure_node_binaries,
    images_env,
    run_command,
)
from batchpilot_localdev.pki import make_node_credentials, write_cert_kubeconfig
from batchpilot_localdev.processes import stop_group, try_lock
from batchpilot_localdev.prometheus import KubernetesSD, PrometheusServer
from batchpilot_operator.children import LABEL_POLICY, LABEL_REVISION, LABEL_TRACK, RUNTIME_PORT

NODE_NAME = "bp-node-0"
CONTAINER_LOG_LINKS = Path("/var/log/containers")
LOCK_FILE = Path("/run/batchpilot-realnode.lock")
HOST_SYSCTLS = ("vm/overcommit_memory", "kernel/panic", "kernel/panic_on_oops", "net/ipv4/ip_forward")
"""What the kubelet (the first three) and the bridge plugin (forwarding) set on the host: put back on stop."""


@dataclass
class RealNode:
    workdir: Path
    state: Path
    """containerd's state directory and sockets: a short path (a Unix socket path has at most 107 bytes)."""
    kubeconfig: Path
    kubectl_bin: Path
    name: str = NODE_NAME
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    netns_before: set[str] = field(default_factory=set)
    lock: IO[str] | None = None
    started_in: float = 0.0
    sysctls: dict[str, str] = field(default_factory=dict)
    """The host's :data:`HOST_SYSCTLS` before the node started."""
    imported: dict[str, float] = field(default_factory=dict)
    """Seconds each image's import into containerd took this start (absent: it was there already)."""

    @property
    def socket(self) -> Path:
        return self.state / "containerd.sock"

    @classmethod
    def start(
        cls,
        kubeconfig: Path,
        ca: Path,
        workdir: Path,
        *,
        images: Sequence[str] = (RUNTIME_IMAGE,),
        gpus: int = 4,
        timeout: float = 120.0,
    ) -> RealNode:
        """Start containerd and a kubelet registered as :data:`NODE_NAME` with the apiserver of
        ``kubeconfig`` (whose CA is ``ca``); import ``images`` (building them first when podman
        has none) and the pause image; wait for the node to be Ready with ``gpus`` of
        ``nvidia.com/gpu``. The kubelet authenticates as ``system:node:<name>`` with a client
        certificate signed by ``ca``'s key (:meth:`kubelet_kubeconfig`); the node's GPUs are
        patched in with ``kubeconfig``'s credentials."""
        t0 = time.monotonic()
        ensure_node_binaries()
        ensure_images(images)
        lock = try_lock(LOCK_FILE)
        if lock is None:
            raise RealNodeError(f"another real node runs on this machine (lock {LOCK_FILE} is held)")
        workdir = workdir.resolve()
        workdir.mkdir(parents=True, exist_ok=True)
        (workdir / "logs").mkdir(exist_ok=True)
        node = cls(
            workdir=workdir,
            state=Path(tempfile.mkdtemp(prefix="bp-node-")),
            kubeconfig=kubeconfig,
            kubectl_bin=bin_dir() / "kubectl",
            lock=lock,
        )
        try:
            node._cleanup_host()  # what a run that died left: bridge, cgroups
            node.sysctls = {k: (Path("/proc/sys") / k).read_text().strip() for k in HOST_SYSCTLS}
            node.netns_before = netns_set()
            node._setup_host()
            node._start_containerd()
            node._import_pause()
            for image in images:
                node.import_image(image)
            node._start_kubelet(ca)
            node.wait_for(node._node_ready, timeout, f"node {node.name} to be Ready")
            node.set_gpus(gpus)
        except BaseException:
            node.stop()
            raise
        node.started_in = time.monotonic() - t0
        return node

    # ---- host set-up -------------------------------------------------------------------
    def _setup_host(self) -> None:
        run_command(["ip", "link", "add", BRIDGE, "type", "bridge"])
        run_command(["ip", "addr", "add", f"{NODE_IP}/24", "dev", BRIDGE])
        run_command(["ip", "link", "set", BRIDGE, "up"])
        for hierarchy in cgroup_hierarchies():
            (hierarchy / CGROUP_ROOT).mkdir(exist_ok=True)
        for d in ("net.d", "cni-ipam", "kubelet", "pki", "pod-logs"):
            (self.workdir / d).mkdir(exist_ok=True)
        (self.workdir / "net.d" / "10-batchpilot.conflist").write_text(cni_config(self.workdir / "cni-ipam"))

    def _cleanup_host(self) -> list[str]:
        problems: list[str] = []
        if run_command(["ip", "link", "show", BRIDGE], check=False).returncode == 0:
            result = run_command(["ip", "link", "delete", BRIDGE], check=False)
            if result.returncode != 0:
                problems.append(f"ip link delete {BRIDGE}: {result.stderr.strip()}")
        for hierarchy in cgroup_hierarchies(unified=True):
            problems += remove_cgroup_tree(hierarchy / CGROUP_ROOT)
        return problems

    # ---- containerd --------------------------------------------------------------------
    def _spawn(self, name: str, cmd: list[str]) -> None:
        log = (self.workdir / "logs" / f"{name}.log").open("ab")
        self.processes[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        log.close()

    def ctr(self, *args: str, check: bool = True, input_file: IO[bytes] | None = None) -> str:
        result = subprocess.run(
            ["ctr", "--address", str(self.socket), "--namespace", "k8s.io", *args],
            stdin=input_file,
            capture_output=True,
            check=False,
            timeout=900,
        )
        if check and result.returncode != 0:
            raise RealNodeError(f"ctr {' '.join(args)} exited {result.returncode}: {result.stderr.decode()[-2000:]}")
        return result.stdout.decode()

    def _start_containerd(self) -> None:
        CONTAINERD_ROOT.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "containerd.toml"
        config.write_text(containerd_config(self.state / "containerd", self.socket, self.workdir / "net.d"))
        self._spawn("containerd", ["containerd", "--config", str(config)])
        self.wait_for(lambda: self.ctr("version", check=False) != "", 30, "containerd's socket")
        # Containers a killed run left in containerd's (kept) metadata: gone before the kubelet
        # starts; so are the second names it gave images.
        self._remove_containers()
        self._remove_aliases()

    def _remove_containers(self) -> None:
        for task in self.ctr("tasks", "ls", "-q", check=False).split():
            self.ctr("tasks", "kill", "--signal", "SIGKILL", task, check=False)
        deadline = time.monotonic() + 15
        while self.ctr("tasks", "ls", "-q", check=False).split() and time.monotonic() < deadline:
            for task in self.ctr("tasks", "ls", "-q", check=False).split():
                self.ctr("tasks", "delete", "--force", task, check=False)
            time.sleep(0.2)
        for container in self.ctr("containers", "ls", "-q", check=False).split():
            self.ctr("containers", "delete", container, check=False)

    def has_image(self, ref: str) -> bool:
        return ref in self.ctr("images", "ls", "-q").split()

    def import_image(self, image: str) -> None:
        """Copy ``image`` from podman's store into containerd, unless containerd has the very
        image podman has (podman's image ID, recorded in :data:`IMPORTED` at its import: the
        docker archive gives the image another config digest in containerd)."""
        image_id = run_command(
            [*PODMAN, "image", "inspect", "--format", "{{.Id}}", image], env=images_env()
        ).stdout.strip()
        try:
            imported = json.loads(IMPORTED.read_text())
        except (OSError, ValueError):
            imported = {}
        if imported.get(image) == image_id and self.has_image(image):
            return
        t0 = time.monotonic()
        with tempfile.TemporaryFile() as archive:
            save = subprocess.run(
                [*PODMAN, "save", image], stdout=archive, stderr=subprocess.PIPE, env=images_env(), check=False
            )
            if save.returncode != 0:
                raise RealNodeError(f"podman save {image}: {save.stderr.decode()[-2000:]}")
            archive.seek(0)
            self.ctr("images", "import", "-", input_file=archive)
        imported[image] = image_id
        IMPORTED.write_text(json.dumps(imported, indent=1))
        self.imported[image] = time.monotonic() - t0

    def alias(self, image: str, name: str) -> None:
        """Give ``image`` a second name in containerd (what a manifest names, e.g. the registry's)
        while this node runs: removed on stop (and at the next start, after a crash), since the
        kubelet reports a container's image by the first of its names."""
        aliases = self._aliases()
        ALIASES.write_text(json.dumps(sorted({*aliases, name})))
        self.ctr("images", "tag", "--force", image, name)

    def _aliases(self) -> list[str]:
        try:
            names: list[str] = json.loads(ALIASES.read_text())
        except (OSError, ValueError):
            return []
        return names

    def _remove_aliases(self) -> None:
        aliases = self._aliases()
        if aliases:
            self.ctr("images", "rm", *aliases, check=False)
        ALIASES.unlink(missing_ok=True)

    def _import_pause(self) -> None:
        if self.has_image(PAUSE_IMAGE):
            return
        env = images_env()
        ctr = run_command([*BUILDAH, "from", "scratch"], env=env).stdout.strip()
        try:
            run_command([*BUILDAH, "copy", ctr, str(NODE_BIN / "pause"), "/pause"], env=env)
            run_command([*BUILDAH, "config", "--entrypoint", '["/pause"]', "--user", "65535:65535", ctr], env=env)
            run_command([*BUILDAH, "commit", "--quiet", "--rm", ctr, PAUSE_IMAGE], env=env)
        except BaseException:
            run_command([*BUILDAH, "rm", ctr], check=False, env=env)
            raise
        self.import_image(PAUSE_IMAGE)

    # ---- kubelet -----------------------------------------------------------------------
    def kubelet_kubeconfig(self, ca: Path) -> Path:
        """The kubelet's own credentials: a client certificate for ``system:node:<name>``
        signed by the cluster's CA (the key beside ``ca``), so the Node authorizer and
        NodeRestriction confine it to this node as in a real cluster."""
        cert, key = make_node_credentials(ca.parent, self.name)
        admin = yaml.safe_load(self.kubeconfig.read_text())
        server = admin["clusters"][0]["cluster"]["server"]
        path = self.workdir / "kubelet.kubeconfig"
        write_cert_kubeconfig(path, server, ca, f"system:node:{self.name}", cert, key)
        return path

    def _start_kubelet(self, ca: Path) -> None:
        config = self.workdir / "kubelet.yaml"
        config.write_text(kubelet_config(self.workdir, ca, self.socket, free_port()))
        self._spawn(
            "kubelet",
            [
                str(bin_dir() / "kubelet"),
                f"--config={config}",
                f"--kubeconfig={self.kubelet_kubeconfig(ca)}",
                f"--root-dir={self.workdir / 'kubelet'}",
                f"--cert-dir={self.workdir / 'pki'}",
                f"--hostname-override={self.name}",
                f"--node-ip={NODE_IP}",
                "--v=2",
            ],
        )

    def kubectl(self, *args: str, check: bool = True, input: str | None = None) -> str:
        cmd = [str(self.kubectl_bin), f"--kubeconfig={self.kubeconfig}", *args]
        return run_command(cmd, check=check, timeout=60, input=input).stdout

    def _node_ready(self) -> bool:
        out = self.kubectl(
            "get", "node", self.name, "-o", "jsonpath={.status.conditions[?(@.type=='Ready')].status}", check=False
        )
        return out.strip() == "True"

    def set_gpus(self, gpus: int) -> None:
        """Advertise ``gpus`` of the extended resource ``nvidia.com/gpu`` (the kubelet keeps an
        extended resource it does not manage, and copies it to allocatable)."""
        patch = [{"op": "add", "path": "/status/capacity/nvidia.com~1gpu", "value": str(gpus)}]
        self.kubectl("patch", "node", self.name, "--subresource=status", "--type=json", "-p", json.dumps(patch))
        jsonpath = "jsonpath={.status.allocatable.nvidia\\.com/gpu}"
        self.wait_for(
            lambda: self.kubectl("get", "node", self.name, "-o", jsonpath).strip() == str(gpus),
            30,
            f"nvidia.com/gpu {gpus} allocatable on {self.name}",
        )

    # ---- lifecycle ---------------------------------------------------------------------
    def check_alive(self) -> None:
        for name, proc in self.processes.items():
            if proc.poll() is not None:
                raise RealNodeError(f"{name} exited with {proc.returncode}; last log lines:\n{self.log_tail(name)}")

    def log_tail(self, name: str, chars: int = 3000) -> str:
        with contextlib.suppress(OSError):
            return (self.workdir / "logs" / f"{name}.log").read_text(errors="replace")[-chars:]
        return ""

    def wait_for(self, predicate: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive()
            if predicate():
                return
            time.sleep(0.25)
        raise RealNodeError(f"timed out after {timeout:.0f}s waiting for {what} (logs in {self.workdir / 'logs'})")

    def _stop_process(self, name: str, timeout: float = 15.0) -> None:
        proc = self.processes.pop(name, None)
        if proc is not None:
            stop_group(proc, timeout)

    def stop(self) -> list[str]:
        """Stop the kubelet, every container (SIGKILL), containerd; then undo the host's set-up:
        mounts under the node's directories, the pods' network namespaces, the bridge, the
        cgroups. Returns what could not be undone (also logged in ``logs/cleanup.log``)."""
        self._stop_process("kubelet")
        problems: list[str] = []
        if self.processes.get("containerd") is not None:
            try:
                self._remove_containers()
                self._remove_aliases()
            except (RealNodeError, OSError, subprocess.SubprocessError) as exc:
                problems.append(f"removing containers: {exc}")
        self._stop_process("containerd")
        # A shim (one per pod) outlives containerd when its task could not be deleted.
        for pid in shims(self.socket):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for point in reversed(mounts_under(self.workdir, self.state, CONTAINERD_ROOT)):
            result = run_command(["umount", "--lazy", point], check=False)
            if result.returncode != 0:
                problems.append(f"umount {point}: {result.stderr.strip()}")
        for name in sorted(netns_set() - self.netns_before):
            if name.startswith("cni-"):
                run_command(["umount", "--lazy", str(NETNS_DIR / name)], check=False)
                with contextlib.suppress(OSError):
                    (NETNS_DIR / name).unlink()
        problems += self._cleanup_host()
        # The kubelet links each container's log into /var/log/containers (a fixed path).
        if CONTAINER_LOG_LINKS.exists():
            for link in CONTAINER_LOG_LINKS.iterdir():
                if link.is_symlink() and os.readlink(link).startswith(f"{self.workdir}/"):
                    link.unlink(missing_ok=True)
        for key, value in self.sysctls.items():
            try:
                (Path("/proc/sys") / key).write_text(value)
            except OSError as exc:
                problems.append(f"sysctl {key}={value}: {exc}")
        shutil.rmtree(self.state, ignore_errors=True)
        if problems:
            with contextlib.suppress(OSError):
                (self.workdir / "logs" / "cleanup.log").write_text("\n".join(problems) + "\n")
        if self.lock is not None:
            self.lock.close()
            self.lock = None
        return problems

    def __enter__(self) -> RealNode:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_beside(cluster: LocalCluster, workdir: Path, *, gpus: int = 4) -> RealNode:
    """The real node of ``cluster`` (its CA signs the kubelet's certificate), which also has the
    runtime image under the name the manifests give it (:data:`REGISTRY_RUNTIME_IMAGE`), so that
    an example or the demo's policy runs as written."""
    node = RealNode.start(cluster.kubeconfig, cluster.workdir / "pki" / "ca.crt", workdir, gpus=gpus)
    node.alias(RUNTIME_IMAGE, REGISTRY_RUNTIME_IMAGE)
    return node


def prepare_namespace(cluster: LocalCluster, namespace: str, workdir: Path) -> PrometheusServer:
    """Make ``cluster`` ready for policies in ``namespace`` on the real node: the CRD
    established, ``namespace`` (created when absent) enforcing the restricted Pod Security
    Standard, and a Prometheus in ``workdir`` scraping every second the pods it finds there by
    Kubernetes service discovery, as the PodMonitor does in a cluster. Returns it started."""
    cluster.kubectl("apply", "-f", str(REPO_ROOT / "crds" / "batchingpolicy.yaml"))
    cluster.wait_established("batchingpolicies.batchpilot.dev")
    if cluster.kubectl("get", "namespace", namespace, "--ignore-not-found", "-o", "name") == "":
        cluster.kubectl("create", "namespace", namespace)
    cluster.kubectl("label", "--overwrite", "namespace", namespace, "pod-security.kubernetes.io/enforce=restricted")
    sd = KubernetesSD(cluster.server, cluster.workdir / "pki" / "ca.crt", ADMIN_TOKEN, (namespace,))
    prom = PrometheusServer(workdir, scrape_interval="1s", kubernetes_sd=sd)
    prom.start()
    return prom


@dataclass(frozen=True)
class PodEndpoint:
    """A ready runtime pod on the node: where a :class:`~batchpilot_localdev.load.TraceReplay`
    sends a request (its ``Endpoint``), at the pod's own address on the bridge."""

    pod: str
    ip: str
    revision: str
    track: str

    @property
    def url(self) -> str:
        return f"http://{self.ip}:{RUNTIME_PORT}"


class PodEndpoints:
    """Where the policy's Service routes, as kube-proxy reads it: the endpoints of the Service's
    EndpointSlices (``kubernetes.io/service-name=<policy>``, both tracks) whose ``ready``
    condition is true and that are not terminating, re-read every ``period`` seconds in a thread
    (there is no kube-proxy here). The kubelet's readiness probe sets that condition, so a pod
    still loading its model gets no request. Call it for the current list."""

    def __init__(self, kubeconfig: Path, namespace: str, policy: str, period: float = 0.5) -> None:
        from kubernetes import client, config

        api = config.new_client_from_config(config_file=str(kubeconfig))  # type: ignore[no-untyped-call]
        self.core = client.CoreV1Api(api)
        self.discovery = client.DiscoveryV1Api(api)
        self.namespace, self.policy, self.period = namespace, policy, period
        self._current: list[PodEndpoint] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"endpoints-{policy}", daemon=True)

    def start(self) -> PodEndpoints:
        self.refresh()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)

    def __call__(self) -> list[PodEndpoint]:
        return self._current

    def refresh(self) -> None:
        # raw JSON (untyped): the EndpointSlices say where to route, the pods' labels which
        # revision and track each address serves.
        slices: Any = self.discovery.list_namespaced_endpoint_slice(
            self.namespace, label_selector=f"kubernetes.io/service-name={self.policy}", _preload_content=False
        )
        pods: Any = self.core.list_namespaced_pod(
            self.namespace, label_selector=f"{LABEL_POLICY}={self.policy}", _preload_content=False
        )
        labels = {p["metadata"]["name"]: p["metadata"].get("labels") or {} for p in json.loads(pods.data)["items"]}
        found = []
        for es in json.loads(slices.data)["items"]:
            for ep in es.get("endpoints") or []:
                cond = ep.get("conditions") or {}
                ref = ep.get("targetRef") or {}
                pod_labels = labels.get(ref.get("name", ""))
                if not cond.get("ready") or cond.get("terminating") or not pod_labels or not ep.get("addresses"):
                    continue
                found.append(
                    PodEndpoint(ref["name"], ep["addresses"][0], pod_labels[LABEL_REVISION], pod_labels[LABEL_TRACK])
                )
        self._current = found

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            with contextlib.suppress(Exception):  # the apiserver restarting: keep the last list
                self.refresh()
