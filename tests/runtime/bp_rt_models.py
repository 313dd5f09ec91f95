"""Test models for the runtime tests, loaded by the server as ``python:bp_rt_models:<factory>``.

``testmodel``: a small deterministic linear map 512 -> 8 that
* appends one line per batch to ``$BP_TEST_LOG`` (the first element of each row, as ints),
  before running, so tests see what was dispatched together and in which order;
* blocks while the file ``$BP_TEST_GATE`` exists (bounded: 60 s), so tests can hold the
  model busy and build queues deterministically;
* raises on a row whose first element is -12345 (the whole batch fails, nothing else);
* writes the niceness of the thread it runs on to ``$BP_TEST_NICE`` (the model process's).
"""

from __future__ import annotations

import os
import threading
import time

import torch
from torch import nn

MAGIC = -12345.0


class TestModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(512, 8)
        self.log_path = os.environ.get("BP_TEST_LOG")
        self.gate_path = os.environ.get("BP_TEST_GATE")
        self.nice_path = os.environ.get("BP_TEST_NICE")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        markers = [int(v) for v in x[:, 0].tolist()]
        if self.nice_path:
            with open(self.nice_path, "w") as f:
                f.write(str(os.getpriority(os.PRIO_PROCESS, threading.get_native_id())))
        if self.log_path:
            with open(self.log_path, "a") as f:
                f.write(",".join(map(str, markers)) + "\n")
        if self.gate_path:
            deadline = time.monotonic() + 60
            while os.path.exists(self.gate_path) and time.monotonic() < deadline:
                time.sleep(0.002)
        if (x[:, 0] == MAGIC).any():
            raise ValueError("magic value -12345 in input row")
        out: torch.Tensor = self.linear(x)
        return out


def testmodel() -> nn.Module:
    return TestModel()


def not_a_module() -> object:
    return object()
