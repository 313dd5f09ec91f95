# The commands of the README. They do their own set-up (hack/setup.sh), idempotently, but for
# `make check`: ruff, mypy, import-linter and the unit tests (pytest -m unit: no cluster, Prometheus,
# runtime server or image; tests/conftest.py marks them), in under 2 minutes with only .venv.
.PHONY: demo test check setup up down images drills
demo: setup
	.venv/bin/batchpilot demo
test:
	bash hack/test.sh
check: export PATH := $(CURDIR)/.venv/bin:$(PATH)
check:
	ruff check . && ruff format --check .
	mypy
	lint-imports
	pytest -m unit -q --durations=5
up: setup
	.venv/bin/batchpilot up
down:
	.venv/bin/batchpilot down
images:
	bash hack/images.sh
drills:
	bash hack/drills.sh
setup:
	bash hack/setup.sh
