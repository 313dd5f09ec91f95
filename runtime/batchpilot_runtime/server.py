"""The runtime HTTP server: Open Inference Protocol v2 over aiohttp, one batcher per process.

Run: ``python -m batchpilot_runtime.server --config config.json [--host H] [--port N] [--track T]``.

Lifecycle: the HTTP listener starts first (liveness answers at once), then the model is loaded
and warmed at each batch size (:func:`batchpilot_runtime.tensors.warmup_sizes`); only then does
readiness turn 200. On SIGTERM (or SIGINT) readiness turns 503, new infer requests get 503,
queued and running batches are flushed (windows no longer wait) and answered, and the process
exits 0 once every admitted request has its response, or when ``drainTimeout`` passes (then
the requests still queued get 503 and are not run).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import logging
import math
import os
import signal
import sys
import threading
import time
from typing import Any

import numpy as np
from aiohttp import web

from batchpilot_runtime import admin
from batchpilot_runtime.batcher import BatchWorker
from batchpilot_runtime.capture import FAILED, WARMUP_PASSES, Capture, capture_bounds_from_env
from batchpilot_runtime.config import RuntimeConfig, load_config
from batchpilot_runtime.looplag import LoopLagProbe
from batchpilot_runtime.metadata import UNIMPLEMENTED, Metadata, no_route, not_implemented
from batchpilot_runtime.metrics import CONTENT_TYPE, UNKNOWN_LANE, Metrics
from batchpilot_runtime.modelproc import ModelProcess
from batchpilot_runtime.protocol import (
    BINARY_HEADER,
    InvalidRequest,
    encode_response,
    parse_infer,
)
from batchpilot_runtime.responses import JSON, json_error
from batchpilot_runtime.scheduler import Batch, Pending, QueueFull, State
from batchpilot_runtime.shedding import RetryAfter
from batchpilot_runtime.tensors import ServedModel, TensorSpec, profile_beyond_sizes, warmup_sizes

log = logging.getLogger("batchpilot.runtime")

LANE_HEADER = "X-Batchpilot-Lane"
RETRY_AFTER_S = "1"

# Outcome tuples set on a request's future by the worker side.
_OK = 0
_TIMEOUT = 1
_FAILED = 2
_SHUTDOWN = 3


LOOP_NICE = 10
"""The event loop's niceness above the model's (``BATCHPILOT_LOOP_NICE``; 0 turns it off)."""


def deprioritize_this_thread(nice: int) -> None:
    """Lower the calling thread's CPU priority by ``nice`` (Linux: a thread's own niceness).

    The event loop runs below the model (its process, or its thread under ``isolation: thread``)
    and the worker thread. When they share a core (a CPU model, or a
    host with fewer cores than threads) and clients retry every 429 at once, the rejections
    would otherwise take half of that core from the forward passes (CFS shares it evenly between
    runnable threads): drill 8 measured 58-60% of the capacity left as goodput. At nice 10 the
    model thread gets about 90% of a contended core, and the loop still answers every request
    (at 19 it fell so far behind that clients timed out). Raising one's own niceness needs no
    privilege; a platform without per-thread priorities is left as it is."""
    if nice <= 0 or not hasattr(os, "setpriority"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + nice)
    except OSError as exc:
        log.warning("could not lower the event loop's priority by %d: %s", nice, exc)


class Runtime:
    """Server state: config, model, batcher, metrics, lifecycle flags."""

    def __init__(self, cfg: RuntimeConfig, track: str, loop_nice: int = 0) -> None:
        self.cfg = cfg
        self.loop_nice = loop_nice
        self.track = track
        self.lane_names = [lane.name for lane in cfg.lanes]
        self.lane_index = {name: i for i, name in enumerate(self.lane_names)}
        self.default_lane = cfg.default_lane_name
        self.tenant_cfg = cfg.tenant_config
        self.model: ServedModel | None = None
        self.worker: BatchWorker | None = None
        self.metrics: Metrics | None = None
        self.ready = False
        self.draining = False
        self.load_error: str | None = None
        self.inflight = 0  # admitted requests without a response yet
        self.handlers = 0  # infer handlers running
        self.loop: asyncio.AbstractEventLoop | None = None
        self.idle = asyncio.Event()
        self.idle.set()
        self.capture = Capture(cfg, track, *capture_bounds_from_env())
        self.shedding = RetryAfter(time.monotonic)
        self.loop_lag: LoopLagProbe | None = None
        self.meta = Metadata(self)

    # -- startup -----------------------------------------------------------------------------
    def load(self) -> None:
        """Load and warm the model (runs in a thread while liveness already answers)."""
        sizes = warmup_sizes([lane.max_batch_size for lane in self.cfg.lanes])
        model: ServedModel
        if self.cfg.model.isolation == "process":
            model = ModelProcess(self.cfg.model, sizes)
        else:
            from batchpilot_runtime.models import LoadedModel  # torch: only where the model runs

            loaded = LoadedModel(self.cfg.model)
            loaded.warmup(sizes)
            model = loaded
        maxima = [lane.max_batch_size for lane in self.cfg.lanes]
        row_bytes = sum(math.prod(t.row_shape) * np.dtype(t.numpy_dtype).itemsize for t in (model.input, model.output))
        beyond = profile_beyond_sizes(maxima, row_bytes)
        admin.profile_warmup(model, sizes, WARMUP_PASSES, self.capture.profile, beyond)
        self.model = model

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.loop = loop
        try:
            await loop.run_in_executor(None, self.load)
        except Exception as exc:
            self.load_error = f"{type(exc).__name__}: {exc}"
            log.exception("model load failed")
            raise
        assert self.model is not None
        self.worker = worker = BatchWorker(
            self.cfg.lanes,
            self.model.run,
            self._deliver_threadsafe,
            self._expire_threadsafe,
            on_admit=self.capture.record if self.capture.enabled else None,
        )
        self.metrics = Metrics(
            self.cfg.revision,
            self.lane_names,
            self.cfg.model.name,
            self.model.device_name,
            self.cfg.model.dtype,
            self.worker.depth_rows,
            lambda: worker.busy_seconds,
        )
        self.worker.start()
        # After the worker thread exists (it keeps the priority it was created with).
        deprioritize_this_thread(self.loop_nice)
        self.loop_lag = LoopLagProbe(self.metrics.loop_lag.observe)
        self.loop_lag.start()
        self.capture.front_end.tick(time.perf_counter())  # its first window: idle, after the warm-up
        self.ready = True
        log.info(
            "ready: model %s (%s) on %s/%s, warmed at %s rows, lanes %s, revision %s, track %s",
            self.cfg.model.name, self.cfg.model.source, self.model.device_name, self.cfg.model.dtype,
            self.model.warmed, self.lane_names, self.cfg.revision, self.track,
        )  # fmt: skip

    # -- worker -> loop hand-off ---------------------------------------------------------------
    def _deliver_threadsafe(
        self, batch: Batch, output: np.ndarray[Any, Any] | None, error: BaseException | None, exec_s: float
    ) -> None:
        m = self.metrics
        lane = batch.lane.name
        if m is not None:
            m.exe[lane].observe(exec_s)
            m.rows[lane].observe(batch.rows)
            for r in batch.requests:
                m.queue_age_of(lane, r.tenant).observe(r.dispatched_at - r.arrival)
            if batch.cut_delay is not None:
                m.cut[lane].observe(batch.cut_delay)
                self.capture.cut[batch.lane.index].add(batch.cut_delay)
        self.capture.front_end.count_batch()
        if output is not None:
            self.capture.profile.add_live(batch.rows, exec_s)
            for r in batch.requests:
                r.exec_s = exec_s
        assert self.loop is not None
        self.loop.call_soon_threadsafe(self._deliver, batch, output, error)

    def _deliver(self, batch: Batch, output: np.ndarray[Any, Any] | None, error: BaseException | None) -> None:
        if output is None:
            msg = (
                f"model execution failed for this request's batch ({batch.rows} rows, "
                f"{len(batch.requests)} requests, lane {batch.lane.name!r}): "
                f"{getattr(error, 'kind', type(error).__name__)}: {error}"
            )
            for r in batch.requests:
                if not r.future.done():
                    r.future.set_result((_FAILED, msg, batch.rows))
            return
        offset = 0
        for r in batch.requests:
            n = r.rows
            if not r.future.done():
                r.future.set_result((_OK, output[offset : offset + n], batch.rows))
            offset += n

    def _expire_threadsafe(self, requests: list[Pending]) -> None:
        assert self.loop is not None
        self.loop.call_soon_threadsafe(self._expired, requests)

    def _expired(self, requests: list[Pending]) -> None:
        for r in requests:
            self._answer_timeout(r)

    def _answer_timeout(self, r: Pending) -> None:
        if self.metrics is not None:
            self.metrics.queue_age_of(self.lane_names[r.lane], r.tenant).observe(time.perf_counter() - r.arrival)
        self._time_out(r, "waited longer than", " before dispatch; it was not run")

    def _on_timer(self, r: Pending) -> None:
        """``requestTimeout`` after arrival: a queued request is withdrawn (never run); one whose
        batch is still running is answered 504 now and its result discarded, so no client waits
        longer than its lane's requestTimeout for an answer (drill 8: under overload a request
        dispatched just before its deadline used to be answered a batch later)."""
        assert self.worker is not None
        if self.worker.withdraw(r, State.TIMED_OUT):
            self._answer_timeout(r)
        else:
            self._time_out(r, "did not complete within", ": its batch was still running; the result is discarded")

    def _time_out(self, r: Pending, what: str, then: str) -> None:
        """Answer ``r`` 504 (unless it is answered already): "request <what> lane L
        requestTimeout (Ns)<then>"."""
        if not r.future.done():
            lane = self.cfg.lanes[r.lane]
            why = f"request {what} lane {lane.name!r} requestTimeout ({lane.request_timeout:g}s){then}"
            r.future.set_result((_TIMEOUT, why, 0))

    # -- handlers ------------------------------------------------------------------------------
    async def live(self, request: web.Request) -> web.Response:
        if self.model is not None and not self.model.alive:  # restart me: no batch can run
            return json_error(500, "the model process exited; restart the server")
        return web.Response(body=b'{"live":true}', content_type=JSON)

    async def health_ready(self, request: web.Request) -> web.Response:
        if self.ready and not self.draining:
            return web.Response(body=b'{"ready":true}', content_type=JSON)
        reason = "draining" if self.draining else (self.load_error or "loading model")
        return json_error(503, f"not ready: {reason}")

    async def metrics_handler(self, request: web.Request) -> web.Response:
        self.capture.front_end.tick(time.perf_counter())
        body = self.metrics.render() if self.metrics is not None else b""
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})

    async def infer(self, request: web.Request) -> web.Response:
        arrival = time.perf_counter()
        self.handlers += 1
        self.idle.clear()
        try:
            return await self._infer(request, arrival)
        finally:
            self.capture.front_end.count(time.perf_counter())
            self.handlers -= 1
            if self.handlers == 0 and self.inflight == 0:
                self.idle.set()

    async def _infer(self, request: web.Request, arrival: float) -> web.Response:
        header_lane = request.headers.get(LANE_HEADER)
        tenants = self.tenant_cfg
        header_tenant = request.headers.get(tenants.header)
        tenant = tenants.label(header_tenant)
        m = self.metrics
        bad = self.meta.check_model(request)
        if bad is not None:
            if m is not None:
                m.outcome(UNKNOWN_LANE, "invalid", tenant, bad.status)
            return bad
        if self.draining or not self.ready or m is None or self.model is None or self.worker is None:
            if m is not None:
                m.outcome(header_lane or self.default_lane, "unavailable", tenant)
            why = "server is shutting down" if self.draining else "model is not ready yet"
            return json_error(503, why, {"Retry-After": RETRY_AFTER_S})
        # Shed before reading and parsing the body when the lane is known from the header (or is
        # the only lane) and its queue is full: under a retry storm most requests are rejected,
        # and each rejection should cost as little as possible of the CPU the batches need.
        # (Advisory read without the lock; ``submit`` checks again under it.)
        known = header_lane or (self.default_lane if len(self.cfg.lanes) == 1 else None)
        early = self.lane_index.get(known) if known is not None else None
        if early is not None:
            queue = self.worker.scheduler.lanes[early]
            if queue.live_count >= queue.cfg.max_queue_length:
                return self._reject_full(
                    queue.name,
                    f"lane {queue.name!r} queue is full (maxQueueLength {queue.cfg.max_queue_length}); retry later",
                    tenant,
                )
        body = await request.read()
        json_len_text = request.headers.get(BINARY_HEADER)
        spec: TensorSpec = self.model.input
        try:
            json_len = int(json_len_text) if json_len_text is not None else None
            parsed = parse_infer(body, spec, json_len)
        except (InvalidRequest, ValueError) as exc:
            m.outcome(header_lane or self.default_lane, "invalid", tenant)
            return json_error(400, str(exc))
        if not header_tenant and parsed.tenant:  # the header wins over parameters.tenant
            tenant = tenants.label(parsed.tenant)
        lane_name = header_lane or parsed.lane or self.default_lane
        idx = self.lane_index.get(lane_name)
        if idx is None:
            m.outcome(UNKNOWN_LANE, "invalid", tenant)
            return json_error(400, f"unknown lane {lane_name!r}; lanes are {self.lane_names}")
        lane_cfg = self.cfg.lanes[idx]
        rows = parsed.data.shape[0]
        if rows > lane_cfg.max_batch_size:
            m.outcome(lane_name, "invalid", tenant)
            return json_error(
                400,
                f"request has {rows} rows, more than lane {lane_name!r} maxBatchSize "
                f"{lane_cfg.max_batch_size}; split it into smaller requests",
            )
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[tuple[int, Any, int]] = loop.create_future()
        req = Pending(parsed.data, idx, arrival, fut, tenant)
        try:
            self.worker.submit(req)
        except QueueFull as exc:
            return self._reject_full(lane_name, str(exc), tenant)
        self.shedding.admitted()
        self.inflight += 1
        remaining = lane_cfg.request_timeout - (time.perf_counter() - arrival)
        req.timer = loop.call_later(max(remaining, 0.0), self._on_timer, req)
        try:
            kind, payload, batch_rows = await fut
            woke = time.perf_counter()
        except asyncio.CancelledError:
            self.worker.withdraw(req, State.CANCELLED)  # a handler cancelled mid-wait is never run
            raise
        finally:
            req.timer.cancel()
            self.inflight -= 1
        latency = m.latency_of(lane_name, tenant)
        if kind == _OK:
            params = {"lane": lane_name, "batch_rows": batch_rows}
            body_out, headers = encode_response(
                self.cfg.model.name, self.cfg.revision, parsed.id, payload, params, parsed.binary_output
            )
            resp = web.Response(body=body_out, content_type=JSON, headers=headers)
            m.outcome(lane_name, "ok", tenant)
        elif kind == _TIMEOUT:
            resp = json_error(504, payload)
            m.outcome(lane_name, "timed_out", tenant)
        elif kind == _SHUTDOWN:
            resp = json_error(503, payload, {"Retry-After": RETRY_AFTER_S})
            m.outcome(lane_name, "unavailable", tenant)
        else:
            resp = json_error(500, payload)
            m.outcome(lane_name, "failed", tenant)
        elapsed = time.perf_counter() - arrival
        latency.observe(elapsed)
        wait = req.dispatched_at - arrival if req.dispatched_at > 0 else elapsed
        if kind == _OK:
            # After the cut: the batch's pass, and the rest until this handler ran again (the
            # worker's bookkeeping and the event loop's delay in taking the answer).
            handoff = woke - req.dispatched_at - req.exec_s
            self.capture.record_outcome(idx, arrival, elapsed, wait, req.exec_s, handoff)
            # Outside the queue and the model: parsing, the hand-offs, the answer (the profile's requestOverhead).
            self.capture.overhead.add(elapsed - wait - req.exec_s)
        else:
            self.capture.record_outcome(idx, arrival, FAILED, wait)
        # The server's own view of the request's time (W3C Server-Timing): from the handler's
        # start to the answer, what requestTimeout bounds; a client's measurement adds transit.
        resp.headers["Server-Timing"] = f"total;dur={elapsed * 1000:.3f}"
        return resp

    def _reject_full(self, lane: str, message: str, tenant: str) -> web.Response:
        """429 with a Retry-After that grows with the overload (:mod:`batchpilot_runtime.shedding`).

        (Holding the 429 back in a retry storm, to slow clients that ignore the header, was
        tried in drill 8 and dropped: a client's pooled connections fill with held rejections
        and its admissible requests queue behind them, so the goodput fell further.)"""
        if self.metrics is not None:
            self.metrics.outcome(lane, "rejected_full", tenant)
        self.shedding.rejected()
        return json_error(429, message, {"Retry-After": self.shedding.retry_after()})

    # -- shutdown ------------------------------------------------------------------------------
    async def drain(self) -> None:
        """Stop accepting, flush queues, wait for every admitted request's answer (bounded)."""
        self.draining = True
        deadline = time.perf_counter() + self.cfg.drain_timeout
        if self.worker is not None:
            self.worker.flush()
        while self.inflight or self.handlers:
            left = deadline - time.perf_counter()
            if left <= 0:
                break
            self.idle.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.idle.wait(), min(left, 0.05))
        if self.worker is not None:
            self.worker.stop()
            # Past the deadline: whatever is still queued is answered 503, never run.
            with self.worker.lock:
                leftovers = [p for lane in self.worker.scheduler.lanes for p in lane.queue if p.state is State.QUEUED]
                for p in leftovers:
                    self.worker.scheduler.withdraw(p, State.CANCELLED)
            for p in leftovers:
                if not p.future.done():
                    p.future.set_result((_SHUTDOWN, "server shut down before this request was run", 0))
        # Let the handlers write their responses.
        if self.handlers:
            self.idle.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.idle.wait(), 2.0)


def build_app(rt: Runtime) -> web.Application:
    app = web.Application(client_max_size=256 * 1024 * 1024)
    r = app.router
    meta = rt.meta
    r.add_get("/v2", meta.server)
    r.add_get("/v2/health/live", rt.live)
    r.add_get("/v2/health/ready", rt.health_ready)
    for extension, path in UNIMPLEMENTED:  # before /v2/models/{name}, which "stats" would match
        r.add_route("*", path, not_implemented(extension))
    for model in ("/v2/models/{name}", "/v2/models/{name}/versions/{version}"):
        r.add_get(model, meta.model)
        r.add_get(model + "/ready", meta.model_ready)
        r.add_get(model + "/config", meta.model_config)
        r.add_post(model + "/infer", rt.infer)
    r.add_get("/metrics", rt.metrics_handler)
    admin.add_routes(app, rt)
    r.add_route("*", "/v2/{tail:.*}", no_route)
    return app


async def serve(cfg: RuntimeConfig, host: str, port: int, track: str, loop_nice: int = 0) -> int:
    rt = Runtime(cfg, track, loop_nice)
    app = build_app(rt)
    runner = web.AppRunner(app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=1024, reuse_address=True)
    await site.start()
    log.info("listening on http://%s:%d (loading model %s)", host, port, cfg.model.source)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loader = asyncio.ensure_future(rt.start())
    waiter = asyncio.ensure_future(stop.wait())
    await asyncio.wait({loader, waiter}, return_when=asyncio.FIRST_COMPLETED)
    code = 0
    if loader.done() and loader.exception() is not None:
        code = 1
        waiter.cancel()
    else:
        await waiter
        log.info("signal received: draining (deadline %.3gs)", cfg.drain_timeout)
        if not loader.done():
            loader.cancel()
            with contextlib.suppress(BaseException):
                await loader
        await rt.drain()
    if rt.loop_lag is not None:
        await rt.loop_lag.stop()
    await runner.cleanup()
    if rt.worker is not None:
        rt.worker.join(timeout=5.0)
    if rt.model is not None:
        rt.model.close()
    log.info("stopped")
    return code


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="batchpilot-runtime", description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="runtime config file (JSON or YAML)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=None, help="default: the config's port (8000)")
    p.add_argument("--track", default=None, help="stable|canary (default: $BATCHPILOT_TRACK, else config)")
    p.add_argument("--log-level", default=os.environ.get("BATCHPILOT_LOG_LEVEL", "INFO"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    cfg = load_config(args.config)
    track = args.track or os.environ.get("BATCHPILOT_TRACK") or cfg.track
    port = args.port if args.port is not None else cfg.port
    # The worker thread needs the GIL briefly for each batch (and under isolation: thread, the model
    # between torch ops); with the default 5 ms switch interval a busy event loop holds it that long.
    sys.setswitchinterval(float(os.environ.get("BATCHPILOT_SWITCH_INTERVAL", "0.0002")))
    runner: Any = asyncio.run
    with contextlib.suppress(ImportError):  # optional: a faster event loop when installed
        runner = importlib.import_module("uvloop").run
    loop_nice = int(os.environ.get("BATCHPILOT_LOOP_NICE", str(LOOP_NICE)))
    return int(runner(serve(cfg, args.host, port, track, loop_nice)))


if __name__ == "__main__":
    sys.exit(main())
