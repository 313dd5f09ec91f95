# The two commands of the README. Both do their own set-up (hack/setup.sh), idempotently.
.PHONY: demo test setup
demo: setup
	.venv/bin/batchpilot demo
test:
	bash hack/test.sh
setup:
	bash hack/setup.sh
