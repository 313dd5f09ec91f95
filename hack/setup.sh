#!/usr/bin/env bash
# One-time (and idempotent) set-up for the demo and the tests on a Debian machine:
#   apt packages (Prometheus + promtool, Lua 5.1, openssl, Go when missing), a virtualenv in .venv with torch
#   and batchpilot (editable, all extras; versions from hack/requirements*.lock), the local
#   control plane and the kubelet built from Go modules, and the real node's containerd, runc and
#   CNI plugins (hack/node/build.sh, which also installs buildah, podman and mmdebstrap for
#   `make images`: the image tests and the real node's tests build the images on first use).
# Re-running it reuses what is there: each step is skipped when its inputs did not change.
set -euo pipefail
cd "$(dirname "$0")/.."
say() { printf '\033[1m>> %s\033[0m\n' "$*"; }

# --- system packages ------------------------------------------------------------------
need=()
command -v prometheus >/dev/null || need+=(prometheus)
command -v promtool >/dev/null || need+=(prometheus)
command -v lua5.1 >/dev/null || need+=(lua5.1)
command -v openssl >/dev/null || need+=(openssl)
command -v go >/dev/null || need+=(golang-go)
if ((${#need[@]})); then
  say "apt-get install ${need[*]}"
  sudo_=""; [[ $(id -u) == 0 ]] || sudo_=sudo
  $sudo_ apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_ apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  # Debian starts a system Prometheus on :9090; the tests start their own on free ports.
  $sudo_ systemctl disable --now prometheus prometheus-node-exporter >/dev/null 2>&1 || true
fi

# --- python ---------------------------------------------------------------------------
# Versions come from the lock files (hack/lock.sh writes them from pyproject.toml), installed
# in hash-checking mode by uv (from PyPI, pinned in the lock too): the same packages every time.
PY=${PYTHON:-python3}
if [[ ! -x .venv/bin/python ]]; then
  say "creating .venv"
  "$PY" -m venv .venv
fi
uv_version=$(sed -n 's/^uv==\([^ ;]*\).*/\1/p' hack/requirements.lock)
if [[ "$(.venv/bin/uv --version 2>/dev/null | cut -d' ' -f2)" != "$uv_version" ]]; then
  say "installing uv $uv_version (the installer of the locked dependencies)"
  .venv/bin/pip install -q "uv==$uv_version"
fi
uv_install() { .venv/bin/uv pip install --python .venv/bin/python --quiet "$@"; }
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  # Prefer a CPU-only torch wheel lying on the machine (PyPI's Linux torch is a multi-GB
  # CUDA build); otherwise install PyPI's, as locked.
  wheel=${BATCHPILOT_TORCH_WHEEL:-$(ls /opt/wheels/torch-*cpu*.whl 2>/dev/null | head -n1 || true)}
  if [[ -n "$wheel" ]]; then
    say "installing torch from $wheel (its dependencies at the versions of hack/requirements-torch.lock)"
    sed -e 's/ \\$//' -e '/--hash=/d' -e '/^torch==/d' hack/requirements-torch.lock > .venv/torch-constraints.txt
    uv_install "$wheel" -c .venv/torch-constraints.txt
  else
    say "installing torch from PyPI as locked in hack/requirements-torch.lock (large download, once)"
    uv_install --require-hashes -r hack/requirements-torch.lock
  fi
fi
stamp=$(cat pyproject.toml hack/requirements.lock | sha256sum | cut -c1-16)
if [[ "$(cat .venv/.batchpilot-stamp 2>/dev/null)" != "$stamp" ]]; then
  say "installing the locked dependencies (hack/requirements.lock) and batchpilot (editable) into .venv"
  uv_install --require-hashes -r hack/requirements.lock
  uv_install --no-deps -e .
  echo "$stamp" > .venv/.batchpilot-stamp
fi

# --- the local control plane ----------------------------------------------------------
say "control plane binaries and the kubelet (go build through the module proxy; first time ~7 min on 2 cores)"
bash hack/k8s/build.sh
say "the real node's parts: containerd, runc, CNI plugins, pause (tests/node; batchpilot_localdev/realnode.py)"
bash hack/node/build.sh
say "upstream Prometheus with Kubernetes service discovery, for the real node (go build; first time ~4 min)"
bash hack/prometheus/build.sh
bash hack/build-toxiproxy.sh  # Toxiproxy v2.12.0 for the dependency drills (tests/drills)
say "Contour (the local Gateway API controller; go install, first time ~4 min on 2 cores)"
bash hack/build-contour.sh
