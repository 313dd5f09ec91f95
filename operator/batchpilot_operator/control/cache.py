"""Watch-fed, in-memory caches of the policies' children (an informer, in client-go's words).

An :class:`Informer` lists one kind (Deployments, ConfigMaps or Services) carrying the
``batchpilot.dev/policy`` label, server-side filtered, then watches it from the list's
resourceVersion, in a thread of its own; every change it sees lands in an
:class:`ObjectCache` and, when it is news, is handed on as the owning policy's key.
Reconciles read children from the cache only: no GET or LIST per reconcile.

Stale reads. A reconcile that wrote an object must not write it again because the watch has
not delivered the write yet. The writer therefore records what the apiserver answered
(:meth:`ObjectCache.wrote`, :meth:`ObjectCache.deleted`): the cache holds at least that
resourceVersion, and an older event arriving later is ignored (resourceVersions of one etcd
are increasing integers; a non-integer one is taken as news). Our own write coming back
through the watch carries the resourceVersion already held, so it is no news and triggers
no reconcile.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

from kubernetes import client
from kubernetes.watch.watch import iter_resp_lines

from batchpilot_operator.children import LABEL_POLICY, Manifest

log = logging.getLogger(__name__)

# The client imports its API classes (and their pydantic models) on first use: about a second
# of CPU. Pay it at import, not in the seconds after a standby has taken over.
_APIS = (client.AppsV1Api, client.CoreV1Api)

Key = tuple[str, str]
"""(namespace, name)."""

OnChange = Callable[[str, str], None]
"""(namespace, policy) -> None: called from the informer's thread when a child changed."""


def resource_version(obj: Manifest) -> int | None:
    try:
        return int(obj["metadata"]["resourceVersion"])
    except (KeyError, TypeError, ValueError):
        return None


def _key(obj: Manifest) -> Key:
    meta = obj["metadata"]
    return meta.get("namespace") or "", meta["name"]


def _policy(obj: Manifest) -> str | None:
    labels = obj["metadata"].get("labels") or {}
    value = labels.get(LABEL_POLICY)
    return value if isinstance(value, str) else None


class ObjectCache:
    """Objects of one kind by (namespace, name), indexed by their policy label. Thread-safe."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._lock = threading.Lock()
        self._objects: dict[Key, Manifest] = {}
        self._by_policy: dict[Key, set[str]] = defaultdict(set)
        self._tombstones: dict[Key, str | None] = {}
        """Objects this process deleted, by uid, until the watch confirms it: events of the same
        uid that are not the deletion are older news and ignored."""

    # ---- reads -------------------------------------------------------------------------
    def get(self, namespace: str, name: str) -> Manifest | None:
        with self._lock:
            return self._objects.get((namespace, name))

    def list_owned(self, namespace: str, policy: str) -> list[Manifest]:
        with self._lock:
            names = sorted(self._by_policy.get((namespace, policy), ()))
            return [self._objects[(namespace, n)] for n in names]

    def __len__(self) -> int:
        with self._lock:
            return len(self._objects)

    # ---- writes (watch events, and this process's own writes) --------------------------
    def observe(self, event_type: str, obj: Manifest) -> bool:
        """Apply one watch event; True when it told the cache something it did not know."""
        key = _key(obj)
        with self._lock:
            if event_type == "DELETED":
                self._tombstones.pop(key, None)
                return self._remove(key)
            uid = obj["metadata"].get("uid")
            if key in self._tombstones:
                if self._tombstones[key] == uid:
                    return False  # an event from before our own delete
                del self._tombstones[key]
            return self._put(key, obj)

    def wrote(self, obj: Manifest) -> None:
        """Record the apiserver's answer to a write of ours (the object as it now is)."""
        key = _key(obj)
        with self._lock:
            self._tombstones.pop(key, None)
            self._put(key, obj)

    def deleted(self, namespace: str, name: str) -> None:
        """Record that we deleted an object (its DELETED event may come later)."""
        key = (namespace, name)
        with self._lock:
            current = self._objects.get(key)
            self._tombstones[key] = current["metadata"].get("uid") if current else None
            self._remove(key)

    def replace(self, objects: Iterable[Manifest], list_version: int | None) -> set[Key]:
        """Apply a fresh LIST; returns the policies whose children changed."""
        changed: set[Key] = set()
        with self._lock:
            seen: set[Key] = set()
            for obj in objects:
                key = _key(obj)
                seen.add(key)
                if key in self._tombstones and self._tombstones[key] == obj["metadata"].get("uid"):
                    continue
                self._tombstones.pop(key, None)
                if self._put(key, obj) and (policy := _policy(obj)):
                    changed.add((key[0], policy))
            for key in list(self._objects):
                if key in seen:
                    continue
                rv = resource_version(self._objects[key])
                if list_version is not None and rv is not None and rv > list_version:
                    continue  # written by us after the list was taken
                policy = _policy(self._objects[key])
                self._remove(key)
                if policy:
                    changed.add((key[0], policy))
        return changed

    def _put(self, key: Key, obj: Manifest) -> bool:
        old = self._objects.get(key)
        if old is not None:
            old_rv, new_rv = resource_version(old), resource_version(obj)
            if old_rv is not None and new_rv is not None and new_rv <= old_rv:
                return False
            old_policy = _policy(old)
            if old_policy:
                self._by_policy[(key[0], old_policy)].discard(key[1])
        self._objects[key] = obj
        policy = _policy(obj)
        if policy:
            self._by_policy[(key[0], policy)].add(key[1])
        return True

    def _remove(self, key: Key) -> bool:
        old = self._objects.pop(key, None)
        if old is None:
            return False
        policy = _policy(old)
        if policy:
            names = self._by_policy.get((key[0], policy))
            if names is not None:
                names.discard(key[1])
                if not names:
                    del self._by_policy[(key[0], policy)]
        return True


class Backoff:
    """Retry delays that double from ``first`` up to ``cap``, and start over once the work has
    run ``reset_after`` seconds without failing (client-go's reflector: 800 ms to 30 s, reset
    after 2 minutes). Without the reset, a watch that failed a few times early keeps waiting
    the cap after every later error, however long it was healthy in between."""

    def __init__(
        self,
        first: float = 0.5,
        cap: float = 30.0,
        reset_after: float = 120.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.first, self.cap, self.reset_after, self.clock = first, cap, reset_after, clock
        self._next = first
        self._healthy_since: float | None = None

    def failed(self) -> float:
        """The delay before the next try, after a failure now."""
        now = self.clock()
        if self._healthy_since is not None and now - self._healthy_since >= self.reset_after:
            self._next = self.first
        delay = self._next
        self._next = min(self._next * 2, self.cap)
        self._healthy_since = now + delay  # the next try starts then
        return delay

    def reset(self) -> None:
        self._next = self.first


class _Gone(Exception):
    """The watch's resourceVersion is too old (410): list again."""


ListFn = Callable[..., Any]
"""A kubernetes-client list function (namespace already bound), called with
``_preload_content=False``."""


class Informer:
    """LIST then WATCH one kind into an :class:`ObjectCache`, in a daemon thread."""

    def __init__(
        self,
        cache: ObjectCache,
        list_fn: ListFn,
        label_selector: str,
        on_change: OnChange,
        *,
        name: str,
        watch_timeout: float = 300.0,
        page_size: int = 500,
    ) -> None:
        self.cache = cache
        self.list_fn = list_fn
        self.label_selector = label_selector
        self.on_change = on_change
        self.name = name
        self.watch_timeout = watch_timeout
        self.page_size = page_size
        self.synced = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"informer-{name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop after the next event or watch timeout (the thread is a daemon: it never holds
        the process up, and closing its socket from here could block on TLS)."""
        self._stop.set()

    def _run(self) -> None:
        backoff = Backoff()
        version: int | None = None
        while not self._stop.is_set():
            try:
                if version is None:
                    version = self._list()
                    self.synced.set()
                    backoff.reset()
                version = self._watch(version)
            except _Gone:
                log.info("%s: watch expired, listing again", self.name)
                version = None
            except Exception as exc:  # the informer must outlive API trouble
                if self._stop.is_set():
                    return
                delay = backoff.failed()
                log.warning("%s: %s; retrying in %.1fs", self.name, exc, delay)
                self._stop.wait(delay)
                version = None if not self.synced.is_set() else version

    def _list(self) -> int | None:
        items: list[Manifest] = []
        cont: str | None = None
        list_version: str | None = None
        while True:
            kwargs: dict[str, Any] = {"label_selector": self.label_selector, "limit": self.page_size}
            if cont:
                kwargs["_continue"] = cont
            resp = self.list_fn(_preload_content=False, **kwargs)
            data = json.loads(resp.data)
            items.extend(data.get("items") or [])
            meta = data.get("metadata") or {}
            list_version = meta.get("resourceVersion")
            cont = meta.get("continue")
            if not cont:
                break
        kind = self.cache.kind
        for item in items:  # LIST items carry neither kind nor apiVersion
            item.setdefault("kind", kind)
        version = int(list_version) if list_version and list_version.isdigit() else None
        for namespace, policy in self.cache.replace(items, version):
            self.on_change(namespace, policy)
        return version

    def _watch(self, version: int | None) -> int | None:
        timeout = int(self.watch_timeout * random.uniform(0.9, 1.0))
        kwargs: dict[str, Any] = {
            "label_selector": self.label_selector,
            "watch": True,
            "allow_watch_bookmarks": True,
            "timeout_seconds": timeout,
            "_request_timeout": timeout + 30,
        }
        if version is not None:
            kwargs["resource_version"] = str(version)
        started = time.monotonic()
        resp = self.list_fn(_preload_content=False, **kwargs)
        try:
            for line in iter_resp_lines(resp):  # type: ignore[no-untyped-call]
                if self._stop.is_set():
                    return version
                if not line:
                    continue
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    if obj.get("code") == 410:
                        raise _Gone()
                    raise RuntimeError(f"watch error: {obj.get('message')}")
                rv = resource_version(obj)
                if rv is not None:
                    version = rv
                if kind == "BOOKMARK":
                    continue
                if self.cache.observe(kind, obj):
                    policy = _policy(obj)
                    if policy:
                        self.on_change(obj["metadata"].get("namespace") or "", policy)
        finally:
            resp.release_conn()
        if time.monotonic() - started < 1.0 and not self._stop.is_set():
            self._stop.wait(1.0)  # a watch that ends at once must not spin
        return version


CHILD_KINDS: dict[str, str] = {"Deployment": "apps/v1", "ConfigMap": "v1", "Service": "v1"}


class Caches:
    """The operator's caches: the policies (fed by kopf's watch of them) and their children
    (fed by :class:`Informer`). Serves reconciles as their reader
    (``controller.ChildReader``) and records their writes (``kube.WriteObserver``)."""

    def __init__(self, policy_kind: str) -> None:
        self.policy_kind = policy_kind
        self.by_kind: dict[str, ObjectCache] = {kind: ObjectCache(kind) for kind in (*CHILD_KINDS, policy_kind)}

    @property
    def policies(self) -> ObjectCache:
        return self.by_kind[self.policy_kind]

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> Manifest | None:
        return self.by_kind[kind].get(namespace, name)

    def list_owned(self, api_version: str, kind: str, namespace: str, policy: str) -> list[Manifest]:
        return self.by_kind[kind].list_owned(namespace, policy)

    def wrote(self, obj: Manifest) -> None:
        cache = self.by_kind.get(obj.get("kind", ""))
        if cache is not None:
            cache.wrote(obj)

    def deleted(self, api_version: str, kind: str, namespace: str, name: str) -> None:
        cache = self.by_kind.get(kind)
        if cache is not None:
            cache.deleted(namespace, name)


def child_informers(
    caches: Caches, api: Any, namespaces: list[str], on_change: OnChange, *, watch_timeout: float = 300.0
) -> list[Informer]:
    """One informer per child kind and namespace (one per kind cluster-wide when
    ``namespaces`` is empty), selecting objects that carry the policy label."""
    from functools import partial

    apps, core = client.AppsV1Api(api), client.CoreV1Api(api)
    namespaced: dict[str, ListFn] = {
        "Deployment": apps.list_namespaced_deployment,
        "ConfigMap": core.list_namespaced_config_map,
        "Service": core.list_namespaced_service,
    }
    cluster: dict[str, ListFn] = {
        "Deployment": apps.list_deployment_for_all_namespaces,
        "ConfigMap": core.list_config_map_for_all_namespaces,
        "Service": core.list_service_for_all_namespaces,
    }
    informers = []
    for kind in CHILD_KINDS:
        scopes: list[tuple[str, ListFn]] = (
            [(f"{kind}/{ns}", partial(namespaced[kind], ns)) for ns in namespaces]
            if namespaces
            else [(kind, cluster[kind])]
        )
        for name, fn in scopes:
            informers.append(
                Informer(caches.by_kind[kind], fn, LABEL_POLICY, on_change, name=name, watch_timeout=watch_timeout)
            )
    return informers
