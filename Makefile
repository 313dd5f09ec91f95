# The commands of the README. They do their own set-up (hack/setup.sh), idempotently.
.PHONY: demo test setup up down images drills
demo: setup
	.venv/bin/batchpilot demo
test:
	bash hack/test.sh
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
