"""MLServer peer: the reference MLP as a custom runtime; MLServer's adaptive batching merges requests.

Started by bench/peer_servers.py as ``mlserver start DIR`` inside its own venv.
The model is batchpilot's ``builtin:mlp`` (same seed, same weights).
"""

from __future__ import annotations

import os

import torch
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse

from batchpilot_runtime.models import build_builtin


class MLPRuntime(MLModel):
    async def load(self) -> bool:
        torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "1")))
        self.model = build_builtin("mlp").eval()
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        x = NumpyCodec.decode_input(payload.inputs[0])
        with torch.inference_mode():
            y = self.model(torch.from_numpy(x.astype("float32", copy=False))).numpy()
        return InferenceResponse(model_name=self.name, outputs=[NumpyCodec.encode_output("output", y)])
