"""What the real node (:mod:`.realnode`) sets up on this machine, and undoes on stop.

Its addresses (the bridge ``bp-br0``, 198.18.0.1, the pods' 198.18.0.0/24), the configuration
files of containerd, the CNI plugins and the kubelet (why each unusual setting is there: the
doc of :mod:`.realnode`), the kubelet's cgroup root, and what a stop looks for to clean up:
cgroups, mounts, the pods' network namespaces, containerd's shims.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path

from batchpilot_localdev import podnet
from batchpilot_localdev.nodeimages import CONTAINERD_ROOT, NODE_BIN, PAUSE_IMAGE

BRIDGE = "bp-br0"
PROJECT_NET = podnet.REAL_NODE_NET
"""The project's own addresses (RFC 2544 benchmarking range): the bridge, pods, Services."""
POD_SUBNET = "198.18.0.0/24"
NODE_IP = "198.18.0.1"
CGROUP_ROOT = "batchpilot-node"
CGROUP_FS = Path("/sys/fs/cgroup")
NETNS_DIR = Path("/var/run/netns")


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


def cgroup_hierarchies(*, unified: bool = False) -> list[Path]:
    """The mounted cgroup v1 hierarchies (``/sys/fs/cgroup/<name>``); with ``unified``, also the
    cgroup2 one of a hybrid host (``/sys/fs/cgroup/unified``: runc makes the pods' cgroups there too)."""
    kinds = {"cgroup", "cgroup2"} if unified else {"cgroup"}
    found = []
    for line in Path("/proc/self/mounts").read_text().splitlines():
        parts = line.split()
        if len(parts) > 2 and parts[2] in kinds and parts[1].startswith(f"{CGROUP_FS}/"):
            found.append(Path(parts[1]))
    return found


def remove_cgroup_tree(root: Path, timeout: float = 20.0) -> list[str]:
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


def mounts_under(*roots: Path) -> list[str]:
    points = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].replace("\\040", " ")
        if any(point == str(r) or point.startswith(f"{r}/") for r in roots):
            points.append(point)
    return points


def shims(socket: Path) -> list[int]:
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


def netns_set() -> set[str]:
    return {p.name for p in NETNS_DIR.iterdir()} if NETNS_DIR.exists() else set()
