"""Models for the operator's end-to-end tests, loaded by runtime processes as ``python:bp_op_models:<factory>``.

``linear``: 512 -> 8, and each forward pass *sleeps* 5 ms per row. Its service time is
exact (a sleep, not CPU work, so it holds on a loaded 2-core machine and costs no CPU) and
grows linearly with the batch, so batching gains nothing: its capacity is set by rows/s
alone, and a doubling of traffic cannot be absorbed by retuning the window.
"""

from __future__ import annotations

import time

import torch
from torch import nn

SECONDS_PER_ROW = 0.005


class Linear(nn.Module):
    batchpilot_input_shape = (512,)

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(512, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(SECONDS_PER_ROW * x.shape[0])
        out: torch.Tensor = self.proj(x)
        return out


def linear() -> nn.Module:
    return Linear()
