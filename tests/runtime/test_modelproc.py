"""The model in its own process (``modelproc``): same answers as in-process, failures contained.

Real torch in a real spawned process, talking through real shared memory and a pipe.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from bp_rt_harness import Server, body, fetch, lane, wait_for

from batchpilot_runtime.config import ModelConfig
from batchpilot_runtime.modelproc import ModelProcess, ModelProcessGone, RemoteModelError
from batchpilot_runtime.models import LoadedModel

pytestmark = pytest.mark.runtime_server

TEST_MODEL = ModelConfig(name="m", source="python:bp_rt_models:testmodel", device="cpu", threads=1)


@pytest.fixture(scope="module")
def proc() -> Iterator[ModelProcess]:
    m = ModelProcess(TEST_MODEL, [1, 2, 4])
    try:
        yield m
    finally:
        m.close()


def rows(n: int, seed: int) -> np.ndarray:
    x = np.random.default_rng(seed).random((n, 512), dtype=np.float32)
    x[:, 0] = np.arange(n)  # the test model logs column 0; never its magic value
    return x


def test_same_answers_as_the_model_in_this_process(proc: ModelProcess) -> None:
    local = LoadedModel(TEST_MODEL)
    local.warmup([1])
    assert (proc.input, proc.device_name, proc.threads, proc.warmed) == (local.input, "cpu", 1, [1, 2, 4])
    assert proc.output == local.output
    for n in (1, 3, 4, 17, 2):  # 17 > the warmed sizes: the buffers grow, then are reused
        x = rows(n, n)
        np.testing.assert_array_equal(proc.run(x), local.run(x))


def test_an_answer_survives_the_next_batch(proc: ModelProcess) -> None:
    """The output buffer is reused: ``run`` hands out a copy, not a view on it."""
    first = proc.run(rows(3, 1))
    kept = first.copy()
    proc.run(rows(3, 2))
    np.testing.assert_array_equal(first, kept)


def test_a_model_error_fails_its_batch_only(proc: ModelProcess) -> None:
    x = rows(3, 3)
    x[1, 0] = -12345  # the test model raises on this row
    with pytest.raises(RemoteModelError, match="magic value -12345") as caught:
        proc.run(x)
    assert caught.value.kind == "ValueError"
    assert proc.alive
    assert proc.run(rows(2, 4)).shape == (2, 8)


def test_a_load_failure_is_reported_with_the_models_own_message() -> None:
    bad = ModelConfig(name="m", source="python:bp_rt_models:not_a_module", device="cpu")
    with pytest.raises(RuntimeError, match=r"factory returned object, expected torch\.nn\.Module"):
        ModelProcess(bad, [1])


def test_a_dead_model_process_fails_batches_clearly_and_frees_its_memory() -> None:
    m = ModelProcess(TEST_MODEL, [1, 2])
    names = [shm.name for shm in (m._in, m._out) if shm is not None]
    assert all(Path("/dev/shm", n.lstrip("/")).exists() for n in names)
    os.kill(m.pid, signal.SIGKILL)
    wait_for(lambda: not m.alive, 10, "the model process seen dead")
    with pytest.raises(ModelProcessGone, match="exit code -9"):
        m.run(rows(1, 0))
    with pytest.raises(ModelProcessGone):
        m.run(rows(1, 0))
    m.close()
    assert not any(Path("/dev/shm", n.lstrip("/")).exists() for n in names)


def test_close_kills_a_model_stuck_in_a_batch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A hung forward pass cannot hold the server's stop: after the timeout the child is killed,
    and the stuck batch fails instead of waiting for ever."""
    import threading

    gate = tmp_path / "gate"
    monkeypatch.setenv("BP_TEST_GATE", str(gate))  # the test model blocks while this file exists
    m = ModelProcess(TEST_MODEL, [1])
    gate.write_text("closed")
    failure: list[BaseException] = []

    def stuck() -> None:
        try:
            m.run(rows(1, 0))
        except BaseException as exc:
            failure.append(exc)

    t = threading.Thread(target=stuck)
    t.start()
    wait_for(lambda: m._lock.locked(), 10, "the batch under way")
    m.close(timeout=0.5)
    t.join(10)
    assert not t.is_alive() and not m.alive
    assert len(failure) == 1 and isinstance(failure[0], ModelProcessGone), failure


def _model_process(pid: int) -> int:
    """The server's model process (its other child is multiprocessing's resource tracker)."""
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                found.append(int(child))
    (model,) = found
    return model


def test_server_runs_the_model_apart_and_is_not_live_without_it(tmp_path: Path) -> None:
    import json
    import urllib.request

    srv = Server(tmp_path, [lane("a", 4, "1ms", 20, "20s")])
    try:
        child = _model_process(srv.proc.pid)
        req = urllib.request.Request(
            srv.url + "/v2/models/m/infer",
            data=json.dumps(body([1, 2])).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.status == 200
        assert srv.get("/v2/health/live")[0] == 200
        os.kill(child, signal.SIGKILL)
        # The next batch finds the process gone: a 500 naming it, and liveness turns false.
        status, raw = fetch(req)
        assert status == 500, "a batch ran without a model process"
        assert "model process exited" in json.loads(raw)["error"]
        status, text = srv.get("/v2/health/live")
        assert status == 500 and b"model process exited" in text
    finally:
        srv.stop()
    assert srv.proc.returncode == 0  # still drains and stops cleanly


def test_the_model_process_ends_with_the_server(tmp_path: Path) -> None:
    srv = Server(tmp_path, [lane("a", 4, "1ms", 20, "20s")])
    try:
        child = _model_process(srv.proc.pid)
        srv.proc.kill()  # no drain, no close: the pipe's end is what the child sees
        srv.proc.wait(10)
    finally:
        srv.stop()

    def gone() -> bool:
        try:
            return Path(f"/proc/{child}/stat").read_text().split()[2] == "Z"
        except FileNotFoundError:
            return True

    wait_for(gone, 20, "the orphaned model process to exit")
