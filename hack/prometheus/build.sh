#!/usr/bin/env bash
# Builds upstream Prometheus (pinned in go.mod: v2.53.4, the module's v0.53.4) once into a
# git-ignored cache, for the real node's tests: Debian's prometheus (which the rest of the tests
# and the demo use) is built without Kubernetes service discovery, and the real node's Prometheus
# finds the pods the way the PodMonitor has it done in a cluster (kubernetes_sd_configs, role pod).
# Rebuilds only when go.mod, go.sum or this file change (stamp).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${BATCHPILOT_PROMETHEUS_BIN:-$here/../../.cache/prometheus-bin}
mkdir -p "$out"
stamp=$(cat "$here/go.mod" "$here/go.sum" "$here/build.sh" | sha256sum | cut -c1-16)
if [[ -f "$out/.stamp" && "$(cat "$out/.stamp")" == "$stamp" && -x "$out/prometheus" ]]; then
  echo "prometheus up to date in $out"
  exit 0
fi
cd "$here"
version=$(go list -m -f '{{.Version}}' github.com/prometheus/prometheus | sed 's/^v0\./2./')
echo ">> go build prometheus $version (upstream, with Kubernetes service discovery; first build takes a few minutes)"
CGO_ENABLED=0 GOFLAGS=-buildvcs=false go build -trimpath \
  -ldflags="-s -w -X github.com/prometheus/common/version.Version=$version" \
  -o "$out/prometheus" github.com/prometheus/prometheus/cmd/prometheus
echo "$stamp" > "$out/.stamp"
echo "prometheus built in $out"
