"""batchpilot operator: BatchingPolicy reconcile, SLO-gated canaries, CLI tools."""

__version__ = "0.1.0"
