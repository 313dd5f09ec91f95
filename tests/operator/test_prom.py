"""PrometheusBackend against a real Prometheus scraping a tiny in-process exporter.

The exporter serves fixed-shape histograms whose counts grow by the same amount at every
scrape, so the bucket ratios (and the p99 from ``histogram_quantile``) are exact:

* latency, per scrape: 6 obs <= 0.05s, 3 in (0.05, 0.1], 1 in (0.1, 0.25]
  -> p99 = 0.1 + 0.15 * (0.99 - 0.9) / 0.1 = 0.235s
* queue age, per scrape: 5 obs <= 1ms, 5 in (1ms, 10ms]
  -> p99 = 0.001 + 0.009 * (0.99 - 0.5) / 0.5 = 0.00982s
* requests, per scrape: 7 ok, 2 rejected_full, 1 invalid (the client's fault: not counted)
  -> error rate = 2 / 9; an exporter without error series at all gives 0, not "no data"
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from batchpilot_localdev import free_port
from batchpilot_localdev.prometheus import PrometheusServer, ScrapeTarget
from batchpilot_operator.analysis import SLICES, Outcome, build_queries, run_analysis
from batchpilot_operator.prom import PrometheusBackend, scalar_from_result
from batchpilot_operator.spec import PolicySpec
from bptest import conclusive

LAT_BUCKETS = ((0.05, 6), (0.1, 9), (0.25, 10))
QA_BUCKETS = ((0.001, 5), (0.01, 10))
PER_SCRAPE = 10
EXPECTED_P99 = 0.235
EXPECTED_QA_P99 = 0.00982
OUTCOMES_PER_SCRAPE = {"ok": 7, "rejected_full": 2, "invalid": 1}
EXPECTED_ERROR_RATE = 2 / 9


class Exporter:
    """Serves /metrics for one revision and lane; counters grow by PER_SCRAPE per scrape."""

    def __init__(self, revision: str, lane: str, scale: float = 1.0, errors: bool = True) -> None:
        self.revision, self.lane, self.scale, self.errors = revision, lane, scale, errors
        self.scrapes = 0
        self.lock = threading.Lock()
        exporter = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = exporter.render().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.address = f"127.0.0.1:{self.server.server_address[1]}"

    def render(self) -> str:
        with self.lock:
            self.scrapes += 1
            n = self.scrapes
        lines = []
        for name, buckets in (
            ("batchpilot_request_latency_seconds", LAT_BUCKETS),
            ("batchpilot_queue_age_seconds", QA_BUCKETS),
        ):
            labels = f'lane="{self.lane}",revision="{self.revision}"'
            lines.append(f"# TYPE {name} histogram")
            for le, cum in buckets:
                lines.append(f'{name}_bucket{{{labels},le="{le * self.scale}"}} {cum * n}')
            lines.append(f'{name}_bucket{{{labels},le="+Inf"}} {PER_SCRAPE * n}')
            lines.append(f"{name}_sum{{{labels}}} {0.05 * PER_SCRAPE * n}")
            lines.append(f"{name}_count{{{labels}}} {PER_SCRAPE * n}")
        lines.append("# TYPE batchpilot_requests_total counter")
        outcomes = OUTCOMES_PER_SCRAPE if self.errors else {"ok": PER_SCRAPE}
        for outcome, count in outcomes.items():
            lines.append(f'batchpilot_requests_total{{{labels},outcome="{outcome}"}} {count * n}')
        return "\n".join(lines) + "\n"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def exporters() -> Iterator[Callable[..., Exporter]]:
    made: list[Exporter] = []

    def make(revision: str, lane: str = "interactive", scale: float = 1.0, errors: bool = True) -> Exporter:
        e = Exporter(revision, lane, scale, errors)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


def labels(track: str) -> dict[str, str]:
    return {"namespace": "ml", "policy": "chat", "track": track}


def spec(window: str = "10s") -> PolicySpec:
    return PolicySpec.model_validate(
        {
            "model": {"name": "m", "image": "img:1", "source": "builtin:mlp"},
            "lanes": [
                {
                    "name": "interactive",
                    "maxBatchSize": 8,
                    "maxQueueDelay": "5ms",
                    "maxQueueLength": 100,
                    "requestTimeout": "1s",
                }
            ],
            # 120ms: 8.7% of the synthetic canary's requests lie over it (interpolated inside
            # its (0.1, 0.25] bucket), a breach 80 requests can show with confidence.
            "slo": {"p99Latency": "120ms", "maxQueueAge": "50ms"},
            "rollout": {"analysisInterval": window, "minSamples": 20},
        }
    )


def wait_samples(prom: PrometheusServer, query: str, minimum: float) -> None:
    prom.wait_for(query, lambda r: bool(r) and float(r[0]["value"][1]) >= minimum, timeout=40)


@pytest.mark.prometheus
def test_backend_measures_p99_and_samples_from_real_prometheus(
    prometheus: PrometheusServer, exporters: Callable[..., Exporter]
) -> None:
    canary = exporters("r2")
    stable = exporters("r1", scale=0.2, errors=False)  # 5x faster, no error series at all
    # targets are added after start: proves the file_sd reload the e2e test relies on
    prometheus.set_targets(
        [ScrapeTarget(canary.address, labels("canary")), ScrapeTarget(stable.address, labels("stable"))]
    )
    prometheus.wait_for_targets_up(2)
    q = build_queries(policy="chat", namespace="ml", track="canary", revision="r2", lane="interactive", window=10)
    # a full 10s window of 10 observations per 1s scrape: ~100 (increase() extrapolates)
    wait_samples(prometheus, q.metric("p99Latency").samples, 80)

    backend = PrometheusBackend(prometheus.url, timeout=5)
    got = backend.measure(q.all())
    lat, qa = q.metric("p99Latency"), q.metric("queueAge")
    assert all(m.error is None for m in got.values()), got
    assert got[lat.value].value == pytest.approx(EXPECTED_P99, rel=1e-6)
    assert got[qa.value].value == pytest.approx(EXPECTED_QA_P99, rel=1e-6)
    assert 80 <= (got[lat.samples].value or 0) <= 150
    assert got[qa.samples].value == got[lat.samples].value
    err = q.metric("errorRate")
    assert got[err.value].value == pytest.approx(EXPECTED_ERROR_RATE, rel=1e-6)
    assert got[err.samples].value == pytest.approx(0.9 * (got[lat.samples].value or 0), rel=1e-6)
    # The bad-event queries: the buckets by le (cumulative, +Inf = the count), and the errors.
    buckets = got[lat.bad].buckets
    assert buckets is not None and buckets[-1][0] == math.inf and len(buckets) == 4, buckets
    assert buckets[-1][1] == pytest.approx(got[lat.samples].value or 0, rel=1e-6)
    assert [c for _, c in buckets] == sorted(c for _, c in buckets)
    assert got[err.bad].value == pytest.approx(EXPECTED_ERROR_RATE * (got[err.samples].value or 0), rel=1e-6)

    # no series for another revision: no data (None), not an error
    other = build_queries(policy="chat", namespace="ml", track="canary", revision="zz", lane="interactive", window=10)
    none = backend.measure(other.all())
    # (the error count alone answers 0: "or vector(0)" makes a missing error series no errors)
    no_errors = (other.metric("errorRate").bad, other.metric("clientErrors").bad)
    assert all(m.error is None and m.value is None and not m.buckets for q, m in none.items() if q not in no_errors)
    assert [none[q].value for q in no_errors] == [0, 0]

    # the verdict end to end: canary p99 0.235s > SLO 120ms with enough samples -> Failed;
    # the stable track's (5x lower) values come back as evidence
    wait_samples(
        prometheus,
        build_queries(policy="chat", namespace="ml", track="stable", revision="r1", lane="interactive", window=10)
        .metric("p99Latency")
        .samples,
        40,
    )
    # (one window, judged by its own rule: the rollout's sequential evidence already conclusive)
    result = run_analysis(
        backend, spec(), policy="chat", namespace="ml", canary_revision="r2", stable_revision="r1", now=_now(),
        history=conclusive(spec()),
    )  # fmt: skip
    assert result.outcome is Outcome.FAILED
    (lane,) = result.lanes
    latency = lane.check("p99Latency")
    stable_latency = lane.check("p99Latency", "stable")
    assert latency is not None and latency.outcome is Outcome.FAILED
    assert latency.value == pytest.approx(EXPECTED_P99, rel=1e-6)
    assert stable_latency is not None and stable_latency.value == pytest.approx(EXPECTED_P99 * 0.2, rel=1e-6)
    queue_age = lane.check("queueAge")
    assert queue_age is not None and queue_age.outcome is Outcome.SUCCESSFUL
    errors, stable_errors = lane.check("errorRate"), lane.check("errorRate", "stable")
    assert errors is not None and errors.outcome is Outcome.FAILED
    assert errors.value == pytest.approx(EXPECTED_ERROR_RATE, rel=1e-6)
    assert stable_errors is not None and stable_errors.value == 0.0 and stable_errors.outcome is Outcome.SUCCESSFUL
    # The sub-windows come from the raw counters read at their boundaries: 5 of them, each
    # with its share of the window's requests (the exporter grows evenly, ~20 per 2s; the
    # oldest may predate the target's first scrape: no series yet counts as zero).
    canary_slices = result.tally["interactive/p99Latency/canary"]
    assert len(canary_slices) == SLICES and sum(n > 0 for _, n in canary_slices) >= 3, canary_slices
    assert sum(n for _, n in canary_slices) == pytest.approx(latency.samples or 0, rel=0.35)
    backend.close()


@pytest.mark.prometheus
def test_stopped_prometheus_gives_error_not_exception(
    prometheus: PrometheusServer, exporters: Callable[..., Exporter]
) -> None:
    e = exporters("r2")
    prometheus.set_targets([ScrapeTarget(e.address, labels("canary"))])
    prometheus.wait_for_targets_up(1)
    backend = PrometheusBackend(prometheus.url, timeout=2)
    q = build_queries(policy="chat", namespace="ml", track="canary", revision="r2", lane="interactive", window=10)
    assert all(m.error is None for m in backend.measure(q.all()).values())
    prometheus.stop()
    started = time.monotonic()
    got = backend.measure(q.all())
    assert time.monotonic() - started < 5  # one refused connection, not retries per query
    assert set(got) == set(q.all())
    assert all(m.error is not None and "unreachable" in m.error for m in got.values())
    result = run_analysis(
        backend, spec(), policy="chat", namespace="ml", canary_revision="r2", stable_revision=None, now=_now()
    )
    assert result.outcome is Outcome.ERROR
    # and back: the same backend measures again once Prometheus returns
    prometheus.start()
    prometheus.wait_for_targets_up(1)
    wait_samples(prometheus, q.metric("p99Latency").samples, 1)
    assert all(m.error is None for m in backend.measure(q.all()).values())


@pytest.mark.prometheus
def test_invalid_query_is_an_error_measurement(prometheus: PrometheusServer) -> None:
    backend = PrometheusBackend(prometheus.url, timeout=2)
    got = backend.measure(["sum(rate(foo[", "vector(1.5)", "vector(0) / 0"])
    assert got["sum(rate(foo["].error is not None and "prometheus error" in (got["sum(rate(foo["].error or "")
    assert got["vector(1.5)"].value == 1.5 and got["vector(1.5)"].error is None
    assert got["vector(0) / 0"].value is None and got["vector(0) / 0"].error is None  # NaN: no data


def test_unreachable_url_gives_error_quickly() -> None:
    backend = PrometheusBackend(f"http://127.0.0.1:{free_port()}", timeout=1)
    started = time.monotonic()
    got = backend.measure(["up", "vector(1)"])
    assert time.monotonic() - started < 3
    assert all(m.error is not None for m in got.values())


@pytest.mark.parametrize(
    ("result", "expected"),
    [
        ([], None),
        ([{"metric": {}, "value": [1.0, "0.25"]}], 0.25),
        ([{"metric": {}, "value": [1.0, "NaN"]}], None),
        ([{"metric": {}, "value": [1.0, "+Inf"]}], float("inf")),
        ([1.0, "3"], 3.0),
    ],
)
def test_scalar_from_result(result: Any, expected: float | None) -> None:
    assert scalar_from_result(result) == expected


@pytest.mark.parametrize(
    "result",
    [
        [{"metric": {"a": "1"}, "value": [1, "1"]}, {"metric": {"a": "2"}, "value": [1, "2"]}],
        [{"metric": {}}],
        {"unexpected": True},
        [{"metric": {}, "value": [1.0, "abc"]}],
    ],
)
def test_scalar_from_malformed_result_raises_value_error(result: Any) -> None:
    with pytest.raises(ValueError):
        scalar_from_result(result)


def _now() -> datetime:
    return datetime.now(UTC)
