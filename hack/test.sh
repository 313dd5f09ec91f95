#!/usr/bin/env bash
# The whole test suite: set-up, static checks (ruff, mypy --strict, import-linter), then
# pytest against the real local control plane, real Prometheus and real torch.
set -euo pipefail
cd "$(dirname "$0")/.."
bash hack/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
echo ">> ruff"; ruff check . && ruff format --check .
echo ">> mypy --strict"; mypy
echo ">> import-linter"; lint-imports
echo ">> pytest"; exec pytest --durations=20 "$@"
