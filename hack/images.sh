#!/usr/bin/env bash
# `make images`: the operator and runtime images, built without Docker and without pulling
# from a public registry. The base is Debian trixie made from Debian packages (mmdebstrap,
# minbase variant: what debian:trixie-slim holds), imported as localhost/batchpilot/debian:trixie;
# then buildah builds operator/Dockerfile and runtime/Dockerfile on it (vfs storage driver, chroot
# isolation, host network for apt and PyPI). The Dockerfiles take the base as ARG BASE, whose
# default is the public debian:trixie-slim, so `docker build` elsewhere builds the same thing.
# Installs what it needs when missing: apt-get install buildah podman mmdebstrap runc.
set -euo pipefail
cd "$(dirname "$0")/.."
say() { printf '\033[1m>> %s\033[0m\n' "$*"; }
export CONTAINERS_CONF=${CONTAINERS_CONF:-$PWD/hack/images/containers.conf}
BUILDAH=(buildah --storage-driver vfs)
PODMAN=(podman --storage-driver vfs --runtime runc)
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
BASE=localhost/batchpilot/debian:trixie
OPERATOR=localhost/batchpilot/operator:$VERSION
RUNTIME=localhost/batchpilot/runtime:$VERSION
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
cache=.cache/images
mkdir -p "$cache"

need=()
for tool in buildah podman mmdebstrap runc; do command -v "$tool" >/dev/null || need+=("$tool"); done
if ((${#need[@]})); then
  say "apt-get install ${need[*]}"
  sudo_=""; [[ $(id -u) == 0 ]] || sudo_=sudo
  $sudo_ apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_ apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

# --- the base: Debian trixie minbase from Debian packages --------------------------------
if ! "${BUILDAH[@]}" inspect --type image "$BASE" >/dev/null 2>&1; then
  say "base: mmdebstrap --variant=minbase trixie (Debian packages from $MIRROR)"
  mmdebstrap --quiet --variant=minbase \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/info/*' \
    trixie "$cache/trixie-minbase.tar" "$MIRROR"
  ctr=$("${BUILDAH[@]}" from scratch)
  "${BUILDAH[@]}" add "$ctr" "$cache/trixie-minbase.tar" /
  "${BUILDAH[@]}" config --cmd /bin/bash --label "org.opencontainers.image.description=Debian trixie minbase, made by mmdebstrap" "$ctr"
  "${BUILDAH[@]}" commit --quiet --rm "$ctr" "$BASE" >/dev/null
  rm -f "$cache/trixie-minbase.tar"
fi

# --- the images ----------------------------------------------------------------------------
# The host's CA bundle, mounted into the build steps only (pip behind a TLS-intercepting proxy
# trusts what the host trusts); nothing of it is committed to an image.
ca_args=()
ca=${BUILD_CA_BUNDLE:-${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}}
if [[ -r "$ca" ]]; then
  ca_args=(--volume "$ca:/run/build-ca.crt:ro" --build-arg PIP_CERT=/run/build-ca.crt)
fi
# Each image is labelled with the hash of its sources (hack/images/source-hash.sh) and its build
# arguments, and rebuilt only when they changed (FORCE=1 rebuilds anyway).
build() {  # IMAGE DOCKERFILE [BUILD-ARG...]
  local image=$1 file=$2; shift 2
  local source
  source="$(bash hack/images/source-hash.sh "$(basename "$(dirname "$file")")")${*:+ $*}"
  local label="dev.batchpilot.source=$source"
  if [[ -z "${FORCE:-}" && "$("${BUILDAH[@]}" inspect --type image --format '{{index .OCIv1.Config.Labels "dev.batchpilot.source"}}' "$image" 2>/dev/null)" == "$source" ]]; then
    say "$image is up to date (sources $source)"
    return
  fi
  say "buildah bud -f $file -t $image $*"
  "${BUILDAH[@]}" bud --quiet --isolation chroot --network host --layers=false --label "$label" \
    "${ca_args[@]}" --build-arg "BASE=$BASE" "${@/#/--build-arg=}" -f "$file" -t "$image" . >/dev/null
}
build "$OPERATOR" operator/Dockerfile
build "$RUNTIME" runtime/Dockerfile "TORCH=${TORCH:-debian}"
"${PODMAN[@]}" images --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep '^localhost/batchpilot/'
torch=$("${PODMAN[@]}" run --rm --network host --entrypoint cat "$RUNTIME" /etc/batchpilot-torch-version)
say "$RUNTIME carries torch $torch (TORCH=${TORCH:-debian})"
