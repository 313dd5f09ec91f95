"""Prometheus metrics of the runtime, in a private registry (names are a contract: see README).

Every series carries ``lane`` and ``revision`` (the revision from the config); track, policy,
namespace and environment come from Prometheus target labels, never from here. The per-request
series (latency, queue age, requests) carry ``tenant`` too, one of the policy's declared tenants,
``default`` or ``other`` (see :class:`batchpilot_runtime.config.TenantsConfig`), and the request
counter the HTTP status ``code`` it was answered with; per-batch series (execution time, batch
size, cut delay) do not: a batch mixes tenants. Tenant children are created on a tenant's first
request, so a tenant that sends nothing costs no series.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from batchpilot_runtime.config import DEFAULT_TENANT

# Seconds: 100us .. 10s, dense around the 1-100 ms range where SLOs are set, so that
# histogram_quantile() interpolates within a narrow bucket at typical p99 targets.
LATENCY_BUCKETS = (
    0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03,
    0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0,
)  # fmt: skip
BATCH_BUCKETS = tuple(float(2**i) for i in range(13))  # 1 .. 4096 rows

OUTCOMES = ("ok", "rejected_full", "timed_out", "invalid", "failed", "unavailable")
CODES = {
    "ok": "200",
    "rejected_full": "429",
    "timed_out": "504",
    "failed": "500",
    "unavailable": "503",
    "invalid": "400",
}
"""The status code each outcome is answered with (``invalid`` may also be 404: an unknown model)."""
UNKNOWN_LANE = "_unknown"
"""Lane label for requests naming a lane that does not exist (lane names never start with '_')."""

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _DepthCollector(Collector):
    def __init__(self, revision: str, depth: Callable[[], dict[str, int]]) -> None:
        self._revision = revision
        self._depth = depth

    def collect(self) -> Iterable[Metric]:
        g = GaugeMetricFamily("batchpilot_queue_depth", "Rows waiting in the lane queue", labels=["lane", "revision"])
        for lane, rows in self._depth().items():
            g.add_metric([lane, self._revision], float(rows))
        yield g


class _BusyCollector(Collector):
    def __init__(self, revision: str, busy: Callable[[], float]) -> None:
        self._revision = revision
        self._busy = busy

    def collect(self) -> Iterable[Metric]:
        c = CounterMetricFamily(
            "batchpilot_executor_busy_seconds",
            "Model worker time spent on batches (forward pass plus the work around it), all lanes",
            labels=["revision"],
        )
        c.add_metric([self._revision], self._busy())
        yield c


class Metrics:
    def __init__(
        self,
        revision: str,
        lanes: Sequence[str],
        model: str,
        device: str,
        dtype: str,
        depth: Callable[[], dict[str, int]],
        busy: Callable[[], float] | None = None,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.revision = revision
        labels = ["lane", "revision"]
        tenant_labels = ["lane", "revision", "tenant"]
        r = self.registry
        self.latency = Histogram(
            "batchpilot_request_latency_seconds",
            "End-to-end time from request arrival to response, for requests admitted to a lane queue",
            tenant_labels, buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.queue_age = Histogram(
            "batchpilot_queue_age_seconds",
            "Time a request waited in its lane queue until dispatched into a batch or timed out",
            tenant_labels, buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.exec_time = Histogram(
            "batchpilot_model_execution_seconds",
            "Model forward time per batch",
            labels, buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.batch_rows = Histogram(
            "batchpilot_batch_size_rows", "Rows per executed batch", labels, buckets=BATCH_BUCKETS, registry=r
        )
        self.cut_delay = Histogram(
            "batchpilot_batch_cut_delay_seconds",
            "How long after max(window expiry or batch full, model free) a batch was cut: the "
            "load-dependent delay before dispatch (event loop and worker thread sharing cores and the GIL)",
            labels, buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.loop_lag_histogram = Histogram(
            "batchpilot_event_loop_lag_seconds",
            "How late the HTTP event loop ran a timer due every 20 ms: the wait before the handler that a "
            "request arriving then has, which the latency histogram does not see (looplag.py)",
            ["revision"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.requests = Counter(
            "batchpilot_requests",
            "Requests by outcome and status code",
            [*tenant_labels, "outcome", "code"],
            registry=r,
        )
        self.info = Gauge(
            "batchpilot_runtime_info", "Runtime build and placement (always 1)",
            ["revision", "model", "device", "dtype"], registry=r,
        )  # fmt: skip
        self.info.labels(revision, model, device, dtype).set(1)
        r.register(_DepthCollector(revision, depth))
        if busy is not None:
            r.register(_BusyCollector(revision, busy))
        # Pre-bound children: one dict lookup per observation on the hot path.
        self.lanes = frozenset(lanes)
        self.lat: dict[tuple[str, str], Histogram] = {}
        self.age: dict[tuple[str, str], Histogram] = {}
        self.exe = {lane: self.exec_time.labels(lane, revision) for lane in lanes}
        self.rows = {lane: self.batch_rows.labels(lane, revision) for lane in lanes}
        self.cut = {lane: self.cut_delay.labels(lane, revision) for lane in lanes}
        self.loop_lag = self.loop_lag_histogram.labels(revision)
        self.count: dict[tuple[str, str, str, str], Counter] = {}
        # The tenant every request has when the policy declares none: its series exist from
        # the start, as they did before tenants (a rate over a counter that appears later
        # misses its first increments).
        for lane in lanes:
            self.latency_of(lane, DEFAULT_TENANT)
            self.queue_age_of(lane, DEFAULT_TENANT)
        for lane in [*lanes, UNKNOWN_LANE]:
            for outcome in OUTCOMES:
                self._counter(lane, DEFAULT_TENANT, outcome, CODES[outcome])

    def latency_of(self, lane: str, tenant: str) -> Histogram:
        child = self.lat.get((lane, tenant))
        if child is None:
            child = self.lat[(lane, tenant)] = self.latency.labels(lane, self.revision, tenant)
        return child

    def queue_age_of(self, lane: str, tenant: str) -> Histogram:
        child = self.age.get((lane, tenant))
        if child is None:
            child = self.age[(lane, tenant)] = self.queue_age.labels(lane, self.revision, tenant)
        return child

    def _counter(self, lane: str, tenant: str, outcome: str, code: str) -> Counter:
        key = (lane, tenant, outcome, code)
        child = self.count.get(key)
        if child is None:
            child = self.count[key] = self.requests.labels(lane, self.revision, tenant, outcome, code)
        return child

    def outcome(self, lane: str, outcome: str, tenant: str = DEFAULT_TENANT, code: int | None = None) -> None:
        """Count one answered request (``tenant`` already bounded by the config's tenant list)."""
        if lane not in self.lanes:
            lane = UNKNOWN_LANE
        self._counter(lane, tenant, outcome, CODES[outcome] if code is None else str(code)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
