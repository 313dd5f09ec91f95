"""Drill 8's runtime fixes, on a real server process: a request whose batch is still running at
its lane's requestTimeout is answered 504 then (no client waits longer than requestTimeout), and
a full lane's 429 carries a whole-second Retry-After that grows with the overload."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from bp_rt_harness import Server, await_for, body, infer, lane

pytestmark = pytest.mark.runtime_server


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    lanes = [lane("short", 1, "1ms", 1, "1s"), lane("full", 1, "1ms", 1, "20s"), lane("other", 1, "1ms", 10, "20s")]
    with Server(tmp_path, lanes) as srv:
        yield srv


async def test_running_request_is_answered_504_at_its_deadline(server: Server) -> None:
    timed0 = server.metric("batchpilot_requests_total", lane="short", outcome="timed_out")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        server.close_gate()
        server.log_path.write_text("")
        t0 = time.monotonic()
        task = asyncio.create_task(infer(session, server, body([5]), lane_header="short"))
        await await_for(lambda: server.batches() == [[5]], what="the request in the model")
        status, doc = await task
        took = time.monotonic() - t0
        assert status == 504, doc
        assert "its batch was still running" in doc["error"]
        server_ms = float(doc["_headers"]["Server-Timing"].removeprefix("total;dur="))
        assert 1000 <= server_ms < 1500, server_ms
        assert 0.9 <= took < 3.0, took  # at the 1 s deadline, not when the gate opens (60 s)
        # Meanwhile a full lane sheds with a Retry-After in whole seconds. (A lane whose one queued
        # request outlives the test's own steps: a 1 s timeout could free the slot first.)
        blocked = asyncio.create_task(infer(session, server, body([6]), lane_header="full"))
        await await_for(
            lambda: server.metric("batchpilot_queue_depth", lane="full") >= 1 or blocked.done(), what="queued"
        )
        status, doc = await infer(session, server, body([7]), lane_header="full")
        assert status == 429 and "queue is full" in doc["error"]
        assert int(doc["_headers"]["Retry-After"]) >= 1
        server.open_gate()
        await blocked
        status, doc = await infer(session, server, body([8]), lane_header="other")
        assert status == 200
        assert 0 < float(doc["_headers"]["Server-Timing"].removeprefix("total;dur=")) < 10_000
    assert server.metric("batchpilot_requests_total", lane="short", outcome="timed_out") - timed0 >= 1
