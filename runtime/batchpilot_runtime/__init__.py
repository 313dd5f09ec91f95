"""batchpilot runtime: a dynamic-batching PyTorch inference server (Open Inference Protocol v2)."""

__version__ = "0.1.0"
