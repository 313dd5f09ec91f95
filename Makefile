# The commands of the README. They do their own set-up (hack/setup.sh), idempotently.
.PHONY: demo test setup up down
demo: setup
	.venv/bin/batchpilot demo
test:
	bash hack/test.sh
up: setup
	.venv/bin/batchpilot up
down:
	.venv/bin/batchpilot down
setup:
	bash hack/setup.sh
