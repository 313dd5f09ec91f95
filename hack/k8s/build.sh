#!/usr/bin/env bash
# Builds the local control plane once into a git-ignored cache:
#   etcd, kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, the kubelet of the
#   local real node (batchpilot_localdev/realnode.py) (k8s.io/kubernetes, pinned in go.mod) and kwok
#   (sigs.k8s.io/kwok, pinned below, built in its own module graph).
# Rebuilds only when the pins change (the stamp is a hash of go.mod, go.sum and this file).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
KWOK_VERSION=v0.7.0
out=${BATCHPILOT_K8S_BIN:-$here/../../.cache/k8s-bin}
mkdir -p "$out"
stamp=$(cat "$here/go.mod" "$here/go.sum" "$here/build.sh" "$here/etcd.go" | sha256sum | cut -c1-16)
if [[ -f "$out/.stamp" && "$(cat "$out/.stamp")" == "$stamp" ]]; then
  echo "control plane binaries up to date in $out"
  exit 0
fi
export CGO_ENABLED=0 GOFLAGS=-buildvcs=false
cd "$here"
k8s_version=$(go list -m -f '{{.Version}}' k8s.io/kubernetes)
v=k8s.io/component-base/version
cv=k8s.io/client-go/pkg/version
ldflags="-s -w"
for pkg in $v $cv; do
  ldflags+=" -X $pkg.gitVersion=$k8s_version -X $pkg.gitTreeState=clean"
  ldflags+=" -X $pkg.gitMajor=1 -X $pkg.gitMinor=$(echo "$k8s_version" | cut -d. -f2)"
done
for cmd in kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet; do
  echo ">> go build $cmd $k8s_version (first build takes several minutes on 2 cores)"
  go build -trimpath -ldflags="$ldflags" -o "$out/$cmd" "k8s.io/kubernetes/cmd/$cmd"
done
echo ">> go build etcd"
go build -trimpath -ldflags="-s -w" -o "$out/etcd" .
echo ">> go install kwok $KWOK_VERSION"
GOBIN="$out" go install -trimpath -ldflags="-s -w" "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION"
echo "$stamp" > "$out/.stamp"
echo "control plane binaries built in $out"
