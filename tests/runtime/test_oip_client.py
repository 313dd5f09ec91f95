"""The runtime against a stock Open Inference Protocol client: PyPI ``tritonclient[http]``.

Every call the client's HTTP API offers is made against a real server process: the core
protocol (server and model metadata, health, readiness, infer with JSON and binary tensors,
versioned paths, compressed requests) must work, and the optional extensions the runtime does
not implement (statistics, repository, shared memory, trace, logging, classification) must be
refused with a 400 that names the extension, never with an undecodable answer.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import bp_rt_models
import numpy as np
import pytest
import torch
import tritonclient.http as httpclient
import tritonclient.http.aio as aioclient
from bp_rt_harness import Server, fetch, lane
from tritonclient.utils import InferenceServerException

from batchpilot_runtime import __version__

pytestmark = pytest.mark.runtime_server

REVISION = "rev-test"  # the harness's config revision: the model's only version


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with Server(tmp_path_factory.mktemp("oip"), [lane("interactive", 8, "1ms", 64, "20s")]) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[httpclient.InferenceServerClient]:
    c = httpclient.InferenceServerClient(url=server.url.removeprefix("http://"), network_timeout=30)
    try:
        yield c
    finally:
        c.close()


def reference(x: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """What the server's model computes, computed here by the same torch module."""
    with torch.no_grad():
        out: np.ndarray[Any, Any] = bp_rt_models.testmodel()(torch.from_numpy(x)).numpy()
    return out


def rows(n: int, seed: int) -> np.ndarray[Any, Any]:
    x = np.random.default_rng(seed).standard_normal((n, 512)).astype(np.float32)
    x[:, 0] = np.arange(n)  # the test model logs column 0; keep it a small integer, never the magic value
    return x


def test_server_metadata(client: httpclient.InferenceServerClient) -> None:
    meta = client.get_server_metadata()
    assert meta["name"] == "batchpilot-runtime"
    assert meta["version"] == __version__
    assert set(meta["extensions"]) == {"binary_tensor_data", "model_configuration"}


def test_health_and_readiness(client: httpclient.InferenceServerClient) -> None:
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready("m")
    assert client.is_model_ready("m", model_version=REVISION)
    assert not client.is_model_ready("m", model_version="0123456789")
    assert not client.is_model_ready("other")


def test_model_metadata_and_config(client: httpclient.InferenceServerClient) -> None:
    for version in ("", REVISION):
        meta = client.get_model_metadata("m", model_version=version)
        assert meta["name"] == "m"
        assert meta["versions"] == [REVISION]
        assert meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 512]}]
        assert meta["outputs"] == [{"name": "output", "datatype": "FP32", "shape": [-1, 8]}]
        config = client.get_model_config("m", model_version=version)
        assert config["max_batch_size"] == 8
        assert config["input"] == [{"name": "input", "data_type": "TYPE_FP32", "dims": [512]}]
        assert config["output"] == [{"name": "output", "data_type": "TYPE_FP32", "dims": [8]}]
        assert config["dynamic_batching"]["max_queue_delay_microseconds"] == 1000
    with pytest.raises(InferenceServerException) as exc:
        client.get_model_metadata("other")
    assert exc.value.status() == "404"
    assert "unknown model 'other'" in exc.value.message()
    with pytest.raises(InferenceServerException) as exc:
        client.get_model_config("m", model_version="7")
    assert exc.value.status() == "404"
    assert "unknown version '7'" in exc.value.message()


@pytest.mark.parametrize(
    ("binary_in", "outputs", "compression"),
    [
        (True, None, None),  # the client's defaults: binary input, binary_data_output
        (False, None, None),
        (False, [False], None),  # JSON in, JSON out
        (True, [True], None),
        (True, None, "gzip"),
        (False, [False], "deflate"),
    ],
    ids=["defaults", "json-in", "json-json", "binary-binary", "gzip", "deflate"],
)
def test_infer(
    client: httpclient.InferenceServerClient,
    binary_in: bool,
    outputs: list[bool] | None,
    compression: str | None,
) -> None:
    x = rows(3, seed=len(str(outputs)) + binary_in)
    inp = httpclient.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=binary_in)
    requested = None if outputs is None else [httpclient.InferRequestedOutput("output", binary_data=b) for b in outputs]
    result = client.infer(
        "m",
        [inp],
        outputs=requested,
        request_id="req-7",
        request_compression_algorithm=compression,
        response_compression_algorithm=compression,
    )
    out = result.as_numpy("output")
    assert out is not None and out.shape == (3, 8) and out.dtype == np.float32
    np.testing.assert_allclose(out, reference(x), rtol=1e-5, atol=1e-5)
    response = result.get_response()
    assert response["id"] == "req-7"
    assert response["model_name"] == "m"
    assert response["model_version"] == REVISION
    assert response["parameters"]["lane"] == "interactive"


def test_infer_versioned_and_with_reserved_parameters(client: httpclient.InferenceServerClient) -> None:
    x = rows(2, seed=11)
    inp = httpclient.InferInput("input", [2, 512], "FP32")
    inp.set_data_from_numpy(x)
    result = client.infer("m", [inp], model_version=REVISION, priority=1, timeout=5_000_000)
    np.testing.assert_allclose(result.as_numpy("output"), reference(x), rtol=1e-5, atol=1e-5)
    with pytest.raises(InferenceServerException) as exc:
        client.infer("m", [inp], model_version="nope")
    assert exc.value.status() == "404"


def test_infer_errors_are_decoded_by_the_client(client: httpclient.InferenceServerClient) -> None:
    wrong = httpclient.InferInput("input", [1, 4], "FP32")
    wrong.set_data_from_numpy(np.zeros((1, 4), np.float32))
    with pytest.raises(InferenceServerException) as exc:
        client.infer("m", [wrong])
    assert exc.value.status() == "400"
    assert "expected [-1, 512]" in exc.value.message()
    too_many = httpclient.InferInput("input", [9, 512], "FP32")
    too_many.set_data_from_numpy(rows(9, seed=1))
    with pytest.raises(InferenceServerException) as exc:
        client.infer("m", [too_many])
    assert exc.value.status() == "400"
    assert "maxBatchSize 8" in exc.value.message()


def _call(c: httpclient.InferenceServerClient, name: str) -> Callable[[], Any]:
    calls: dict[str, Callable[[], Any]] = {
        "statistics": lambda: c.get_inference_statistics(),
        "statistics/model": lambda: c.get_inference_statistics("m"),
        "repository/index": lambda: c.get_model_repository_index(),
        "repository/load": lambda: c.load_model("m"),
        "repository/unload": lambda: c.unload_model("m"),
        "system_shared_memory/status": lambda: c.get_system_shared_memory_status(),
        "system_shared_memory/register": lambda: c.register_system_shared_memory("r", "/k", 64),
        "system_shared_memory/unregister": lambda: c.unregister_system_shared_memory(),
        "cuda_shared_memory/status": lambda: c.get_cuda_shared_memory_status(),
        "cuda_shared_memory/unregister": lambda: c.unregister_cuda_shared_memory("r"),
        "trace/get": lambda: c.get_trace_settings(),
        "trace/model": lambda: c.update_trace_settings("m", {"trace_level": ["TIMESTAMPS"]}),
        "logging/get": lambda: c.get_log_settings(),
        "logging/update": lambda: c.update_log_settings({"log_info": True}),
    }
    return calls[name]


EXTENSION_CALLS = [
    ("statistics", "statistics"),
    ("statistics/model", "statistics"),
    ("repository/index", "model_repository"),
    ("repository/load", "model_repository"),
    ("repository/unload", "model_repository"),
    ("system_shared_memory/status", "system_shared_memory"),
    ("system_shared_memory/register", "system_shared_memory"),
    ("system_shared_memory/unregister", "system_shared_memory"),
    ("cuda_shared_memory/status", "cuda_shared_memory"),
    ("cuda_shared_memory/unregister", "cuda_shared_memory"),
    ("trace/get", "trace"),
    ("trace/model", "trace"),
    ("logging/get", "logging"),
    ("logging/update", "logging"),
]


@pytest.mark.parametrize(("call", "extension"), EXTENSION_CALLS, ids=[c for c, _ in EXTENSION_CALLS])
def test_unimplemented_extensions_answer_400_naming_the_extension(
    client: httpclient.InferenceServerClient, call: str, extension: str
) -> None:
    with pytest.raises(InferenceServerException) as exc:
        _call(client, call)()
    assert exc.value.status() == "400"
    assert f"the {extension} extension is not implemented" in exc.value.message()


def test_classification_and_shared_memory_tensors_are_refused(client: httpclient.InferenceServerClient) -> None:
    inp = httpclient.InferInput("input", [1, 512], "FP32")
    inp.set_data_from_numpy(rows(1, seed=3))
    with pytest.raises(InferenceServerException) as exc:
        client.infer("m", [inp], outputs=[httpclient.InferRequestedOutput("output", class_count=3)])
    assert exc.value.status() == "400"
    assert "classification extension is not implemented" in exc.value.message()
    shm = httpclient.InferInput("input", [1, 512], "FP32")
    shm.set_shared_memory("region", 2048)
    with pytest.raises(InferenceServerException) as exc:
        client.infer("m", [shm])
    assert exc.value.status() == "400"
    assert "shared-memory extensions are not implemented" in exc.value.message()


def test_unknown_v2_path_answers_json_404(server: Server) -> None:
    status, raw = server.get("/v2/models/m/infer")  # GET on a POST endpoint
    assert status == 404
    assert "is not an endpoint of batchpilot-runtime" in json.loads(raw)["error"]
    req = urllib.request.Request(server.url + "/v2/nothing/here", method="DELETE")
    status, raw = fetch(req)
    assert status == 404
    assert "DELETE /v2/nothing/here" in json.loads(raw)["error"]


async def test_asyncio_client(server: Server, tmp_path: Path) -> None:
    async with aioclient.InferenceServerClient(url=server.url.removeprefix("http://")) as c:
        assert await c.is_server_ready()
        assert (await c.get_server_metadata())["name"] == "batchpilot-runtime"
        x = rows(4, seed=5)
        inp = aioclient.InferInput("input", [4, 512], "FP32")
        inp.set_data_from_numpy(x)
        result = await c.infer("m", [inp])
        np.testing.assert_allclose(result.as_numpy("output"), reference(x), rtol=1e-5, atol=1e-5)
        with pytest.raises(InferenceServerException) as exc:
            await c.get_inference_statistics()
        assert exc.value.status() == "400"
