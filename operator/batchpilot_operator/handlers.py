"""kopf wiring, kept thin: kopf's watch of the policies and watch-fed caches of their
children feed a work queue; its workers call controller.reconcile().

The loop (controller-runtime's shape, see ``control/``):

* kopf watches the BatchingPolicies; every event stores the body in the policy cache and,
  when it is news (a resourceVersion the cache has not seen), queues the policy's key.
* Informers list+watch Deployments, ConfigMaps and Services carrying ``batchpilot.dev/policy``
  into caches; a child's change queues the policy its label names. A child deleted by hand
  is re-created by the reconcile its DELETED event queues.
* Workers (``BATCHPILOT_WORKERS``, default 16) reconcile one policy each, reading the caches
  only (no GET or LIST), and queue it again after the planner's ``requeue_after``.
* A slow, jittered safety resync (``--resync`` seconds, default 600; 0 disables it) is the
  only periodic work; it reads the caches, so an idle policy costs no API request.

kopf stores nothing of its own on a BatchingPolicy apart from its finalizer (the resync
timer needs one): no ``last-handled-configuration`` annotation (only change-detecting
handlers use it, and there are none), no progress in status. A GitOps tool therefore sees
only the spec it applied; the operator's bookkeeping is in ``.status`` (which Argo CD does
not diff).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import copy
import dataclasses
import logging
import os
import random
import time
from typing import Any

import kopf

from batchpilot_operator import controller, opmetrics
from batchpilot_operator.control.cache import CHILD_KINDS, Caches, Key, child_informers
from batchpilot_operator.control.workqueue import WorkQueue
from batchpilot_operator.credentials import TokenFile, fresh_token
from batchpilot_operator.kube import USER_AGENT, Kube, TransientKubeError, api_client, kubeconfig_token_file
from batchpilot_operator.prom import PrometheusBackend
from batchpilot_operator.spec import API_VERSION, GROUP, KIND, PLURAL, VERSION

log = logging.getLogger("batchpilot")
RESYNC_SECONDS = float(os.environ.get("BATCHPILOT_RESYNC_SECONDS", "600"))
"""Safety resync of every policy (jittered by up to 10%); 0 disables it."""
WORKERS = int(os.environ.get("BATCHPILOT_WORKERS", "16"))
CACHE_SYNC_TIMEOUT = 120.0
ERROR_EVENT_EVERY = 300.0
"""A reconcile error that repeats unchanged is posted as an Event at most this often."""
IDENTITY = os.environ.get("BATCHPILOT_IDENTITY") or "batchpilot-operator"


def _observe_queue(depth: int, pending: int) -> None:
    opmetrics.QUEUE_DEPTH.set(depth)
    opmetrics.REQUEUES_PENDING.set(pending)


class Loop:
    """The operator's state: client, caches, informers, work queue, reconcile threads."""

    def __init__(self, kube: Kube, metrics: PrometheusBackend, caches: Caches, workers: int) -> None:
        self.kube = kube
        self.metrics = metrics
        self.caches = caches
        self.executor = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="reconcile")
        self.queue: WorkQueue[Key] = WorkQueue(self.reconcile, workers=workers, observe=_observe_queue)
        self.informers: list[Any] = []
        self.last_error: dict[Key, tuple[str, float]] = {}

    def emit(self, body: dict[str, Any], type_: str, reason: str, message: str) -> None:
        self.kube.post_event(body, type_, reason, message, IDENTITY)

    async def reconcile(self, key: Key) -> float | None:
        namespace, name = key
        body = self.caches.policies.get(namespace, name)
        if body is None:
            log.info("%s/%s: not in the policy cache (deleted?): dropped from the queue", namespace, name)
            self.queue.forget(key)
            return None
        loop = asyncio.get_running_loop()
        started = time.perf_counter()

        def run() -> controller.ReconcileResult:
            def emit(type_: str, reason: str, message: str) -> None:
                self.emit(body, type_, reason, message)

            return controller.reconcile(self.kube, self.metrics, body, emit, reader=self.caches)

        try:
            result = await loop.run_in_executor(self.executor, run)
        except TransientKubeError as exc:
            # A write raced another writer (or our cache was behind): the watch brings the
            # newer object and queues the policy again; retry soon regardless.
            opmetrics.RECONCILE_ERRORS.labels(namespace, name, "Conflict").inc()
            log.info("%s/%s: retrying shortly: %s", namespace, name, str(exc).splitlines()[0])
            return 1.0
        except Exception as exc:
            # Surfaced where on-call looks (an Event on the policy); the queue retries with backoff.
            opmetrics.RECONCILE_ERRORS.labels(namespace, name, type(exc).__name__).inc()
            message = f"{type(exc).__name__}: {exc}"[:1000]
            last = self.last_error.get(key)
            if last is None or last[0] != message or time.monotonic() - last[1] > ERROR_EVENT_EVERY:
                await loop.run_in_executor(self.executor, self.emit, body, "Warning", "ReconcileError", message)
                self.last_error[key] = (message, time.monotonic())
            raise
        finally:
            opmetrics.RECONCILE_SECONDS.inc(time.perf_counter() - started)
        self.last_error.pop(key, None)
        opmetrics.RECONCILES.labels(namespace, name, str(bool(result.writes)).lower()).inc()
        if result.writes:
            log.debug("%s/%s: reconcile wrote %d object(s)", namespace, name, result.writes)
        return result.requeue_after


@dataclasses.dataclass(frozen=True, kw_only=True)
class _IdentifiedConnection(kopf.ConnectionInfo):
    """kopf's connection, with a user agent naming this replica (audit logs tell them apart)."""

    user_agent: str = USER_AGENT

    def as_http_headers(self) -> dict[str, str]:
        return {**super().as_http_headers(), "User-Agent": self.user_agent}


SA_TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount/token"


def _in_cluster_token() -> str | None:
    """The pod's projected ServiceAccount token (kopf logs in with it in a cluster)."""
    return SA_TOKEN if os.environ.get("KUBERNETES_SERVICE_HOST") and os.path.isfile(SA_TOKEN) else None


_LOGIN_TOKEN: list[str] = []  # the token the last login handed to kopf (it logs in again only after a 401)


@kopf.on.login()
def login(logger: kopf.Logger, settings: kopf.OperatorSettings, **_: Any) -> kopf.ConnectionInfo | None:
    info = kopf.login_via_client(logger=logger, settings=settings)
    if info is None:
        return None
    fields = {f.name: getattr(info, f.name) for f in dataclasses.fields(info)}
    kubeconfig = os.environ.get("BATCHPILOT_KUBECONFIG")
    token_file = os.environ.get("BATCHPILOT_TOKEN_FILE") or (
        kubeconfig_token_file(kubeconfig) if kubeconfig else _in_cluster_token()
    )
    if token_file:
        # kopf logs in again after a 401: the file's current token is the one to use then. (Read
        # by TokenFile, which strips the line end: the client library keeps a trailing newline of
        # a kubeconfig tokenFile, and aiohttp refuses that header: found by drill 5.)
        # After a 401, wait for the file to hold another token rather than give kopf the refused
        # one again (it would give up and the operator exit: found by drill 5).
        token = fresh_token(TokenFile(token_file), _LOGIN_TOKEN[0] if _LOGIN_TOKEN else None)
        _LOGIN_TOKEN[:] = [token]
        fields.update(scheme="Bearer", token=token)
    elif isinstance(fields.get("token"), str):
        fields["token"] = fields["token"].strip()
    return _IdentifiedConnection(**fields, user_agent=f"{USER_AGENT}/{IDENTITY} kopf")


def _loop(memo: kopf.Memo) -> Loop:
    loop: Loop = memo["loop"]
    return loop


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    settings.persistence.finalizer = "batchpilot.dev/finalizer"
    settings.posting.level = logging.INFO
    settings.watching.server_timeout = 300
    started = time.monotonic()
    kubeconfig = os.environ.get("BATCHPILOT_KUBECONFIG") or None
    user_agent = f"{USER_AGENT}/{IDENTITY}"
    caches = Caches(KIND)
    aio = asyncio.get_running_loop()
    ready: list[Loop] = []

    def on_child_change(namespace: str, policy: str) -> None:  # informer threads
        # Before the queue exists nothing is lost: kopf's first listing queues every policy.
        if ready:
            aio.call_soon_threadsafe(ready[0].queue.add, (namespace, policy))

    namespaces = [ns for ns in os.environ.get("BATCHPILOT_NAMESPACES", "").split(",") if ns]
    # The informers' long watches get a connection pool of their own; they list while the
    # writing client below resolves its API resources.
    informers = child_informers(caches, api_client(kubeconfig, user_agent), namespaces, on_child_change)
    for informer in informers:
        informer.start()
    kube = await asyncio.to_thread(_connect, kubeconfig, user_agent)
    kube.observer = caches
    metrics = PrometheusBackend(
        os.environ.get("BATCHPILOT_PROMETHEUS_URL", "http://prometheus-operated.monitoring:9090"),
        timeout=float(os.environ.get("BATCHPILOT_PROMETHEUS_TIMEOUT", "5")),
        bearer_token_file=os.environ.get("BATCHPILOT_PROMETHEUS_BEARER_TOKEN_FILE") or None,
    )
    state = memo["loop"] = Loop(kube, metrics, caches, WORKERS)
    state.informers = informers
    ready.append(state)
    # Like controller-runtime, reconcile only once the caches hold what the API holds:
    # a reconcile on an empty cache would take existing children for missing ones.
    deadline = time.monotonic() + CACHE_SYNC_TIMEOUT
    for informer in state.informers:
        left = max(0.0, deadline - time.monotonic())
        if not await asyncio.to_thread(informer.synced.wait, left):
            raise kopf.PermanentError(f"cache of {informer.name} not synced after {CACHE_SYNC_TIMEOUT:.0f}s")
    log.info(
        "caches synced in %.1fs: %s; %d reconcile workers; safety resync %s",
        time.monotonic() - started,
        ", ".join(f"{kind} {len(cache)}" for kind, cache in caches.by_kind.items() if kind != KIND),
        WORKERS,
        f"every {RESYNC_SECONDS:g}s" if RESYNC_SECONDS > 0 else "off",
    )
    state.queue.start()


def _connect(kubeconfig: str | None, user_agent: str) -> Kube:
    kube = Kube.connect(kubeconfig, user_agent)
    for kind, api_version in (*CHILD_KINDS.items(), ("Event", "v1"), (KIND, API_VERSION)):
        kube.resource(api_version, kind)  # discovery now, not in the first reconcile
    return kube


@kopf.on.cleanup()
async def shutdown(memo: kopf.Memo, **_: Any) -> None:
    state = memo.get("loop")
    if state is None:
        return
    for informer in state.informers:
        informer.stop()
    await state.queue.stop()
    # Reconciles already running finish their writes before the Lease is released.
    await asyncio.to_thread(state.executor.shutdown, wait=True, cancel_futures=True)
    log.info("reconcile loop stopped")


@kopf.on.event(GROUP, VERSION, PLURAL)
async def on_event(event: kopf.RawEvent, memo: kopf.Memo, type: str | None, **_: Any) -> None:
    state = _loop(memo)
    obj: dict[str, Any] = copy.deepcopy(dict(event["object"]))
    obj.setdefault("kind", KIND)
    meta = obj["metadata"]
    key: Key = (meta.get("namespace") or "", meta["name"])
    if type == "DELETED":
        log.info("%s/%s: DELETED event", *key)
        state.caches.policies.observe("DELETED", obj)
        state.queue.forget(key)
        state.last_error.pop(key, None)
        opmetrics.forget(*key)
        return
    if state.caches.policies.observe(type or "ADDED", obj):
        # A spec change not yet acted on jumps the routine work (resyncs, a take-over's listing).
        pending = meta.get("generation") != (obj.get("status") or {}).get("observedGeneration")
        state.queue.add(key, urgent=pending)


@kopf.timer(
    GROUP,
    VERSION,
    PLURAL,
    interval=RESYNC_SECONDS if RESYNC_SECONDS > 0 else 2.0**30,
    initial_delay=RESYNC_SECONDS if RESYNC_SECONDS > 0 else 2.0**30,
    sharp=False,
)
async def resync(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    if RESYNC_SECONDS <= 0:
        return
    with contextlib.suppress(KeyError):
        key: Key = (body.metadata.namespace or "", body.metadata.name or "")
        _loop(memo).queue.add_after(key, random.uniform(0, RESYNC_SECONDS * 0.1))
