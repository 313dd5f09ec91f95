#!/usr/bin/env bash
# Regenerates the Python lock files hack/setup.sh installs from; run it after changing the
# dependencies in pyproject.toml, and commit the result:
#   hack/requirements.lock        every dependency of batchpilot[operator,runtime,demo,dev,gateway] but torch
#   hack/requirements-torch.lock  torch and what it needs (PyPI's build, with its CUDA libraries)
# Both come from one resolution (so a package both need has one version), universal (markers
# for other platforms and Python >= 3.11) and with hashes (pip/uv install them in hash-checking
# mode). torch is apart so that set-up can install a local CPU-only wheel instead.
# Needs uv (https://pypi.org/project/uv/): `UV=/path/to/uv bash hack/lock.sh`; set-up installs
# one into .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
UV=${UV:-$( [[ -x .venv/bin/uv ]] && echo .venv/bin/uv || echo uv )}
extras=(--extra operator --extra runtime --extra demo --extra dev --extra gateway)
common=(--universal --python-version 3.11 --quiet --no-annotate --custom-compile-command "bash hack/lock.sh")
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT

# One resolution of everything, the versions both files are held to.
"$UV" pip compile pyproject.toml "${extras[@]}" "${common[@]}" -o "$tmp/all.txt"
# torch and its closure.
echo torch | "$UV" pip compile - -c "$tmp/all.txt" "${common[@]}" --generate-hashes -o hack/requirements-torch.lock
# Everything else: torch overridden away (a marker no Python matches).
echo 'torch ; python_version < "0"' > "$tmp/no-torch.txt"
"$UV" pip compile pyproject.toml "${extras[@]}" --override "$tmp/no-torch.txt" -c "$tmp/all.txt" \
  "${common[@]}" --generate-hashes -o hack/requirements.lock
echo "wrote hack/requirements.lock ($(grep -c '^[a-z]' hack/requirements.lock) packages) and" \
  "hack/requirements-torch.lock ($(grep -c '^[a-z]' hack/requirements-torch.lock) packages)"
