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
echo ">> pytest"
if [ "$#" -gt 0 ] || [ -n "${BATCHPILOT_TEST_SERIAL:-}" ]; then
  exec pytest --durations=20 "$@"
fi
# The whole suite as two pytest processes at once, each with its own local control plane: the
# operator's tests, and the rest (runtime, real node, images, drills); then the tests marked
# `alone` by themselves: they compare measured latency with the model, or need a load sender and
# its clients on time, and beside the other half of the suite on 2 cores they missed (pods 3-4x
# slower than the model, a client giving up on a request through Envoy). Every test runs exactly
# once; BATCHPILOT_TEST_SERIAL=1 (or any pytest argument) runs them in one process instead.
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
group() {
  local name=$1
  shift
  pytest --basetemp="${TMPDIR:-/tmp}/batchpilot-pytest-$name" --durations=12 "$@" 2>&1 \
    | sed -u "s/^/[$name] /" | tee "$logs/$name.log"
  return "${PIPESTATUS[0]}"
}
group operator -m "not alone" tests/operator &
operator=$!
group rest -m "not alone" tests --ignore=tests/operator &
rest=$!
rc=0
wait "$operator" || rc=$?
wait "$rest" || rc=$?
group alone -m alone tests || rc=$?
# The groups interleave their output and CI shows only its tail: what failed, repeated last.
grep -hE '^\[[a-z]+\] (FAILED|ERROR) ' "$logs"/*.log || true
[ "$rc" -eq 0 ] && echo ">> pytest: every group passed" || echo ">> pytest: a group failed (exit $rc)"
exit "$rc"
