"""The model in its own process, so that its latency belongs to the model and not to the HTTP loop.

In one interpreter the forward pass and the aiohttp loop share the GIL: a CPU model that
releases it between torch ops waits for the loop at every op, and under load a 10 ms pass
took 45 ms (issue 21). Here the server process keeps the HTTP loop, the scheduler and the
batch worker thread; a child process (``spawn``: a fresh interpreter, no forked threads)
loads, warms and runs the model and nothing else.

One batch, one round trip:

* the worker copies the batch's rows into a shared-memory input buffer (rows x row shape,
  allocated by the server, grown when a batch needs more rows) and sends ``("run", rows,
  names)`` over a pipe (``names`` only when the buffers changed);
* the child runs the rows in place (a numpy view on the buffer, no copy), writes the output
  into the shared-memory output buffer and answers ``("ok", shape)``; an output that does not
  fit the buffer (a model whose output shape varies) comes back through the pipe instead, and
  a model exception as ``("error", type, message)``: that batch fails, the next one runs;
* the worker copies the output rows out (the buffer is reused by the next batch while the
  loop still serializes this one's answers).

The worker thread waits on the pipe without the GIL, so the loop runs while the model
computes, and the child's interpreter is its own. The pipe and the copies cost tens of
microseconds per batch (``bench/model_isolation.py`` measures both modes).

The child ignores SIGTERM and SIGINT: the server drains on them, and the child must keep
serving until the server stops it (end of pipe). If the server dies, the pipe closes and the
child exits. If the child dies, every later batch fails with :class:`ModelProcessGone` and
``alive`` turns false: the server reports itself not live, so the kubelet restarts the pod.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import signal
import threading
from multiprocessing import shared_memory
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from batchpilot_runtime.config import ModelConfig
from batchpilot_runtime.tensors import TensorSpec

log = logging.getLogger("batchpilot.runtime.model")

START_TIMEOUT_S = 900.0
"""How long loading and warming the model in the child may take (a large model on a cold disk)."""


class ModelProcessGone(RuntimeError):
    """The model process exited: no batch can run until the server restarts."""


class RemoteModelError(RuntimeError):
    """The model raised on a batch (in the model process); ``kind`` is the exception's type name."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def _view(shm: shared_memory.SharedMemory, rows: int, row_shape: tuple[int, ...], dtype: Any) -> np.ndarray[Any, Any]:
    return np.ndarray((rows, *row_shape), dtype=dtype, buffer=shm.buf)


def _nbytes(rows: int, row_shape: tuple[int, ...], dtype: Any) -> int:
    return max(1, rows * int(np.prod(row_shape, dtype=np.int64)) * int(np.dtype(dtype).itemsize))


class ModelProcess:
    """The server's handle on the model process; the surface of ``models.LoadedModel`` it uses.

    ``input``, ``output``, ``device_name``, ``threads`` and ``warmed`` are what the child
    reported once the model was loaded and warmed at ``warm_sizes``; :meth:`run` maps a numpy
    batch to numpy like ``LoadedModel.run``. One caller at a time (a lock guards the pipe).
    """

    def __init__(self, cfg: ModelConfig, warm_sizes: list[int], start_timeout: float = START_TIMEOUT_S) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child_conn = ctx.Pipe(duplex=True)
        self._proc = ctx.Process(
            target=_child_main,
            args=(cfg.model_dump(), list(warm_sizes), child_conn),
            name="batchpilot-model",
            daemon=True,
        )
        self._proc.start()
        child_conn.close()
        self._lock = threading.Lock()
        self._in: shared_memory.SharedMemory | None = None
        self._out: shared_memory.SharedMemory | None = None
        self._capacity = 0
        self._retired: tuple[shared_memory.SharedMemory | None, shared_memory.SharedMemory | None] | None = None
        self._gone: str | None = None
        if not self._conn.poll(start_timeout):
            self.close()
            raise ModelProcessGone(f"the model process did not load the model within {start_timeout:g}s")
        reply = self._recv()
        if reply[0] != "ready":
            self.close()
            raise RuntimeError(f"model load failed in the model process: {reply[1]}")
        info: dict[str, Any] = reply[1]
        self.input = TensorSpec("input", info["input_datatype"], (-1, *info["input_row_shape"]))
        self.output = TensorSpec("output", "FP32", (-1, *info["output_row_shape"]))
        self.device_name: str = info["device"]
        self.threads: int | None = info["threads"]
        self.warmed: list[int] = list(info["warmed"])
        self.pid = self._proc.pid
        self._grow(max(warm_sizes, default=1))

    # -- the server's side -------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self._gone is None and self._proc.is_alive()

    def example(self, rows: int) -> np.ndarray[Any, Any]:
        shape = (rows, *self.input.row_shape)
        dtype = self.input.numpy_dtype
        return np.zeros(shape, dtype=dtype) if self.input.datatype.startswith("FP") else np.ones(shape, dtype=dtype)

    def run(self, x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
        with self._lock:
            if self._gone is not None:
                raise ModelProcessGone(self._gone)
            rows = int(x.shape[0])
            names = self._grow(rows) if rows > self._capacity else None
            assert self._in is not None and self._out is not None
            _view(self._in, rows, self.input.row_shape, self.input.numpy_dtype)[...] = x
            try:
                self._conn.send(("run", rows, names))
            except (OSError, ValueError) as exc:
                raise self._lost(f"sending a batch: {exc}") from exc
            reply = self._recv()
            if reply[0] == "ok":
                shape: tuple[int, ...] = reply[1]
                return _view(self._out, shape[0], shape[1:], np.float32).copy()
            if reply[0] == "bytes":
                _, shape, dtype, payload = reply
                return np.frombuffer(payload, dtype=np.dtype(dtype)).reshape(shape).copy()
            raise RemoteModelError(reply[1], reply[2])

    def close(self, timeout: float = 5.0) -> None:
        """Stop the child (end of pipe), wait for it, free the buffers.

        A batch still running (a hung model) holds the lock: after ``timeout`` the child is
        killed instead of asked."""
        asked = self._lock.acquire(timeout=timeout)
        try:
            if self._gone is None:
                self._gone = "the model process was stopped"
            if asked:
                with contextlib.suppress(OSError, ValueError):
                    self._conn.send(("stop",))
                self._conn.close()
        finally:
            if asked:
                self._lock.release()
        self._proc.join(timeout if asked else 0)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout)
        for shm in (self._in, self._out, *(self._retired or ())):
            if shm is not None:
                shm.close()
                shm.unlink()
        self._in = self._out = self._retired = None

    # -- internals ---------------------------------------------------------------------------
    def _grow(self, rows: int) -> tuple[str, str, int]:
        """New buffers for ``rows`` rows (the old ones are freed once the child has the new names)."""
        old = (self._in, self._out)
        capacity = max(rows, 2 * self._capacity)
        self._in = shared_memory.SharedMemory(
            create=True, size=_nbytes(capacity, self.input.row_shape, self.input.numpy_dtype)
        )
        self._out = shared_memory.SharedMemory(create=True, size=_nbytes(capacity, self.output.row_shape, np.float32))
        self._capacity = capacity
        names = (self._in.name, self._out.name, capacity)
        if old[0] is None:  # the first buffers: tell the child now, not with the first batch
            self._conn.send(("buffers", names))
            ack = self._recv()
            assert ack[0] == "buffers", ack
            return names
        self._retired = old
        return names

    def _recv(self) -> tuple[Any, ...]:
        try:
            reply: tuple[Any, ...] = self._conn.recv()
        except (EOFError, OSError) as exc:
            raise self._lost(f"waiting for the model: {type(exc).__name__}") from exc
        retired = self._retired
        if retired is not None:  # the child has answered since the new names were sent
            for shm in retired:
                if shm is not None:
                    shm.close()
                    shm.unlink()
            self._retired = None
        return reply

    def _lost(self, what: str) -> ModelProcessGone:
        self._proc.join(1.0)
        code = self._proc.exitcode
        self._gone = f"the model process exited (exit code {code}) {what}"
        log.error("%s: no batch can run until the server restarts", self._gone)
        return ModelProcessGone(self._gone)


# -- the child ---------------------------------------------------------------------------------
def _attach(name: str) -> shared_memory.SharedMemory:
    # Python 3.11 registers an attached segment with the resource tracker too; the child shares
    # the server's tracker (spawn passes it on), so that is the server's own registration again,
    # and the server's unlink clears it. (Unregistering here would make that unlink complain.)
    return shared_memory.SharedMemory(name=name)


def _child_main(cfg: dict[str, Any], warm_sizes: list[int], conn: Connection) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from batchpilot_runtime.models import LoadedModel

    try:
        model = LoadedModel(ModelConfig(**cfg))
        model.warmup(warm_sizes)
    except BaseException as exc:  # reported to the server, which fails its start with it
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(
        (
            "ready",
            {
                "input_datatype": model.input.datatype,
                "input_row_shape": model.input.row_shape,
                "output_row_shape": model.output.row_shape,
                "device": model.device_name,
                "threads": model.threads,
                "warmed": model.warmed,
            },
        )
    )
    in_shm: shared_memory.SharedMemory | None = None
    out_shm: shared_memory.SharedMemory | None = None
    row_shape, dtype = model.input.row_shape, model.input.numpy_dtype
    out_row_shape = model.output.row_shape
    capacity = 0
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return  # the server is gone
        if msg[0] == "stop":
            return
        names = msg[1] if msg[0] == "buffers" else msg[2]
        if names is not None:
            for shm in (in_shm, out_shm):
                if shm is not None:
                    shm.close()
            in_shm, out_shm, capacity = _attach(names[0]), _attach(names[1]), names[2]
        if msg[0] == "buffers":
            conn.send(("buffers",))
            continue
        assert in_shm is not None and out_shm is not None
        rows: int = msg[1]
        try:
            y = model.run(np.ndarray((rows, *row_shape), dtype=dtype, buffer=in_shm.buf))
        except Exception as exc:  # this batch fails; the model keeps serving
            conn.send(("error", type(exc).__name__, str(exc)))
            continue
        if y.shape[1:] == out_row_shape and y.shape[0] <= capacity and y.dtype == np.float32:
            np.ndarray(y.shape, dtype=np.float32, buffer=out_shm.buf)[...] = y
            conn.send(("ok", tuple(y.shape)))
        else:
            conn.send(("bytes", tuple(y.shape), y.dtype.str, y.tobytes()))
