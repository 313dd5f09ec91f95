//go:build tools

// Package tools pins Prometheus (v2.53.4, module version v0.53.4) built by build.sh; it is never compiled.
package tools

import (
	_ "github.com/prometheus/prometheus/cmd/prometheus"
)
