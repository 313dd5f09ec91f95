// The local node's sandbox (pause) image binary: see main.go; no dependencies.
module batchpilot.dev/hack/node/pause

go 1.24.0
