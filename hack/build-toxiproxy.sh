#!/usr/bin/env bash
# Builds Toxiproxy (github.com/Shopify/toxiproxy/v2, pinned below) once into a git-ignored
# cache, for the dependency slow-down drills (tests/drills). `@latest` resolves to an old 2022
# release, so the version is pinned. Rebuilds only when this file changes (the stamp is its hash).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
TOXIPROXY_VERSION=v2.12.0
out=${BATCHPILOT_TOXIPROXY_BIN:-$here/../.cache/toxiproxy-bin}
mkdir -p "$out"
stamp=$(sha256sum "$here/build-toxiproxy.sh" | cut -c1-16)
if [[ -x "$out/toxiproxy-server" && -f "$out/.stamp" && "$(cat "$out/.stamp")" == "$stamp" ]]; then
  echo "toxiproxy $TOXIPROXY_VERSION up to date in $out"
  exit 0
fi
echo ">> go install toxiproxy-server $TOXIPROXY_VERSION"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
GOBIN="$tmp" CGO_ENABLED=0 GOFLAGS=-buildvcs=false \
  go install -trimpath -ldflags="-s -w" "github.com/Shopify/toxiproxy/v2/cmd/server@$TOXIPROXY_VERSION"
mv "$tmp/server" "$out/toxiproxy-server"
echo "$stamp" > "$out/.stamp"
echo "toxiproxy built in $out"
