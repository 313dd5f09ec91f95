"""The runtime's admin routes, next to ``/metrics`` (not part of the inference API under ``/v2``).

``GET /admin/arrivals[?since=1h][&lane=NAME]``
    The recent arrivals of each lane (see :mod:`batchpilot_runtime.capture`), with the
    runtime's policy, revision, track, pod, the lanes' settings, the ring's bounds and each
    lane's batch cut delay summary. ``since`` is a duration (``30m``) or seconds.
``GET /admin/profile[?format=yaml]``
    The latency profile measured in this process (warm-up and live batches), in the format
    ``batchpilot profile`` writes: save it and pass it to ``batchpilot tune --profile``.

Both are read by ``kubectl batchpilot recommend`` and the operator through the apiserver's
pod proxy (``pods/proxy``), so they are plain GETs without side effects.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import yaml
from aiohttp import web

from batchpilot_runtime.capture import LiveProfile
from batchpilot_runtime.config import parse_duration
from batchpilot_runtime.responses import json_doc, json_error

log = logging.getLogger(__name__)


def profile_warmup(
    model: Any, sizes: Sequence[int], passes: int, profile: LiveProfile, beyond: Sequence[int] = ()
) -> None:
    """Time ``passes`` forward passes at each warm size, the way the batch worker runs them; then
    at each size of ``beyond`` (larger than any lane serves: one untimed pass first, and the first
    size that fails, out of memory for one, ends them without failing the start)."""
    import numpy as np

    row = model.example(1)

    def timed(b: int) -> float:
        parts = [row] * b
        t0 = time.perf_counter()
        x = parts[0] if b == 1 else np.concatenate(parts)
        model.run(x)
        return time.perf_counter() - t0

    for _ in range(passes):
        for b in sizes:
            profile.add_warmup(b, timed(b))
    for b in beyond:
        try:
            timed(b)
            for _ in range(passes):
                profile.add_warmup(b, timed(b))
        except Exception as exc:  # a size no lane serves: its failure must not fail the pod
            log.warning("live profile stops at %d rows: a %d-row pass failed: %s", b // 2, b, exc)
            return


def pod_name() -> str | None:
    return os.environ.get("BATCHPILOT_POD_NAME") or os.environ.get("HOSTNAME") or None


def add_routes(app: web.Application, rt: Any) -> None:
    """Register the admin routes for runtime ``rt`` (a ``server.Runtime``)."""

    async def arrivals(request: web.Request) -> web.Response:
        since_text = request.query.get("since")
        since: float | None = None
        if since_text is not None:
            try:
                since = parse_duration(since_text)
            except ValueError as exc:
                return json_error(400, f"since: {exc}")
            if since <= 0:
                return json_error(400, "since must be positive")
        doc = rt.capture.arrivals_doc(since, pod_name())
        lane = request.query.get("lane")
        if lane is not None:
            lanes = [entry for entry in doc["lanes"] if entry["name"] == lane]
            if not lanes:
                return json_error(404, f"unknown lane {lane!r}; lanes are {[e['name'] for e in doc['lanes']]}")
            doc["lanes"] = lanes
        return json_doc(doc)

    async def profile(request: web.Request) -> web.Response:
        model = rt.model
        if model is None:
            return json_error(503, "model is loading: no profile yet")
        doc = rt.capture.profile_doc(model.device_name, model.threads)
        if request.query.get("format") == "yaml":
            return web.Response(text=yaml.safe_dump(doc, sort_keys=False), content_type="application/yaml")
        return json_doc(doc)

    app.router.add_get("/admin/arrivals", arrivals)
    app.router.add_get("/admin/profile", profile)
