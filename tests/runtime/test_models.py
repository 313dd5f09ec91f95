"""Model loading: built-ins are deterministic and shaped as documented; other sources load."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from batchpilot_runtime.admin import profile_warmup
from batchpilot_runtime.capture import LiveProfile
from batchpilot_runtime.config import ModelConfig
from batchpilot_runtime.models import LoadedModel, build_builtin
from batchpilot_runtime.tensors import profile_beyond_sizes, warmup_sizes

sys.path.insert(0, str(Path(__file__).parent))


def load(source: str) -> LoadedModel:
    return LoadedModel(ModelConfig(name="m", source=source, device="cpu"))


def test_reference_mlp_has_21m_parameters_and_is_deterministic() -> None:
    a, b = build_builtin("mlp"), build_builtin("mlp")
    assert sum(p.numel() for p in a.parameters()) == 20_980_224
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def test_tiny_mlp_and_transformer_shapes() -> None:
    tiny = load("builtin:tiny-mlp")
    tiny.warmup([1, 3])
    assert tiny.input.as_json() == {"name": "input", "datatype": "FP32", "shape": [-1, 512]}
    assert tiny.output.shape == (-1, 512)
    tr = load("builtin:transformer")
    tr.warmup([2])
    assert tr.input.as_json() == {"name": "input", "datatype": "INT64", "shape": [-1, 64]}
    assert tr.output.shape == (-1, 256)
    ids = np.arange(128, dtype=np.int64).reshape(2, 64)
    one = tr.run(ids[:1])
    both = tr.run(ids)
    np.testing.assert_allclose(both[:1], one, rtol=1e-4, atol=1e-5)  # rows are independent


def test_torchscript_and_python_factory_sources(tmp_path: Path) -> None:
    scripted = torch.jit.script(build_builtin("tiny-mlp"))
    path = tmp_path / "m.pt"
    scripted.save(str(path))
    ts = load(f"torchscript:{path}")
    x = np.ones((2, 512), dtype=np.float32)
    np.testing.assert_allclose(ts.run(x), load("builtin:tiny-mlp").run(x), rtol=1e-5)
    assert load("python:bp_rt_models:testmodel").run(x).shape == (2, 8)
    with pytest.raises(TypeError, match=r"expected torch\.nn\.Module"):
        load("python:bp_rt_models:not_a_module")


def test_bfloat16_dtype_runs_and_returns_float32() -> None:
    m = LoadedModel(ModelConfig(name="m", source="builtin:tiny-mlp", device="cpu", dtype="bfloat16"))
    out = m.run(np.ones((3, 512), dtype=np.float32))
    assert out.dtype == np.float32 and out.shape == (3, 512)


def test_warmup_sizes_cover_small_sizes_powers_of_two_and_lane_maxima() -> None:
    assert warmup_sizes([4]) == [1, 2, 3, 4]
    assert warmup_sizes([100, 8]) == [*range(1, 17), 32, 64, 100]


def test_the_live_profile_times_batches_past_the_lanes_maxima_within_caps() -> None:
    assert profile_beyond_sizes([8]) == [16, 32, 64]
    assert profile_beyond_sizes([16]) == [32, 64, 128]
    assert profile_beyond_sizes([100, 8]) == [128, 256]  # 8 x 100, capped at 256 rows
    assert profile_beyond_sizes([256]) == []
    assert profile_beyond_sizes([8], row_bytes=1 << 20) == [16]  # 16 MiB of input and output


def test_a_failed_pass_past_the_maxima_ends_the_extra_profile_not_the_start() -> None:
    class Model:
        def example(self, rows: int) -> np.ndarray:
            return np.zeros((rows, 4), dtype=np.float32)

        def run(self, x: np.ndarray) -> np.ndarray:
            if x.shape[0] > 16:
                raise MemoryError("CUDA out of memory")
            return x

    prof = LiveProfile()
    profile_warmup(Model(), [1, 8], 3, prof, beyond=[16, 32, 64])
    warm, _ = prof.samples()
    assert sorted(warm) == [1, 8, 16] and len(warm[16]) == 3
