"""Pure logic of the controller loop: the work queue's coalescing, serialization, fairness
and requeues (on an asyncio loop, no API), the cache's stale-read rules, and what a
Deployment's status says is ready."""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

import pytest

from batchpilot_operator.control.cache import Backoff, ObjectCache
from batchpilot_operator.control.leader import LeaseTiming
from batchpilot_operator.control.workqueue import WorkQueue
from batchpilot_operator.controller import new_ready_replicas

# --------------------------------------------------------------------------- work queue


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_events_for_a_key_coalesce_and_a_key_never_runs_twice_at_once() -> None:
    async def main() -> tuple[list[str], int]:
        calls: list[str] = []
        running: set[str] = set()
        overlap = 0
        gate, second = asyncio.Event(), asyncio.Event()

        async def reconcile(key: str) -> float | None:
            nonlocal overlap
            if key in running:
                overlap += 1
            running.add(key)
            calls.append(key)
            if len(calls) == 2:
                second.set()
            await gate.wait()
            running.discard(key)
            return None

        q: WorkQueue[str] = WorkQueue(reconcile, workers=4)
        q.start()
        for _ in range(50):  # a burst before the first reconcile starts: one run
            q.add("a")
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        for _ in range(50):  # a burst while it runs: exactly one more run afterwards
            q.add("a")
        gate.set()
        await second.wait()
        for _ in range(10):
            await asyncio.sleep(0)
        await q.stop()
        return calls, overlap

    calls, overlap = run(main())
    assert calls == ["a", "a"]
    assert overlap == 0


def test_a_slow_key_holds_one_worker_not_the_others() -> None:
    async def main() -> list[str]:
        done: list[str] = []
        slow, others, all_done = asyncio.Event(), asyncio.Event(), asyncio.Event()

        async def reconcile(key: str) -> float | None:
            if key == "slow":
                await slow.wait()
            done.append(key)
            if len(done) == 20:
                others.set()
            if len(done) == 21:
                all_done.set()
            return None

        q: WorkQueue[str] = WorkQueue(reconcile, workers=2)
        q.start()
        q.add("slow")
        for i in range(20):
            q.add(f"k{i}")
        await others.wait()
        slow.set()
        await all_done.wait()
        await q.stop()
        return done

    done = run(main())
    assert done[:20] == [f"k{i}" for i in range(20)]  # first queued, first served
    assert done[-1] == "slow"


def test_urgent_keys_go_before_routine_work() -> None:
    async def main() -> list[str]:
        done: list[str] = []
        finished = asyncio.Event()

        async def reconcile(key: str) -> float | None:
            done.append(key)
            if len(done) == 5:
                finished.set()
            return None

        q: WorkQueue[str] = WorkQueue(reconcile, workers=1)
        for i in range(4):
            q.add(f"k{i}")
        q.add("change", urgent=True)
        q.add("k3", urgent=True)  # already queued: moves ahead
        q.start()
        await finished.wait()
        await q.stop()
        return done

    assert run(main()) == ["change", "k3", "k0", "k1", "k2"]


def test_requeue_after_keeps_the_earliest_due_time() -> None:
    async def main() -> list[tuple[str, float]]:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        seen: list[tuple[str, float]] = []
        ran = asyncio.Event()

        async def reconcile(key: str) -> float | None:
            seen.append((key, loop.time() - t0))
            ran.set()
            return None

        q: WorkQueue[str] = WorkQueue(reconcile, workers=1)
        q.start()
        q.add_after("a", 0.2)
        q.add_after("a", 5.0)  # later: ignored
        q.add_after("a", 0.05)  # earlier: replaces
        assert q.pending_requeues == 1
        await ran.wait()
        await asyncio.sleep(0.3)  # the replaced 0.2 s requeue must not run as well
        await q.stop()
        return seen

    seen = run(main())
    assert len(seen) == 1 and seen[0][0] == "a" and 0.04 <= seen[0][1] < 0.2


def test_reconcile_result_requeues_and_failures_back_off() -> None:
    async def main() -> list[float]:
        loop = asyncio.get_running_loop()
        times: list[float] = []
        third = asyncio.Event()

        async def reconcile(key: str) -> float | None:
            times.append(loop.time())
            if len(times) == 3:
                third.set()
            if len(times) < 3:
                raise RuntimeError("transient")
            return None

        q: WorkQueue[str] = WorkQueue(reconcile, workers=1, backoff_base=0.05)
        q.start()
        q.add("a")
        await third.wait()
        await q.stop()
        return [b - a for a, b in itertools.pairwise(times)]

    gaps = run(main())
    assert gaps[0] >= 0.045 and gaps[1] >= 0.095  # 0.05 s, then 0.1 s


def test_forget_drops_a_pending_requeue() -> None:
    async def main() -> int:
        calls = 0

        async def reconcile(key: str) -> float | None:
            nonlocal calls
            calls += 1
            return None

        q: WorkQueue[str] = WorkQueue(reconcile, workers=1)
        q.start()
        q.add_after("a", 0.05)
        q.forget("a")
        await asyncio.sleep(0.15)
        await q.stop()
        return calls

    assert run(main()) == 0


def test_workers_must_be_positive() -> None:
    with pytest.raises(ValueError, match="workers must be at least 1"):
        WorkQueue(lambda k: asyncio.sleep(0, None), workers=0)


# --------------------------------------------------------------------------- cache


def obj(name: str, rv: int, uid: str = "u1", policy: str = "p", **extra: Any) -> dict[str, Any]:
    meta = {"name": name, "namespace": "ns", "resourceVersion": str(rv), "uid": uid}
    meta["labels"] = {"batchpilot.dev/policy": policy}
    return {"kind": "Deployment", "metadata": meta, **extra}


def test_cache_never_goes_back_behind_a_write_of_ours() -> None:
    cache = ObjectCache("Deployment")
    assert cache.observe("ADDED", obj("d", 10)) is True
    cache.wrote(obj("d", 12, spec={"replicas": 2}))
    # the watch still delivers the older state, then our own write: neither is news
    assert cache.observe("MODIFIED", obj("d", 11)) is False
    assert cache.observe("MODIFIED", obj("d", 12, spec={"replicas": 2})) is False
    assert cache.get("ns", "d")["spec"] == {"replicas": 2}  # type: ignore[index]
    # someone else's later change is
    assert cache.observe("MODIFIED", obj("d", 13, spec={"replicas": 3})) is True
    assert [o["metadata"]["name"] for o in cache.list_owned("ns", "p")] == ["d"]


def test_cache_forgets_what_we_deleted_until_the_object_comes_back() -> None:
    cache = ObjectCache("Deployment")
    cache.observe("ADDED", obj("d", 10, uid="old"))
    cache.deleted("ns", "d")
    assert cache.get("ns", "d") is None
    assert cache.observe("MODIFIED", obj("d", 11, uid="old")) is False  # from before our delete
    assert cache.get("ns", "d") is None
    assert cache.observe("ADDED", obj("d", 20, uid="new")) is True  # re-created
    assert cache.observe("DELETED", obj("d", 21, uid="new")) is True
    assert cache.list_owned("ns", "p") == []


def test_relist_keeps_writes_newer_than_the_list_and_drops_the_rest() -> None:
    cache = ObjectCache("Deployment")
    cache.observe("ADDED", obj("gone", 5, policy="a"))
    cache.wrote(obj("fresh", 30, policy="b"))
    changed = cache.replace([obj("kept", 7, policy="c")], list_version=20)
    assert cache.get("ns", "gone") is None
    assert cache.get("ns", "fresh") is not None
    assert changed == {("ns", "a"), ("ns", "c")}


def test_watch_backoff_doubles_and_starts_over_after_a_healthy_spell() -> None:
    now = [0.0]
    backoff = Backoff(first=0.5, cap=30.0, reset_after=120.0, clock=lambda: now[0])
    delays = []
    for _ in range(8):  # errors in a row: each retry fails as soon as it starts
        delays.append(backoff.failed())
        now[0] += delays[-1]
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    now[0] += 60.0  # a watch healthy for a minute, then an error: still backing off
    assert backoff.failed() == 30.0
    now[0] += 30.0 + 120.0  # healthy for two minutes after that retry: the next error starts over
    assert [backoff.failed(), backoff.failed()] == [0.5, 1.0]
    backoff.reset()  # a successful LIST starts over too
    assert backoff.failed() == 0.5


def test_label_change_moves_the_object_between_policies() -> None:
    cache = ObjectCache("Deployment")
    cache.observe("ADDED", obj("d", 1, policy="a"))
    cache.observe("MODIFIED", obj("d", 2, policy="b"))
    assert cache.list_owned("ns", "a") == [] and len(cache.list_owned("ns", "b")) == 1


def test_lease_timing_must_be_ordered() -> None:
    LeaseTiming()
    with pytest.raises(ValueError, match="lease duration > renew deadline > retry period"):
        LeaseTiming(lease_duration=10, renew_deadline=10, retry_period=2)


# --------------------------------------------------------------------------- deployments


@pytest.mark.parametrize(
    ("replicas", "updated", "ready", "expected"),
    [
        (2, 2, 2, 2),  # done: every pod new and ready
        (3, 1, 2, 0),  # the first surge pod not ready; the 2 ready ones are old
        (3, 1, 3, 1),
        (2, 1, 2, 1),  # one old pod gone, one left
        (3, 2, 2, 1),  # the second surge pod not ready: min(updated, ready) said 2
        (3, 2, 3, 2),  # every new pod ready, the old one not gone yet
        (2, 2, 1, 1),
        (4, 2, 2, 0),  # maxSurge 100%: 2 old ready, 2 new not
        (0, 0, 0, 0),
    ],
)
def test_ready_counts_only_pods_surely_on_the_new_template(
    replicas: int, updated: int, ready: int, expected: int
) -> None:
    status = {"replicas": replicas, "updatedReplicas": updated, "readyReplicas": ready}
    assert new_ready_replicas(status) == expected
