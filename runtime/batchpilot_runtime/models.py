"""Model loading: built-in reference models, TorchScript files and ``module:factory`` imports.

Tensor contract (Open Inference Protocol names): one input named ``input`` and one output named
``output``; the first dimension is the batch (rows).

* ``builtin:mlp``: 512 -> 4096 -> 4096 -> 512 with ReLU (about 21M parameters). Input FP32 [-1, 512].
* ``builtin:tiny-mlp``: 512 -> 64 -> 512 with ReLU, for tests. Input FP32 [-1, 512].
* ``builtin:transformer``: a small transformer encoder (BERT-like) over token ids. Input INT64
  [-1, 64] (token ids in [0, 8192), sequence length 64); output FP32 [-1, 256] (mean-pooled
  final hidden state). d_model 256, 4 layers, 4 heads, feed-forward 1024, about 4.3M parameters.
  Token ids keep the JSON request small (64 integers per row), as a real encoder's would be.
* ``torchscript:<path>``: ``torch.jit.load``; FP32 [-1, 512] unless the module carries the
  attributes below.
* ``python:<module>:<factory>``: ``factory()`` returns a ``torch.nn.Module``.

A loaded module may declare its input with attributes ``batchpilot_input_shape`` (the shape of
one row, e.g. ``(512,)``) and ``batchpilot_input_datatype`` (``"FP32"`` or ``"INT64"``).
All built-in models use a fixed seed (0), so every replica computes the same function.
"""

from __future__ import annotations

import importlib
import itertools
from typing import Any

import numpy as np
import torch
from torch import nn

from batchpilot_runtime.config import ModelConfig
from batchpilot_runtime.tensors import DATATYPES, TensorSpec

SEED = 0
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}

TRANSFORMER_SEQ = 64
TRANSFORMER_VOCAB = 8192
TRANSFORMER_D = 256


def _mlp(widths: list[int]) -> nn.Module:
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(widths)):
        layers.append(nn.Linear(a, b))
        if i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


class TinyTransformer(nn.Module):
    """Token ids [B, S] -> embeddings + positions -> encoder -> mean pool [B, D]."""

    batchpilot_input_shape = (TRANSFORMER_SEQ,)
    batchpilot_input_datatype = "INT64"

    def __init__(
        self,
        vocab: int = TRANSFORMER_VOCAB,
        seq: int = TRANSFORMER_SEQ,
        d_model: int = TRANSFORMER_D,
        layers: int = 4,
        heads: int = 4,
        ff: int = 1024,
    ) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.randn(1, seq, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(
            d_model, heads, ff, dropout=0.0, batch_first=True, norm_first=True, activation="gelu"
        )
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d_model)
        self.vocab = vocab

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.clamp(0, self.vocab - 1)
        h = self.embed(ids) + self.pos[:, : ids.shape[1]]
        h = self.encoder(h)
        out: torch.Tensor = self.norm(h).mean(dim=1)
        return out


def build_builtin(name: str) -> nn.Module:
    torch.manual_seed(SEED)
    if name == "mlp":
        return _mlp([512, 4096, 4096, 512])
    if name == "tiny-mlp":
        return _mlp([512, 64, 512])
    if name == "transformer":
        return TinyTransformer()
    raise ValueError(f"unknown builtin model {name!r}; use mlp, tiny-mlp or transformer")


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("model.device is 'cuda' but no CUDA device is available")
    return torch.device(device)


def _load_module(source: str) -> nn.Module:
    kind, _, rest = source.partition(":")
    if kind == "builtin":
        return build_builtin(rest)
    if kind == "torchscript":
        module: nn.Module = torch.jit.load(rest, map_location="cpu")  # type: ignore[no-untyped-call]
        return module
    if kind == "python":
        mod_name, _, factory_name = rest.rpartition(":")
        mod = importlib.import_module(mod_name)
        factory = getattr(mod, factory_name)
        obj = factory()
        if not isinstance(obj, nn.Module):
            raise TypeError(f"{source}: factory returned {type(obj).__name__}, expected torch.nn.Module")
        return obj
    raise ValueError(f"unknown model source {source!r}")


class LoadedModel:
    """A module on its device with its tensor specs; :meth:`run` maps a numpy batch to numpy."""

    def __init__(self, cfg: ModelConfig) -> None:
        if cfg.threads is not None:
            torch.set_num_threads(cfg.threads)
        self.cfg = cfg
        self.device = resolve_device(cfg.device)
        self.dtype = TORCH_DTYPES[cfg.dtype]
        module = _load_module(cfg.source)
        row_shape = tuple(getattr(module, "batchpilot_input_shape", (512,)))
        datatype = str(getattr(module, "batchpilot_input_datatype", "FP32"))
        if datatype not in DATATYPES:
            raise ValueError(f"unsupported input datatype {datatype!r}; use one of {sorted(DATATYPES)}")
        self.input = TensorSpec("input", datatype, (-1, *row_shape))
        self._float_input = datatype.startswith("FP")
        self.module = module.to(self.device).to(self.dtype).eval()
        self.output = TensorSpec("output", "FP32", (-1,))  # refined by warmup
        self.warmed: list[int] = []

    @property
    def device_name(self) -> str:
        return str(self.device.type)

    @property
    def alive(self) -> bool:
        return True

    def close(self) -> None:
        """Nothing to stop: the model lives in this process."""

    @property
    def threads(self) -> int | None:
        """torch's intra-op threads on a CPU device; None on an accelerator."""
        return torch.get_num_threads() if self.device.type == "cpu" else None

    def run(self, x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        with torch.inference_mode():
            t = torch.from_numpy(x)
            t = t.to(self.device, self.dtype, non_blocking=True) if self._float_input else t.to(self.device)
            y = self.module(t)
            if not isinstance(y, torch.Tensor):
                raise TypeError(f"model returned {type(y).__name__}, expected a tensor")
            out: np.ndarray[Any, Any] = y.to("cpu", torch.float32).numpy()
            return out

    def example(self, rows: int) -> np.ndarray[Any, Any]:
        shape = (rows, *self.input.row_shape)
        if self._float_input:
            return np.zeros(shape, dtype=self.input.numpy_dtype)
        return np.ones(shape, dtype=self.input.numpy_dtype)

    def warmup(self, sizes: list[int]) -> None:
        """One forward pass at each batch size; records the output shape for metadata."""
        for rows in sizes:
            y = self.run(self.example(rows))
            self.warmed.append(rows)
        self.output = TensorSpec("output", "FP32", (-1, *y.shape[1:]))
