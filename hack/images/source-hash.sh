#!/usr/bin/env bash
# source-hash.sh operator|runtime: the hash of the sources that decide what one image of
# `make images` runs (tracked files, as they are now). The runtime image carries the operator's
# package too (one distribution), but the runtime never imports it (import-linter), so operator
# changes leave the runtime's hash alone; README.md is copied only for the package metadata.
# hack/images.sh labels each image with its hash (dev.batchpilot.source) and skips an image whose
# label matches; the real node (batchpilot_localdev/realnode.py) rebuilds before it runs a stale image.
set -euo pipefail
cd "$(dirname "$0")/../.."
case "${1:?operator or runtime}" in
  operator) paths=(operator/Dockerfile hack/requirements.lock operator/batchpilot_operator runtime/batchpilot_runtime) ;;
  runtime) paths=(runtime/Dockerfile hack/requirements-torch.lock runtime/batchpilot_runtime) ;;
  *) echo "source-hash.sh: operator or runtime, not $1" >&2; exit 2 ;;
esac
git ls-files -z -- pyproject.toml hack/images.sh "${paths[@]}" | xargs -0 sha256sum | sha256sum | cut -c1-16
