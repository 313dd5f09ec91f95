"""Leader election with a ``coordination.k8s.io/v1`` Lease, as client-go does it.

Timing follows controller-runtime's defaults: a 15 s lease, a 10 s renew deadline, a 2 s
retry period. A candidate polls the Lease every retry period and takes it when it is free
(no holder, as a leader leaves it on a clean stop) or when its record has not changed for a
whole lease duration *as this process measured it* (its own monotonic clock, not the
holder's timestamps, so clock skew cannot hand the lease to two replicas). The leader renews
every retry period; when it cannot renew for the renew deadline, or finds another holder, it
has lost and the process must stop at once (:class:`LeaderElector` calls ``on_lost``).

Only the Lease is touched here: a standby reads one object every retry period and writes
nothing else (the operator starts its watches and reconciles only once it leads).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LeaseTiming:
    lease_duration: float = 15.0
    renew_deadline: float = 10.0
    retry_period: float = 2.0

    def __post_init__(self) -> None:
        if not (self.lease_duration > self.renew_deadline > self.retry_period > 0):
            raise ValueError(
                "leader election needs lease duration > renew deadline > retry period > 0, got "
                f"{self.lease_duration}s / {self.renew_deadline}s / {self.retry_period}s"
            )


def _now() -> datetime:
    return datetime.now(UTC)


class LeaderElector:
    def __init__(
        self,
        api: client.ApiClient,
        namespace: str,
        name: str,
        identity: str,
        timing: LeaseTiming = LeaseTiming(),
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.coordination = client.CoordinationV1Api(api)
        self.namespace, self.name, self.identity, self.timing = namespace, name, identity, timing
        self.monotonic = monotonic
        self._lease: Any = None  # the V1Lease as last read or written
        self._observed_record: tuple[Any, ...] | None = None
        self._observed_at = 0.0
        self._renewed_at = 0.0
        self.leading = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- one attempt (client-go's tryAcquireOrRenew) --------------------------------------
    def try_acquire_or_renew(self) -> bool:
        now = _now()
        # Fast path: we hold it and know its resourceVersion; renew without a read.
        if self.leading and self._lease is not None and self._update(self._lease, acquired=False, now=now):
            return True
        try:
            lease = self.coordination.read_namespaced_lease(self.name, self.namespace)
        except ApiException as exc:
            if exc.status != 404:
                log.warning("reading Lease %s/%s: %s", self.namespace, self.name, exc.reason)
                return False
            return self._create(now)
        spec = lease.spec or client.V1LeaseSpec()
        lease.spec = spec
        record = (spec.holder_identity, spec.renew_time, spec.lease_duration_seconds, spec.lease_transitions)
        if record != self._observed_record:
            self._observed_record, self._observed_at = record, self.monotonic()
        holder = spec.holder_identity or ""
        duration = spec.lease_duration_seconds or self.timing.lease_duration
        if holder and holder != self.identity and self._observed_at + duration > self.monotonic():
            if self.leading:
                log.error("Lease %s/%s is now held by %s", self.namespace, self.name, holder)
                self.leading = False
            return False
        return self._update(lease, acquired=holder != self.identity, now=now)

    def _create(self, now: datetime) -> bool:
        body = client.V1Lease(
            metadata=client.V1ObjectMeta(name=self.name, namespace=self.namespace),
            spec=client.V1LeaseSpec(
                holder_identity=self.identity,
                lease_duration_seconds=int(self.timing.lease_duration),
                acquire_time=now,
                renew_time=now,
                lease_transitions=0,
            ),
        )
        try:
            self._lease = self.coordination.create_namespaced_lease(self.namespace, body)
        except ApiException as exc:
            log.info("creating Lease %s/%s: %s", self.namespace, self.name, exc.reason)
            return False
        self._took()
        return True

    def _update(self, lease: Any, *, acquired: bool, now: datetime) -> bool:
        spec = lease.spec
        if acquired:
            spec.acquire_time = now
            spec.lease_transitions = (spec.lease_transitions or 0) + (1 if spec.holder_identity else 0)
        spec.holder_identity = self.identity
        spec.lease_duration_seconds = int(self.timing.lease_duration)
        spec.renew_time = now
        try:
            self._lease = self.coordination.replace_namespaced_lease(self.name, self.namespace, lease)
        except ApiException as exc:
            self._lease = None
            log.info("updating Lease %s/%s: %s", self.namespace, self.name, exc.reason)
            return False
        self._took()
        return True

    def _took(self) -> None:
        self._renewed_at = self.monotonic()
        self.leading = True
        spec = self._lease.spec
        self._observed_record = (spec.holder_identity, spec.renew_time, spec.lease_duration_seconds,
                                 spec.lease_transitions)  # fmt: skip
        self._observed_at = self._renewed_at

    # ---- the loops ------------------------------------------------------------------------
    def acquire(self, stop: threading.Event) -> bool:
        """Block until this process leads (True) or ``stop`` is set (False)."""
        announced = ""
        while not stop.is_set():
            if self.try_acquire_or_renew():
                return True
            holder = (self._observed_record or ("",))[0] or ""
            if holder != announced:
                log.info("standby: Lease %s/%s is held by %s", self.namespace, self.name, holder or "nobody")
                announced = holder
            stop.wait(self.timing.retry_period)
        return False

    def keep_renewing(self, on_lost: Callable[[], None]) -> None:
        """Renew every retry period in a daemon thread; call ``on_lost`` once the lease is lost."""

        def run() -> None:
            while not self._stop.wait(self.timing.retry_period):
                if self.try_acquire_or_renew():
                    continue
                late = self.monotonic() - self._renewed_at
                if not self.leading or late >= self.timing.renew_deadline:
                    self.leading = False
                    log.error("leader election lost (last renewed %.1fs ago)", late)
                    on_lost()
                    return

        self._thread = threading.Thread(target=run, name="lease-renew", daemon=True)
        self._thread.start()

    def release(self) -> None:
        """Give the lease up (a clean stop): a standby takes it on its next try."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.timing.retry_period + 5)
        if not self.leading or self._lease is None:
            return
        self.leading = False
        spec = self._lease.spec
        spec.holder_identity = None
        spec.lease_duration_seconds = 1
        spec.renew_time = _now()
        try:
            self.coordination.replace_namespaced_lease(self.name, self.namespace, self._lease)
            log.info("released Lease %s/%s", self.namespace, self.name)
        except ApiException as exc:
            log.warning("could not release Lease %s/%s: %s", self.namespace, self.name, exc.reason)
