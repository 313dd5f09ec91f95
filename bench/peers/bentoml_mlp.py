"""BentoML peer: the reference MLP behind BentoML's adaptive batching (its CORK dispatcher, which
adapts the window to the latency it measures), as a BentoML 1.4 user writes it.

Started by bench/peer_servers.py as ``bentoml serve bentoml_mlp:MLP`` inside its own venv; the
knobs its documentation tells users to tune come from the environment: ``BENCH_MAX_BATCH``
(``max_batch_size``) and ``BENCH_MAX_LATENCY_MS`` (``max_latency_ms``). The request is BentoML's
own JSON for an ndarray argument, ``{"x": [[512 floats]]}`` (one row), the same payload as the
Open Inference Protocol body the other servers get. The model is batchpilot's ``builtin:mlp``
(same seed, same weights).
"""

from __future__ import annotations

import os

import bentoml
import numpy as np
import torch

from batchpilot_runtime.models import build_builtin

MAX_BATCH = int(os.environ.get("BENCH_MAX_BATCH", "32"))
MAX_LATENCY_MS = int(os.environ.get("BENCH_MAX_LATENCY_MS", "50"))
THREADS = int(os.environ.get("BENCH_THREADS", "1"))


@bentoml.service(workers=1, traffic={"timeout": 10})
class MLP:
    def __init__(self) -> None:
        torch.set_num_threads(THREADS)
        self.model = build_builtin("mlp").eval()

    @bentoml.api(batchable=True, batch_dim=0, max_batch_size=MAX_BATCH, max_latency_ms=MAX_LATENCY_MS)
    def infer(self, x: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            return self.model(torch.from_numpy(x.astype(np.float32, copy=False))).numpy()
