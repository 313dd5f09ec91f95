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
import fcntl
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

from batchpilot_localdev import free_port, podnet
from batchpilot_localdev.cluster import (
    ADMIN_TOKEN,
    REPO_ROOT,
    LocalCluster,
    bin_dir,
    make_node_credentials,
    write_cert_kubeconfig,
)
from batchpilot_localdev.processes import stop_group
from batchpilot_localdev.prometheus import KubernetesSD, PrometheusServer
from batchpilot_operator.children import LABEL_POLICY, LABEL_REVISION, LABEL_TRACK, RUNTIME_PORT

NODE_NAME = "bp-node-0"
BRIDGE = "bp-br0"
PROJECT_NET = podnet.REAL_NODE_NET
"""The project's own addresses (RFC 2544 benchmarking range): the bridge, pods, Services."""
POD_SUBNET = "198.18.0.0/24"
NODE_IP = "198.18.0.1"
PAUSE_IMAGE = "localhost/batchpilot/pause:3.10"
CGROUP_ROOT = "batchpilot-node"
CGROUP_FS = Path("/sys/fs/cgroup")
NETNS_DIR = Path("/var/run/netns")
CONTAINER_LOG_LINKS = Path("/var/log/containers")
LOCK_FILE = Path("/run/batchpilot-realnode.lock")
HOST_SYSCTLS = ("vm/overcommit_memory", "kernel/panic", "kernel/panic_on_oops", "net/ipv4/ip_forward")
"""What the kubelet (the first three) and the bridge plugin (forwarding) set on the host: put back on stop."""
NODE_BIN = Path(os.environ.get("BATCHPILOT_NODE_BIN", REPO_ROOT / ".cache" / "node-bin"))
CONTAINERD_ROOT = Path(os.environ.get("BATCHPILOT_CONTAINERD_ROOT", REPO_ROOT / ".cache" / "node" / "containerd"))
ALIASES = CONTAINERD_ROOT.parent / "aliases.json"
"""Second names given to images (:meth:`RealNode.alias`), to remove."""
IMPORTED = CONTAINERD_ROOT.parent / "imported.json"
"""podman's image ID of each image last imported into containerd's root."""
CONTAINERS_CONF = REPO_ROOT / "hack" / "images" / "containers.conf"
PODMAN = ["podman", "--storage-driver", "vfs", "--runtime", "runc"]
BUILDAH = ["buildah", "--storage-driver", "vfs"]
VERSION = next(
    line.split('"')[1]
    for line in (REPO_ROOT / "pyproject.toml").read_text().splitlines()
    if line.startswith("version = ")
)
RUNTIME_IMAGE = f"localhost/batchpilot/runtime:{VERSION}"
OPERATOR_IMAGE = f"localhost/batchpilot/operator:{VERSION}"
REGISTRY_RUNTIME_IMAGE = f"ghcr.io/batchpilot/runtime:{VERSION}"
"""The runtime image as the manifests name it (a registry would serve it)."""


class RealNodeError(RuntimeError):
    """The real node could not be set up or started; the message says which part and why."""


def _run(
    cmd: Sequence[str],
    *,
    check: bool = True,
    timeout: float = 600,
    env: dict[str, str] | None = None,
    input: str | None = None,
) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        list(cmd), capture_output=True, text=True, timeout=timeout, check=False, env=env, input=input
    )
    if check and result.returncode != 0:
        raise RealNodeError(f"{' '.join(cmd)} exited {result.returncode}: {result.stderr.strip()[-2000:]}")
    return result


def _images_env() -> dict[str, str]:
    return {**os.environ, "CONTAINERS_CONF": os.environ.get("CONTAINERS_CONF", str(CONTAINERS_CONF))}


def ensure_node_binaries() -> None:
    """containerd, runc (apt), the CNI plugins and the pause binary (``hack/node/build.sh``), the
    kubelet (``hack/k8s/build.sh``, with the control plane) and upstream Prometheus
    (``hack/prometheus/build.sh``: Debian's has no Kubernetes service discovery); cheap when up to date."""
    for script in ("k8s/build.sh", "node/build.sh", "prometheus/build.sh"):
        result = subprocess.run(["bash", str(REPO_ROOT / "hack" / script)], check=False)
        if result.returncode != 0:
            raise RealNodeError(f"hack/{script} exited {result.returncode}")
    missing = [
        str(p) for p in (bin_dir() / "kubelet", NODE_BIN / "pause", NODE_BIN / "cni" / "bridge") if not p.exists()
    ]
    missing += [tool for tool in ("containerd", "runc", "ctr") if shutil.which(tool) is None]
    if missing:
        raise RealNodeError(f"real node parts missing after the builds: {missing}")


def image_sources(kind: str) -> str:
    """The hash of the sources of the ``operator`` or ``runtime`` image (``hack/images/source-hash.sh``)."""
    return _run(["bash", str(REPO_ROOT / "hack" / "images" / "source-hash.sh"), kind]).stdout.strip()


def stale_images(images: Sequence[str]) -> list[str]:
    """Those of ``images`` (the operator's and the runtime's of ``make images``) that podman
    lacks or built from other sources (their ``dev.batchpilot.source`` label, set by
    ``hack/images.sh``, names another hash)."""
    if shutil.which("podman") is None:
        return list(images)
    stale = []
    for image in images:
        kind = {RUNTIME_IMAGE: "runtime", OPERATOR_IMAGE: "operator"}.get(image)
        if kind is None:
            raise RealNodeError(f"{image} is none of the images of make images ({RUNTIME_IMAGE}, {OPERATOR_IMAGE})")
        label = _run(
            [*PODMAN, "image", "inspect", "--format", '{{index .Labels "dev.batchpilot.source"}}', image],
            check=False,
            env=_images_env(),
        ).stdout.strip()
        if label.split(" ", 1)[0] != image_sources(kind):
            stale.append(image)
    return stale


def ensure_images(images: Sequence[str]) -> None:
    """Build the images of ``make images`` (``hack/images.sh``, which rebuilds only what is
    stale) when podman lacks one of ``images`` or has it from other sources: the real node runs
    the code of the working tree, never an old image."""
    stale = stale_images(images)
    if stale:
        result = subprocess.run(["bash", str(REPO_ROOT / "hack" / "images.sh")], check=False, env=_images_env())
        if result.returncode != 0:
            raise RealNodeError(f"hack/images.sh exited {result.returncode} (building {', '.join(stale)})")
        still = stale_images(images)
        if still:
            raise RealNodeError(f"hack/images.sh left these images stale: {', '.join(still)}")


def containerd_config(state: Path, socket: Path, cni_conf: Path) -> str:
    return f"""version = 2
root = "{CONTAINERD_ROOT}"
state = "{state}"
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]
[grpc]
  address = "{socket}"
[ttrpc]
  address = "{socket}.ttrpc"
[debug]
  address = "{state}/debug.sock"
[metrics]
  address = ""
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  enable_selinux = false
  disable_apparmor = true
  # No CAP_SYS_RESOURCE here: a negative oom_score_adj is refused (see the module's doc).
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{NODE_BIN / "cni"}"
    conf_dir = "{cni_conf}"
    max_conf_num = 1
"""


def cni_config(ipam_dir: Path) -> str:
    """The bridge ``bp-br0`` (198.18.0.1) and host-local addresses from 198.18.0.0/24; the pods'
    only route is 198.18.0.0/15 (no default gateway, no masquerade)."""
    return json.dumps(
        {
            "cniVersion": "1.0.0",
            "name": "batchpilot-pods",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": BRIDGE,
                    "isGateway": True,
                    "isDefaultGateway": False,
                    "ipMasq": False,
                    "hairpinMode": True,
                    "ipam": {
                        "type": "host-local",
                        "dataDir": str(ipam_dir),
                        "ranges": [[{"subnet": POD_SUBNET, "gateway": NODE_IP}]],
                        "routes": [{"dst": str(PROJECT_NET)}],
                    },
                }
            ],
        },
        indent=1,
    )


def kubelet_config(workdir: Path, ca: Path, socket: Path, port: int) -> str:
    return f"""apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
cgroupDriver: cgroupfs
cgroupRoot: /{CGROUP_ROOT}
failSwapOn: false
address: {NODE_IP}
port: {port}
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 0
authentication:
  anonymous: {{enabled: false}}
  webhook: {{enabled: false}}
  x509: {{clientCAFile: {ca}}}
authorization: {{mode: AlwaysAllow}}
resolvConf: ""
podLogsDir: {workdir / "pod-logs"}
containerRuntimeEndpoint: unix://{socket}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard: {{memory.available: "100Mi", nodefs.available: "1%", imagefs.available: "1%"}}
maxPods: 40
serializeImagePulls: false
nodeStatusUpdateFrequency: 2s
syncFrequency: 5s
"""


def _cgroup_hierarchies(*, unified: bool = False) -> list[Path]:
    """The mounted cgroup v1 hierarchies (``/sys/fs/cgroup/<name>``); with ``unified``, also the
    cgroup2 one of a hybrid host (``/sys/fs/cgroup/unified``: runc makes the pods' cgroups there too)."""
    kinds = {"cgroup", "cgroup2"} if unified else {"cgroup"}
    found = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        parts = line.split()
        if len(parts) > 2 and parts[2] in kinds and parts[1].startswith(f"{CGROUP_FS}/"):
            found.append(Path(parts[1]))
    return found


def _remove_cgroup_tree(root: Path, timeout: float = 20.0) -> list[str]:
    """rmdir ``root`` and every cgroup below it, deepest first (killing what is left in them)."""
    deadline = time.monotonic() + timeout
    while True:
        left: list[str] = []
        dirs = sorted((p for p in root.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)) if root.exists() else []
        for d in [*dirs, root]:
            if not d.exists():
                continue
            with contextlib.suppress(OSError):
                for pid in (d / "cgroup.procs").read_text().split():
                    with contextlib.suppress(ProcessLookupError, ValueError):
                        os.kill(int(pid), signal.SIGKILL)
            try:
                d.rmdir()
            except OSError as exc:
                left.append(f"{d}: {exc}")
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


def _mounts_under(*roots: Path) -> list[str]:
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        if any(point == str(r) or point.startswith(f"{r}/") for r in roots):
            points.append(point)
    return points


def _shims(socket: Path) -> list[int]:
    """The containerd shims started by the containerd listening on ``socket``."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"containerd-shim-runc-v2") and str(socket).encode() in argv:
            pids.append(int(proc.name))
    return pids


def _netns_set() -> set[str]:
    return {p.name for p in NETNS_DIR.iterdir()} if NETNS_DIR.exists() else set()


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
        lock = LOCK_FILE.open("w")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            raise RealNodeError(f"another real node runs on this machine (lock {LOCK_FILE} is held)") from None
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
            node.netns_before = _netns_set()
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
        _run(["ip", "link", "add", BRIDGE, "type", "bridge"])
        _run(["ip", "addr", "add", f"{NODE_IP}/24", "dev", BRIDGE])
        _run(["ip", "link", "set", BRIDGE, "up"])
        for hierarchy in _cgroup_hierarchies():
            (hierarchy / CGROUP_ROOT).mkdir(exist_ok=True)
        for d in ("net.d", "cni-ipam", "kubelet", "pki", "pod-logs"):
            (self.workdir / d).mkdir(exist_ok=True)
        (self.workdir / "net.d" / "10-batchpilot.conflist").write_text(cni_config(self.workdir / "cni-ipam"))

    def _cleanup_host(self) -> list[str]:
        problems: list[str] = []
        if _run(["ip", "link", "show", BRIDGE], check=False).returncode == 0:
            result = _run(["ip", "link", "delete", BRIDGE], check=False)
            if result.returncode != 0:
                problems.append(f"ip link delete {BRIDGE}: {result.stderr.strip()}")
        for hierarchy in _cgroup_hierarchies(unified=True):
            problems += _remove_cgroup_tree(hierarchy / CGROUP_ROOT)
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
        image_id = _run([*PODMAN, "image", "inspect", "--format", "{{.Id}}", image], env=_images_env()).stdout.strip()
        try:
            imported = json.loads(IMPORTED.read_text())
        except (OSError, ValueError):
            imported = {}
        if imported.get(image) == image_id and self.has_image(image):
            return
        t0 = time.monotonic()
        with tempfile.TemporaryFile() as archive:
            save = subprocess.run(
                [*PODMAN, "save", image], stdout=archive, stderr=subprocess.PIPE, env=_images_env(), check=False
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
        env = _images_env()
        ctr = _run([*BUILDAH, "from", "scratch"], env=env).stdout.strip()
        try:
            _run([*BUILDAH, "copy", ctr, str(NODE_BIN / "pause"), "/pause"], env=env)
            _run([*BUILDAH, "config", "--entrypoint", '["/pause"]', "--user", "65535:65535", ctr], env=env)
            _run([*BUILDAH, "commit", "--quiet", "--rm", ctr, PAUSE_IMAGE], env=env)
        except BaseException:
            _run([*BUILDAH, "rm", ctr], check=False, env=env)
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
        return _run(cmd, check=check, timeout=60, input=input).stdout

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
        for pid in _shims(self.socket):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for point in reversed(_mounts_under(self.workdir, self.state, CONTAINERD_ROOT)):
            result = _run(["umount", "--lazy", point], check=False)
            if result.returncode != 0:
                problems.append(f"umount {point}: {result.stderr.strip()}")
        for name in sorted(_netns_set() - self.netns_before):
            if name.startswith("cni-"):
                _run(["umount", "--lazy", str(NETNS_DIR / name)], check=False)
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
