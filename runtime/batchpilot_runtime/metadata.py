"""The Open Inference Protocol's metadata endpoints, apart from inference and the lifecycle.

``GET /v2`` (server metadata), ``GET /v2/models/NAME[/versions/V]`` (model metadata, with the
policy's lanes), ``.../ready`` and ``.../config`` (the model configuration extension, in
Triton's shape), a clear 400 naming each optional extension this server does not implement (a
stock client such as tritonclient may call them), and a 404 listing the endpoints for any other
path under ``/v2``. The routes themselves are registered by
:func:`batchpilot_runtime.server.build_app`, in one table.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from aiohttp import web

from batchpilot_runtime import __version__
from batchpilot_runtime.config import RuntimeConfig
from batchpilot_runtime.responses import json_doc, json_error
from batchpilot_runtime.tensors import ServedModel, TensorSpec

SERVER_NAME = "batchpilot-runtime"
# Open Inference Protocol extensions this server implements (named as Triton names them, so a
# client can check ``get_server_metadata()["extensions"]``).
EXTENSIONS = ("binary_tensor_data", "model_configuration")
_DATA_TYPES = {"FP32": "TYPE_FP32", "FP16": "TYPE_FP16", "INT64": "TYPE_INT64", "INT32": "TYPE_INT32"}

# Optional extensions a stock client (tritonclient) may call, answered 400 with their name.
UNIMPLEMENTED = (
    ("statistics", "/v2/models/stats"),
    ("statistics", "/v2/models/{name}/stats"),
    ("statistics", "/v2/models/{name}/versions/{version}/stats"),
    ("model_repository", "/v2/repository/{tail:.*}"),
    ("system_shared_memory", "/v2/systemsharedmemory/{tail:.*}"),
    ("cuda_shared_memory", "/v2/cudasharedmemory/{tail:.*}"),
    ("trace", "/v2/trace/setting"),
    ("trace", "/v2/models/{name}/trace/setting"),
    ("logging", "/v2/logging"),
    ("generate", "/v2/models/{name}/generate"),
    ("generate", "/v2/models/{name}/generate_stream"),
    ("generate", "/v2/models/{name}/versions/{version}/generate"),
    ("generate", "/v2/models/{name}/versions/{version}/generate_stream"),
)


class Served(Protocol):
    """What the metadata reads of the server (:class:`batchpilot_runtime.server.Runtime`)."""

    cfg: RuntimeConfig
    model: ServedModel | None
    track: str
    default_lane: str
    lane_names: list[str]

    async def health_ready(self, request: web.Request) -> web.Response: ...


class Metadata:
    """The metadata handlers of one server."""

    def __init__(self, rt: Served) -> None:
        self.rt = rt

    async def server(self, request: web.Request) -> web.Response:
        return json_doc({"name": SERVER_NAME, "version": __version__, "extensions": list(EXTENSIONS)})

    def check_model(self, request: web.Request) -> web.Response | None:
        """None when the request names the model and version served here, else its 404."""
        cfg = self.rt.cfg
        name = request.match_info["name"]
        if name != cfg.model.name:
            return json_error(404, f"unknown model {name!r}; this server serves {cfg.model.name!r}")
        version = request.match_info.get("version")
        if version is not None and version != cfg.revision:
            return json_error(
                404,
                f"unknown version {version!r} of model {name!r}; this server serves version "
                f"{cfg.revision!r} (the policy revision) only",
            )
        return None

    def _loaded_model(self, request: web.Request) -> ServedModel | web.Response:
        """The model the request names, or the answer: 404 (:meth:`check_model`), 503 while it loads."""
        bad = self.check_model(request)
        if bad is not None:
            return bad
        return self.rt.model if self.rt.model is not None else json_error(503, "model is loading")

    async def model(self, request: web.Request) -> web.Response:
        model = self._loaded_model(request)
        if isinstance(model, web.Response):
            return model
        rt, cfg = self.rt, self.rt.cfg
        doc = {
            "name": cfg.model.name,
            "versions": [cfg.revision],
            "platform": "pytorch",
            "inputs": [model.input.as_json()],
            "outputs": [model.output.as_json()],
            "parameters": {
                "source": cfg.model.source,
                "device": model.device_name,
                "dtype": cfg.model.dtype,
                "revision": cfg.revision,
                "track": rt.track,
                "policy": cfg.policy,
                "default_lane": rt.default_lane,
                "lanes": [lane.model_dump(mode="json", by_alias=True) for lane in cfg.lanes],
                "runtime_version": __version__,
            },
        }
        return json_doc(doc)

    async def model_ready(self, request: web.Request) -> web.Response:
        bad = self.check_model(request)
        if bad is not None:
            return bad
        return await self.rt.health_ready(request)

    async def model_config(self, request: web.Request) -> web.Response:
        """The model configuration extension, in Triton's shape (dims without the batch dim)."""
        model = self._loaded_model(request)
        if isinstance(model, web.Response):
            return model
        rt, cfg = self.rt, self.rt.cfg
        default = cfg.lane(rt.default_lane)

        def tensor(spec: TensorSpec) -> dict[str, Any]:
            return {"name": spec.name, "data_type": _DATA_TYPES[spec.datatype], "dims": list(spec.row_shape)}

        doc = {
            "name": cfg.model.name,
            "platform": "pytorch",
            "backend": SERVER_NAME,
            "max_batch_size": max(lane.max_batch_size for lane in cfg.lanes),
            "input": [tensor(model.input)],
            "output": [tensor(model.output)],
            "dynamic_batching": {
                "max_queue_delay_microseconds": round(default.max_queue_delay * 1e6),
                "default_queue_policy": {
                    "timeout_action": "REJECT",
                    "default_timeout_microseconds": round(default.request_timeout * 1e6),
                    "max_queue_size": default.max_queue_length,
                },
            },
            "parameters": {
                "revision": {"string_value": cfg.revision},
                "default_lane": {"string_value": rt.default_lane},
                "lanes": {"string_value": ",".join(rt.lane_names)},
            },
        }
        return json_doc(doc)


def not_implemented(extension: str) -> Callable[[web.Request], Awaitable[web.Response]]:
    """A handler for an optional protocol extension this server does not implement: a clear 400."""

    async def handler(request: web.Request) -> web.Response:
        return json_error(
            400,
            f"{request.method} {request.path}: the {extension} extension is not implemented by "
            f"{SERVER_NAME}; it implements the core Open Inference Protocol and {', '.join(EXTENSIONS)}",
        )

    return handler


async def no_route(request: web.Request) -> web.Response:
    return json_error(
        404,
        f"{request.method} {request.path} is not an endpoint of {SERVER_NAME} (Open Inference Protocol "
        "v2 REST: GET /v2, /v2/health/{live,ready}, /v2/models/NAME[/versions/V][/ready|/config], "
        "POST /v2/models/NAME[/versions/V]/infer)",
    )
