#!/usr/bin/env bash
# `make drills`: every drill (the long ones too) against the real local stack, and the report.
# The report goes to bench/results/drills/ (drills.md, drills.json) unless
# BATCHPILOT_DRILL_REPORT names another folder.
set -euo pipefail
cd "$(dirname "$0")/.."
bash hack/setup.sh
export PATH="$PWD/.venv/bin:$PATH"
export BATCHPILOT_DRILLS=all
export BATCHPILOT_DRILL_REPORT="${BATCHPILOT_DRILL_REPORT:-$PWD/bench/results/drills}"
pytest tests/drills "$@"
echo ">> drill report: $BATCHPILOT_DRILL_REPORT/drills.md"
