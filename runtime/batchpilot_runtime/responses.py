"""The runtime's JSON answers: a document, or an error in the protocol's ``{"error": ...}`` shape."""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from batchpilot_runtime.protocol import error_body

JSON = "application/json"


def json_doc(doc: Any) -> web.Response:
    """``doc`` as a 200 JSON response."""
    return web.Response(body=orjson.dumps(doc), content_type=JSON)


def json_error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    """An error response: ``status`` with ``{"error": message}`` (and ``headers``, e.g. Retry-After)."""
    return web.Response(status=status, body=error_body(message), content_type=JSON, headers=headers)
