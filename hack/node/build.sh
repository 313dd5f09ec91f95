#!/usr/bin/env bash
# The local real node's parts beside the kubelet (which hack/k8s/build.sh builds with the control
# plane, from the same pinned k8s.io/kubernetes), into a git-ignored cache:
#   containerd and runc (Debian packages, apt-get install when missing; with buildah, podman and
#   mmdebstrap, which build the images the node runs);
#   the CNI plugins bridge, host-local and loopback (github.com/containernetworking/plugins,
#   pinned below; go install through the module proxy) in .cache/node-bin/cni;
#   the sandbox (pause) binary from hack/node/pause (static Go) in .cache/node-bin/pause.
# batchpilot_localdev/realnode.py makes the pause image from it and imports it into containerd: there is
# no registry to pull registry.k8s.io/pause from. Rebuilds only when this file or the pause
# source changes (stamp).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
CNI_VERSION=v1.6.2
out=${BATCHPILOT_NODE_BIN:-$here/../../.cache/node-bin}
# buildah, podman and mmdebstrap: `make images` (hack/images.sh), whose images the node runs.
need=()
for tool in containerd runc buildah podman mmdebstrap; do command -v "$tool" >/dev/null || need+=("$tool"); done
if ((${#need[@]})); then
  echo ">> apt-get install ${need[*]}"
  sudo_=""; [[ $(id -u) == 0 ]] || sudo_=sudo
  $sudo_ apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_ apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  # Debian's package starts a system containerd; the real node runs its own, on a private socket.
  $sudo_ systemctl disable --now containerd >/dev/null 2>&1 || true
fi
mkdir -p "$out/cni"
stamp=$(cat "$here/build.sh" "$here/pause/main.go" "$here/pause/go.mod" | sha256sum | cut -c1-16)
if [[ -f "$out/.stamp" && "$(cat "$out/.stamp")" == "$stamp" ]]; then
  echo "node binaries up to date in $out"
  exit 0
fi
export CGO_ENABLED=0 GOFLAGS=-buildvcs=false
cni=github.com/containernetworking/plugins/plugins
echo ">> go install CNI plugins $CNI_VERSION (bridge, host-local, loopback)"
GOBIN="$out/cni" go install -trimpath -ldflags="-s -w" \
  "$cni/main/bridge@$CNI_VERSION" "$cni/ipam/host-local@$CNI_VERSION" "$cni/main/loopback@$CNI_VERSION"
echo ">> go build pause"
(cd "$here/pause" && go build -trimpath -ldflags="-s -w" -o "$out/pause" .)
echo "$stamp" > "$out/.stamp"
echo "node binaries built in $out"
