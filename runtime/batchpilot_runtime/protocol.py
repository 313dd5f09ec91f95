"""Open Inference Protocol v2 (KServe / Triton REST) request parsing and response encoding.

Validation happens here, per request, before anything reaches a batch: a request that fails it
is answered 400 and never shares a batch with anyone.

Supports JSON tensors (``data`` flat row-major or nested) and the binary tensor extension
(``Inference-Header-Content-Length`` header; ``parameters.binary_data_size`` on an input;
``parameters.binary_data: true`` on a requested output or ``parameters.binary_data_output: true``
on the request returns the output as raw little-endian bytes after the JSON header).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import orjson

from batchpilot_runtime.tensors import TensorSpec

BINARY_HEADER = "Inference-Header-Content-Length"
_ALLOWED_KINDS = {"FP32": "fiu", "FP16": "fiu", "INT64": "iu", "INT32": "iu"}
_ELEMENT_SIZE = {"FP32": 4, "FP16": 2, "INT64": 8, "INT32": 4}


class InvalidRequest(Exception):
    """The request is malformed for this model: answered 400 with this message."""


@dataclass
class InferRequest:
    id: str | None
    data: np.ndarray[Any, Any]
    lane: str | None
    binary_output: bool
    tenant: str | None = None
    """``parameters.tenant``: the client's own name for itself (the tenant header wins over it)."""


def _fail(msg: str) -> InvalidRequest:
    return InvalidRequest(msg)


def parse_infer(body: bytes, spec: TensorSpec, json_length: int | None = None) -> InferRequest:
    """Parse and validate one infer request body against the model's input spec."""
    header_bytes = body if json_length is None else body[:json_length]
    if json_length is not None and not 0 < json_length <= len(body):
        raise _fail(f"{BINARY_HEADER} {json_length} does not fit the {len(body)}-byte body")
    try:
        doc = orjson.loads(header_bytes)
    except orjson.JSONDecodeError as exc:
        raise _fail(f"request body is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise _fail("request body must be a JSON object with an 'inputs' list")
    inputs = doc.get("inputs")
    if not isinstance(inputs, list) or len(inputs) != 1 or not isinstance(inputs[0], dict):
        raise _fail(f"'inputs' must be a list with exactly one tensor named {spec.name!r}")
    tensor = inputs[0]
    name = tensor.get("name")
    if name != spec.name:
        raise _fail(f"unknown input {name!r}: this model's input is {spec.name!r}")
    datatype = tensor.get("datatype")
    if datatype != spec.datatype:
        raise _fail(f"input {spec.name!r} has datatype {datatype!r}, expected {spec.datatype!r}")
    shape = tensor.get("shape")
    if (
        not isinstance(shape, list)
        or len(shape) != len(spec.shape)
        or not all(isinstance(d, int) and not isinstance(d, bool) for d in shape)
    ):
        raise _fail(f"input {spec.name!r} shape must be a list like {list(spec.shape)}, got {shape!r}")
    if shape[0] < 1 or any(w != -1 and d != w for d, w in zip(shape, spec.shape, strict=True)):
        raise _fail(f"input {spec.name!r} has shape {shape}, expected {list(spec.shape)} with rows >= 1")
    count = math.prod(shape)
    params = tensor.get("parameters") or {}
    if not isinstance(params, dict):
        raise _fail("input 'parameters' must be an object")
    if "shared_memory_region" in params:
        raise _fail(
            "input shared_memory_region: the shared-memory extensions are not implemented; send the data inline"
        )
    binary_size = params.get("binary_data_size")
    if binary_size is not None:
        if json_length is None:
            raise _fail(f"binary_data_size given without the {BINARY_HEADER} header")
        raw = body[json_length:]
        if binary_size != len(raw) or binary_size != count * _ELEMENT_SIZE[datatype]:
            raise _fail(
                f"binary input has {len(raw)} bytes (binary_data_size {binary_size}); "
                f"shape {shape} {datatype} needs {count * _ELEMENT_SIZE[datatype]}"
            )
        arr = np.frombuffer(raw, dtype=np.dtype(spec.numpy_dtype).newbyteorder("<")).astype(spec.numpy_dtype, copy=True)
    else:
        data = tensor.get("data")
        if not isinstance(data, list):
            raise _fail(f"input {spec.name!r} needs a 'data' list (or binary data)")
        try:
            arr = np.array(data)
        except (ValueError, TypeError):
            raise _fail(f"input {spec.name!r} data is ragged or not numeric") from None
        if arr.size != count:
            raise _fail(f"input {spec.name!r} data has {arr.size} elements, shape {shape} needs {count}")
        if arr.dtype.kind not in _ALLOWED_KINDS[datatype]:
            raise _fail(f"input {spec.name!r} data must be numbers for {datatype}, got {arr.dtype.kind!r}")
        arr = arr.astype(spec.numpy_dtype, copy=False)
    arr = arr.reshape(shape)
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    req_params = doc.get("parameters") or {}
    if not isinstance(req_params, dict):
        raise _fail("request 'parameters' must be an object")
    lane = req_params.get("lane")
    if lane is not None and not isinstance(lane, str):
        raise _fail("parameters.lane must be a string")
    tenant = req_params.get("tenant")
    if tenant is not None and not isinstance(tenant, str):
        raise _fail("parameters.tenant must be a string")
    binary_output = bool(req_params.get("binary_data_output", False))
    outputs = doc.get("outputs")
    if outputs is not None:
        if not isinstance(outputs, list):
            raise _fail("'outputs' must be a list")
        for out in outputs:
            if not isinstance(out, dict) or out.get("name") != "output":
                raise _fail("unknown requested output: this model's output is 'output'")
            out_params = out.get("parameters") or {}
            if not isinstance(out_params, dict):
                raise _fail("output 'parameters' must be an object")
            for unsupported, what in (("classification", "classification"), ("shared_memory_region", "shared-memory")):
                if unsupported in out_params:
                    raise _fail(f"output {unsupported}: the {what} extension is not implemented")
            if out_params.get("binary_data"):
                binary_output = True
    rid = doc.get("id")
    return InferRequest(
        id=None if rid is None else str(rid), data=arr, lane=lane, binary_output=binary_output, tenant=tenant
    )


def encode_response(
    model_name: str,
    model_version: str,
    request_id: str | None,
    output: np.ndarray[Any, Any],
    parameters: dict[str, Any],
    binary: bool,
) -> tuple[bytes, dict[str, str]]:
    """Body and extra headers of an infer response."""
    out: dict[str, Any] = {"name": "output", "datatype": "FP32", "shape": list(output.shape)}
    doc: dict[str, Any] = {
        "model_name": model_name,
        "model_version": model_version,
        "outputs": [out],
        "parameters": parameters,
    }
    if request_id is not None:
        doc["id"] = request_id
    if binary:
        raw = np.ascontiguousarray(output, dtype="<f4").tobytes()
        out["parameters"] = {"binary_data_size": len(raw)}
        head = orjson.dumps(doc)
        return head + raw, {BINARY_HEADER: str(len(head))}
    out["data"] = output.reshape(-1)
    return orjson.dumps(doc, option=orjson.OPT_SERIALIZE_NUMPY), {}


def error_body(message: str) -> bytes:
    return orjson.dumps({"error": message})
