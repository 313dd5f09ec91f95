"""The runtime server end to end: a real process on 127.0.0.1, real torch on CPU, real HTTP.

Most tests share one server whose test model can be held busy (a gate file) so that queues are
built deterministically: a *blocker* request occupies the model, the test queues requests one
by one (waiting on the queue-depth gauge), then opens the gate and reads what ran together
from the model's batch log.
"""

from __future__ import annotations

import asyncio
import json
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from bp_rt_harness import Server, await_for, body, infer, lane

pytestmark = pytest.mark.runtime_server

LANES = [
    lane("background", 4, "1ms", 50, "20s", priority=0),
    lane("interactive", 2, "1ms", 20, "20s", priority=10),
    lane("short", 4, "1ms", 10, "1s", priority=5),
    lane("small", 1, "1ms", 3, "20s", priority=2),
    lane("fill", 4, "30s", 50, "60s", priority=1),
    lane("window", 64, "100ms", 200, "20s", priority=1),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with Server(tmp_path_factory.mktemp("rt"), LANES, extra={"defaultLane": "background"}) as srv:
        yield srv


async def start_blocker(session: aiohttp.ClientSession, srv: Server, marker: int = 1) -> asyncio.Task[Any]:
    """Close the gate and send one request that enters the model and stays there."""
    srv.close_gate()
    srv.log_path.write_text("")
    task = asyncio.create_task(infer(session, srv, body([marker]), lane_header="background"))
    await await_for(lambda: srv.batches() == [[marker]], what="blocker to enter the model")
    return task


async def queue(
    session: aiohttp.ClientSession, srv: Server, lane_name: str, markers: list[int], **kw: Any
) -> asyncio.Task[Any]:
    """Send one request and wait until it is queued (depth gauge grows by its rows)."""
    before = srv.metric("batchpilot_queue_depth", lane=lane_name)
    task = asyncio.create_task(infer(session, srv, body(markers, **kw), lane_header=lane_name))
    await await_for(
        lambda: srv.metric("batchpilot_queue_depth", lane=lane_name) >= before + len(markers) or task.done(),
        what=f"request {markers} queued in {lane_name}",
    )
    assert not task.done(), task.result()
    return task


def after_blocker(srv: Server) -> list[list[int]]:
    batches = srv.batches()
    assert batches[0] == [1]
    return batches[1:]


async def test_health_and_metadata(server: Server) -> None:
    assert server.get("/v2/health/live")[0] == 200
    assert server.get("/v2/health/ready")[0] == 200
    assert server.get("/v2/models/m/ready")[0] == 200
    status, raw = server.get("/v2/models/m")
    meta = json.loads(raw)
    assert status == 200
    assert meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 512]}]
    assert meta["outputs"] == [{"name": "output", "datatype": "FP32", "shape": [-1, 8]}]
    assert meta["parameters"]["track"] == "canary"
    assert meta["parameters"]["default_lane"] == "background"
    assert server.get("/v2/models/nope")[0] == 404


async def test_event_loop_runs_below_the_model(server: Server, session: Any) -> None:
    """The event loop (the process's main thread) at BATCHPILOT_LOOP_NICE (10) above the model
    (its process), which keeps the niceness the server started with (this test's)."""
    base = os.getpriority(os.PRIO_PROCESS, 0)
    status, _ = await infer(session, server, body([3]), "background")
    assert status == 200
    assert int(server.nice_path.read_text()) == base, "the model runs at the server's own priority"
    assert os.getpriority(os.PRIO_PROCESS, server.proc.pid) == min(base + 10, 19), "the event loop runs below it"


async def test_full_batches_dispatch_without_waiting_for_window(server: Server, session: Any) -> None:
    # Lane "fill" has a 30 s window: only a full batch (4 rows) can be dispatched in this test.
    server.log_path.write_text("")
    n0 = server.metric("batchpilot_batch_size_rows_count", lane="fill")
    s0 = server.metric("batchpilot_batch_size_rows_sum", lane="fill")
    results = await asyncio.gather(*(infer(session, server, body([10 + i]), "fill") for i in range(8)))
    assert [status for status, _ in results] == [200] * 8
    assert all(doc["parameters"] == {"lane": "fill", "batch_rows": 4} for _, doc in results)
    assert sorted(len(b) for b in server.batches()) == [4, 4]
    assert server.metric("batchpilot_batch_size_rows_count", lane="fill") - n0 == 2
    assert server.metric("batchpilot_batch_size_rows_sum", lane="fill") - s0 == 8


async def test_partial_batch_dispatches_when_window_expires(server: Server, session: Any) -> None:
    # Lane "window": max 64 rows, 100 ms window. Three rows never fill it; the window sends them.
    def ages() -> tuple[float, float]:
        return (
            server.metric("batchpilot_queue_age_seconds_count", lane="window"),
            server.metric("batchpilot_queue_age_seconds_bucket", lane="window", le="0.075"),
        )

    count0, fast0 = ages()
    server.log_path.write_text("")
    results = await asyncio.gather(*(infer(session, server, body([20 + i]), "window") for i in range(3)))
    assert [status for status, _ in results] == [200] * 3
    assert all(len(b) < 64 for b in server.batches())
    assert sum(len(b) for b in server.batches()) == 3
    count, fast = ages()
    assert count - count0 == 3
    # The first request of a batch waited the full window (>= 100 ms): not every age is <= 75 ms.
    assert (count - count0) - (fast - fast0) >= 1


async def test_batches_form_while_model_busy_up_to_limit_without_splitting(server: Server, session: Any) -> None:
    blocker = await start_blocker(session, server)
    sizes = [[100], [101, 102], [103, 104], [105], [106, 107, 108], [109]]
    tasks = [await queue(session, server, "background", markers) for markers in sizes]
    server.open_gate()
    assert (await blocker)[0] == 200
    results = [await t for t in tasks]
    assert [s for s, _ in results] == [200] * 6
    # FIFO, at most 4 rows, a request never split: 1+2 | 2+1 | 3+1
    assert after_blocker(server) == [[100, 101, 102], [103, 104, 105], [106, 107, 108, 109]]
    assert [doc["parameters"]["batch_rows"] for _, doc in results] == [3, 3, 3, 3, 4, 4]
    assert [doc["outputs"][0]["shape"] for _, doc in results] == [
        [1, 8],
        [2, 8],
        [2, 8],
        [1, 8],
        [3, 8],
        [1, 8],
    ]


async def test_interactive_lane_preferred_and_background_not_starved(server: Server, session: Any) -> None:
    blocker = await start_blocker(session, server)
    bg = [await queue(session, server, "background", [400 + 2 * i, 401 + 2 * i]) for i in range(2)]
    inter = [await queue(session, server, "interactive", [300 + i]) for i in range(12)]
    server.open_gate()
    await blocker
    assert all(s == 200 for s, _ in [await t for t in bg + inter])
    # Interactive (priority 10, 2 rows per batch) first; the ready background batch is passed
    # over 4 times, then served; interactive continues.
    assert after_blocker(server) == [
        [300, 301], [302, 303], [304, 305], [306, 307], [400, 401, 402, 403],
        [308, 309], [310, 311],
    ]  # fmt: skip


async def test_lanes_keep_their_own_settings(server: Server, session: Any) -> None:
    status, doc = await infer(session, server, body([1, 2, 3]), "interactive")
    assert status == 400
    assert "maxBatchSize 2" in doc["error"]
    status, doc = await infer(session, server, body([1, 2, 3]), "background")
    assert status == 200
    assert doc["parameters"]["lane"] == "background"
    # lane from the request parameters; the header wins when both are given
    status, doc = await infer(session, server, body([5], lane_param="interactive"))
    assert (status, doc["parameters"]["lane"]) == (200, "interactive")
    status, doc = await infer(session, server, body([5], lane_param="interactive"), "small")
    assert (status, doc["parameters"]["lane"]) == (200, "small")
    # default lane
    status, doc = await infer(session, server, body([5], rid="abc"))
    assert (status, doc["parameters"]["lane"], doc["id"]) == (200, "background", "abc")
    before = server.metric("batchpilot_requests_total", lane="_unknown", outcome="invalid")
    status, doc = await infer(session, server, body([5]), "nope")
    assert status == 400
    assert "unknown lane 'nope'" in doc["error"]
    assert server.metric("batchpilot_requests_total", lane="_unknown", outcome="invalid") == before + 1


def _bad_requests() -> list[tuple[str, dict[str, Any] | None, bytes | None, dict[str, str]]]:
    good = body([7])
    t = good["inputs"][0]

    def variant(**changes: Any) -> dict[str, Any]:
        return {"inputs": [{**t, **changes}]}

    return [
        ("wrong width", variant(shape=[1, 511], data=[0.0] * 511), None, {}),
        ("wrong datatype", variant(datatype="INT64"), None, {}),
        ("wrong name", variant(name="x"), None, {}),
        ("non-numeric", variant(data=["abc"] * 512), None, {}),
        ("bool data", variant(data=[True] * 512), None, {}),
        ("null data", variant(data=[None] * 512), None, {}),
        ("count mismatch", variant(shape=[2, 512]), None, {}),
        ("ragged", variant(data=[[0.0] * 512, [0.0]], shape=[2, 512]), None, {}),
        ("zero rows", variant(shape=[0, 512], data=[]), None, {}),
        ("shape not ints", variant(shape=["1", 512]), None, {}),
        ("no inputs", {"outputs": []}, None, {}),
        ("two inputs", {"inputs": [t, t]}, None, {}),
        ("unknown output", {**good, "outputs": [{"name": "logits"}]}, None, {}),
        ("not json", None, b"{not json", {}),
        ("json array", None, b"[1,2,3]", {}),
        ("binary size mismatch", variant(data=None, parameters={"binary_data_size": 8}), None, {}),
        ("bad binary header", None, json.dumps(good).encode(), {"Inference-Header-Content-Length": "x"}),
    ]


async def test_malformed_requests_get_400_and_do_not_harm_batch_mates(server: Server, session: Any) -> None:
    blocker = await start_blocker(session, server)
    first = await queue(session, server, "background", [500])
    invalid0 = server.metric("batchpilot_requests_total", lane="background", outcome="invalid")
    bad = _bad_requests()
    answers = await asyncio.gather(
        *(infer(session, server, doc, "background", raw=raw, headers=h) for _, doc, raw, h in bad)
    )
    # answered while the model is still blocked: validation happens before batching
    for (what, *_), (status, doc) in zip(bad, answers, strict=True):
        assert status == 400, (what, status, doc)
        assert doc["error"], what
    rest = [await queue(session, server, "background", [m]) for m in (501, 502)]
    server.open_gate()
    await blocker
    results = [await t for t in [first, *rest]]
    assert [s for s, _ in results] == [200, 200, 200]
    assert after_blocker(server) == [[500, 501, 502]]
    invalid = server.metric("batchpilot_requests_total", lane="background", outcome="invalid")
    assert invalid - invalid0 == len(bad)


async def test_model_exception_fails_only_its_batch(server: Server, session: Any) -> None:
    failed0 = server.metric("batchpilot_requests_total", lane="background", outcome="failed")
    blocker = await start_blocker(session, server)
    doomed = [await queue(session, server, "background", [m]) for m in (600, -12345, 601, 602)]
    fine = [await queue(session, server, "background", [m]) for m in (603, 604)]
    server.open_gate()
    assert (await blocker)[0] == 200
    for t in doomed:
        status, doc = await t
        assert status == 500
        assert "model execution failed" in doc["error"]
        assert "magic value -12345" in doc["error"]
    assert [(await t)[0] for t in fine] == [200, 200]
    assert after_blocker(server) == [[600, -12345, 601, 602], [603, 604]]
    assert server.metric("batchpilot_requests_total", lane="background", outcome="failed") - failed0 == 4
    status, _ = await infer(session, server, body([605]))
    assert status == 200


async def test_full_queue_answers_429_at_once(server: Server, session: Any) -> None:
    rejected0 = server.metric("batchpilot_requests_total", lane="small", outcome="rejected_full")
    blocker = await start_blocker(session, server)
    queued = [await queue(session, server, "small", [700 + i]) for i in range(3)]
    status, doc = await infer(session, server, body([703]), "small")  # answered while the model is blocked
    assert status == 429
    assert "queue is full" in doc["error"]
    assert doc["_headers"].get("Retry-After")
    server.open_gate()
    await blocker
    assert [(await t)[0] for t in queued] == [200, 200, 200]
    assert after_blocker(server) == [[700], [701], [702]]
    assert server.metric("batchpilot_requests_total", lane="small", outcome="rejected_full") - rejected0 == 1


async def test_request_past_timeout_gets_504_and_is_not_run(server: Server, session: Any) -> None:
    timed0 = server.metric("batchpilot_requests_total", lane="short", outcome="timed_out")
    ages0 = server.metric("batchpilot_queue_age_seconds_count", lane="short")
    blocker = await start_blocker(session, server)
    # Not sent with queue(): its check that a request is still waiting could come after the 1 s.
    late = [asyncio.create_task(infer(session, server, body([800 + i]), lane_header="short")) for i in range(2)]
    for t in late:  # the model is still blocked: these are answered by their 1 s timeout
        status, doc = await t
        assert status == 504
        assert "requestTimeout" in doc["error"]
    assert server.metric("batchpilot_queue_depth", lane="short") == 0
    server.open_gate()
    assert (await blocker)[0] == 200
    status, _ = await infer(session, server, body([802]), "short")
    assert status == 200
    assert after_blocker(server) == [[802]]  # 800 and 801 never ran
    assert server.metric("batchpilot_requests_total", lane="short", outcome="timed_out") - timed0 == 2
    assert server.metric("batchpilot_queue_age_seconds_count", lane="short") - ages0 == 3


async def test_binary_tensor_extension(server: Server, session: Any) -> None:
    values = [3.0] + [0.5] * 511
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "input",
                    "datatype": "FP32",
                    "shape": [1, 512],
                    "parameters": {"binary_data_size": 2048},
                }
            ],
            "outputs": [{"name": "output", "parameters": {"binary_data": True}}],
        }
    ).encode()
    raw = header + struct.pack("<512f", *values)
    async with session.post(
        f"{server.url}/v2/models/m/infer",
        data=raw,
        headers={"Inference-Header-Content-Length": str(len(header))},
    ) as resp:
        assert resp.status == 200
        n = int(resp.headers["Inference-Header-Content-Length"])
        payload = await resp.read()
    doc = json.loads(payload[:n])
    assert doc["outputs"][0]["shape"] == [1, 8]
    assert doc["outputs"][0]["parameters"]["binary_data_size"] == 32
    binary_out = struct.unpack("<8f", payload[n:])
    status, json_doc = await infer(
        session,
        server,
        {"inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 512], "data": values}]},
    )
    assert status == 200
    assert json_doc["outputs"][0]["data"] == pytest.approx(list(binary_out), rel=1e-6)


async def test_metrics_carry_lane_and_revision_and_consistent_counts(server: Server, session: Any) -> None:
    status, _ = await infer(session, server, body([7]), "interactive")  # at least one batch, whatever ran before
    assert status == 200
    samples = server.metrics()
    ours = [(n, lab, v) for n, lab, v in samples if n.startswith("batchpilot_")]
    names = {n for n, _, _ in ours}
    for required in (
        "batchpilot_request_latency_seconds_bucket",
        "batchpilot_queue_age_seconds_bucket",
        "batchpilot_model_execution_seconds_bucket",
        "batchpilot_batch_size_rows_bucket",
        "batchpilot_queue_depth",
        "batchpilot_requests_total",
        "batchpilot_runtime_info",
        "batchpilot_executor_busy_seconds_total",
        "batchpilot_event_loop_lag_seconds_bucket",
    ):
        assert required in names, required
    for n, lab, _ in ours:
        assert not {"track", "policy", "namespace"} & set(lab), (n, lab)
        assert lab.get("revision") == "rev-test", (n, lab)
        if n == "batchpilot_runtime_info":
            assert lab == {"revision": "rev-test", "model": "m", "device": "cpu", "dtype": "float32"}
        elif n.startswith("batchpilot_executor_busy_seconds"):
            assert lab == {"revision": "rev-test"}  # one executor for all lanes
        elif n.startswith("batchpilot_event_loop_lag_seconds"):
            assert set(lab) <= {"revision", "le"}  # one event loop for all lanes
        else:
            assert "lane" in lab, (n, lab)
    latency = "batchpilot_request_latency_seconds_bucket"
    buckets = [float(lab["le"]) for n, lab, _ in ours if n == latency and lab["lane"] == "background"]
    assert min(buckets) <= 0.0001 and max(b for b in buckets if b != float("inf")) >= 10
    assert 20 <= len(buckets) <= 30
    for ln in ("background", "interactive", "short", "small", "fill", "window"):

        def get(name: str, ln: str = ln, **lab: str) -> float:
            return sum(v for n, la, v in ours if n == name and la["lane"] == ln
                       and all(la.get(k) == x for k, x in lab.items()))  # fmt: skip

        answered = sum(get("batchpilot_requests_total", outcome=o) for o in ("ok", "timed_out", "failed"))
        assert get("batchpilot_request_latency_seconds_count") == answered, ln
        assert get("batchpilot_queue_age_seconds_count") == answered, ln
        assert get("batchpilot_batch_size_rows_count") == get("batchpilot_model_execution_seconds_count"), ln
    # The worker's busy time covers every forward pass (and the work around them).
    busy = next(v for n, _, v in ours if n == "batchpilot_executor_busy_seconds_total")
    forward = sum(v for n, _, v in ours if n == "batchpilot_model_execution_seconds_sum")
    assert forward > 0 and busy >= forward
    # The loop-lag probe samples from readiness on, whatever the traffic.
    lag_samples = next(v for n, _, v in ours if n == "batchpilot_event_loop_lag_seconds_count")
    assert lag_samples >= 1


async def test_sigterm_drains_every_accepted_request(tmp_path: Path) -> None:
    srv = Server(tmp_path, [lane("background", 4, "1ms", 50, "30s")])
    try:
        async with aiohttp.ClientSession() as session:
            blocker = await start_blocker(session, srv)
            queued = [await queue(session, srv, "background", [900 + i]) for i in range(8)]
            srv.terminate()
            await await_for(lambda: srv.get("/v2/health/ready")[0] == 503, what="readiness to turn 503")
            status, doc = await infer(session, srv, body([999]), "background")
            assert status == 503
            assert "shutting down" in doc["error"]
            assert srv.proc.poll() is None  # still draining: the model is blocked
            srv.open_gate()
            assert (await blocker)[0] == 200
            assert [(await t)[0] for t in queued] == [200] * 8
        assert srv.proc.wait(20) == 0
        assert sorted(m for b in srv.batches()[1:] for m in b) == list(range(900, 908))
    finally:
        srv.stop()
