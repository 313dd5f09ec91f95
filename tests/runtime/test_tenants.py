"""Tenants in the runtime's metrics: a real server process, real HTTP (issue 12).

A request's tenant is the configured header, else ``parameters.tenant``; a declared name keeps
its own ``tenant`` label, any other name counts as ``other`` and none as ``default``. Rejected
requests (4xx) are counted per tenant with the status code they got.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from bp_rt_harness import Server, body, infer, lane
from pydantic import ValidationError

from batchpilot_runtime.config import TenantsConfig

LANES = [lane("small", 4, "1ms", 50, "20s")]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with Server(
        tmp_path_factory.mktemp("rt"), LANES, extra={"tenants": {"names": ["a", "b"], "header": "X-Client"}}
    ) as srv:
        yield srv


def with_tenant(markers: list[float], tenant: str) -> dict[str, Any]:
    doc = body(markers)
    doc["parameters"] = {"tenant": tenant}
    return doc


@pytest.mark.runtime_server
async def test_tenant_from_header_or_parameters_bounded_by_the_declared_list(server: Server, session: Any) -> None:
    def served(tenant: str) -> float:
        return server.metric("batchpilot_requests_total", tenant=tenant, outcome="ok", code="200")

    before = {t: served(t) for t in ("a", "b", "other", "default")}
    sent = [
        await infer(session, server, body([1]), headers={"X-Client": "a"}),
        await infer(session, server, with_tenant([2], "b"), headers={}),
        await infer(session, server, with_tenant([3], "b"), headers={"X-Client": "a"}),  # the header wins
        await infer(session, server, body([4]), headers={"X-Client": "mallory"}),  # undeclared
        await infer(session, server, with_tenant([5], "eve")),  # undeclared
        await infer(session, server, body([6])),  # no tenant
    ]
    assert [status for status, _ in sent] == [200] * 6
    assert {t: served(t) - before[t] for t in before} == {"a": 2, "b": 1, "other": 2, "default": 1}
    # The latency histogram is sliced the same way; no label value beyond the declared ones.
    tenants = {lab["tenant"] for n, lab, _ in server.metrics() if n.startswith("batchpilot_request_latency")}
    assert tenants <= {"a", "b", "other", "default"} and {"a", "b", "other"} <= tenants
    assert server.metric("batchpilot_queue_age_seconds_count", tenant="a") >= 2


@pytest.mark.runtime_server
async def test_rejected_requests_counted_per_tenant_with_their_status_code(server: Server, session: Any) -> None:
    def rejected(tenant: str, code: str) -> float:
        return server.metric("batchpilot_requests_total", lane="small", tenant=tenant, outcome="invalid", code=code)

    b0, a0 = rejected("b", "400"), rejected("a", "400")
    status, doc = await infer(session, server, with_tenant([1, 2, 3, 4, 5, 6], "b"))  # 6 rows > maxBatchSize 4
    assert status == 400 and "maxBatchSize 4" in doc["error"]
    status, _ = await infer(session, server, {"inputs": "nope"}, headers={"X-Client": "a"})  # malformed
    assert status == 400
    assert (rejected("b", "400") - b0, rejected("a", "400") - a0) == (1, 1)
    unknown0 = server.metric("batchpilot_requests_total", tenant="a", outcome="invalid", code="404")
    async with session.post(f"{server.url}/v2/models/nope/infer", json=body([1]), headers={"X-Client": "a"}) as r:
        assert r.status == 404
    assert server.metric("batchpilot_requests_total", tenant="a", outcome="invalid", code="404") == unknown0 + 1


@pytest.mark.parametrize(
    ("names", "message"),
    [
        (["other"], "reserved"),
        (["default"], "reserved"),
        (["a", "a"], "unique"),
        (["Bad_Name"], "must match"),
        ([f"t{i}" for i in range(9)], "at most 8"),
    ],
)
def test_tenant_list_is_bounded_and_names_are_checked(names: list[str], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        TenantsConfig(names=names)


def test_tenant_label_of_a_request() -> None:
    cfg = TenantsConfig(names=["a", "b"])
    assert [cfg.label(n) for n in ("a", "b", "c", "", None, "default")] == [
        "a",
        "b",
        "other",
        "default",
        "default",
        "default",
    ]
    assert cfg.header == "X-Batchpilot-Tenant" and cfg.labels == ["a", "b", "default", "other"]
