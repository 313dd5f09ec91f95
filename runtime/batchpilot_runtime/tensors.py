"""Tensor specs of the model's input and output, without torch (the server process never imports it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

DATATYPES: dict[str, Any] = {"FP32": np.float32, "INT64": np.int64, "FP16": np.float16, "INT32": np.int32}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    datatype: str
    shape: tuple[int, ...]  # with -1 as the batch dimension

    @property
    def row_shape(self) -> tuple[int, ...]:
        return self.shape[1:]

    @property
    def numpy_dtype(self) -> Any:
        return DATATYPES[self.datatype]

    def as_json(self) -> dict[str, Any]:
        return {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}


def warmup_sizes(max_batch_sizes: list[int]) -> list[int]:
    """Batch sizes to warm: every size up to 16, then powers of two, and each lane's maximum."""
    top = max(max_batch_sizes)
    sizes = set(range(1, min(top, 16) + 1))
    p = 32
    while p < top:
        sizes.add(p)
        p *= 2
    sizes.update(max_batch_sizes)
    return sorted(sizes)


class ServedModel(Protocol):
    """What the server needs of a model: ``models.LoadedModel`` (in this process) or
    ``modelproc.ModelProcess`` (in its own)."""

    input: TensorSpec
    output: TensorSpec
    warmed: list[int]

    @property
    def device_name(self) -> str: ...

    @property
    def threads(self) -> int | None: ...

    @property
    def alive(self) -> bool: ...

    def run(self, x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]: ...

    def example(self, rows: int) -> np.ndarray[Any, Any]: ...

    def close(self) -> None: ...
