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


PROFILE_BEYOND: int = 8
"""The live profile also times batches up to this times the largest lane maximum (powers of two)...
``recommend`` considers batch sizes up to the pods' largest profiled one, so this is how far one
recommendation can raise ``maxBatchSize``: with 4, pods at 8 rows could not be told to take 64, the
code trace's best setting at the SLO less the margin (``bench/results/capacity_ramp-margin.json``)."""
PROFILE_BEYOND_CAP: int = 256
"""... and no larger than this many rows ..."""
PROFILE_BEYOND_BYTES: int = 16 << 20
"""... nor than this many bytes of input and output (a pod's /dev/shm is often 64 MiB)."""


def profile_beyond_sizes(max_batch_sizes: list[int], row_bytes: int = 0) -> list[int]:
    """Batch sizes past every lane's maximum that the live profile times at start (never served):
    the tuner then has measured points for the larger settings it may recommend, instead of
    extrapolating. Powers of two up to ``PROFILE_BEYOND`` x the largest maximum, capped in rows
    and, with ``row_bytes`` (one row's input and output), in bytes."""
    top = max(max_batch_sizes)
    limit = min(top * PROFILE_BEYOND, PROFILE_BEYOND_CAP)
    if row_bytes > 0:
        limit = min(limit, PROFILE_BEYOND_BYTES // row_bytes)
    out: list[int] = []
    p = 1
    while p <= limit:
        if p > top:
            out.append(p)
        p *= 2
    return out


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
