"""Local development: a real control plane, Prometheus and runtime processes on one machine."""
