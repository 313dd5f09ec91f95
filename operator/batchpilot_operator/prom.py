"""The real metrics backend: instant queries against Prometheus via prometheus-api-client.

Impure (network). It implements :class:`batchpilot_operator.analysis.MetricsBackend`
(re-exported here with :class:`Measurement`): ``measure(queries)`` never raises for store
faults. A refused connection, a timeout, an HTTP error status or a malformed answer becomes
a :class:`Measurement` with ``error`` set, which the analysis turns into the ``Error``
outcome and the planner into ``onMetricsUnavailable``.

Retries: prometheus-api-client's default adapter retries 3 times with back-off, which would
stall a reconcile for seconds while Prometheus is down. The planner already retries on the
next analysis interval, so the backend makes one attempt per query, bounded by ``timeout``,
and after the first connection-level failure in a batch it stops and marks the rest of the
batch with the same error (one unreachable server costs one timeout, not one per query).

Credentials: with ``bearer_token_file`` every query carries ``Authorization: Bearer <token>``
(Prometheus behind an authenticating proxy such as kube-rbac-proxy, or a managed Prometheus),
the file re-read whenever it changes (:class:`batchpilot_operator.credentials.TokenFile`): a
rotated token is used without a restart. A 401/403 answer is an ``Error`` measurement like an
outage (the rollout holds or rolls back by ``onMetricsUnavailable``), and is also counted in
``batchpilot_operator_auth_errors_total{target="prometheus"}`` and logged once.

All queries of one ``measure`` call are evaluated at the same instant (the ``time``
parameter of the query API), so a p99 and its sample count, and the canary and the stable
track, cover exactly the same window.
"""

from __future__ import annotations

import math
import os
import re
import time
from collections.abc import Mapping, Sequence
from typing import Any, cast

import requests
from prometheus_api_client.exceptions import PrometheusApiClientException
from prometheus_api_client.prometheus_connect import PrometheusConnect
from urllib3.util.retry import Retry

from batchpilot_operator import credentials
from batchpilot_operator.analysis import Measurement, MetricsBackend

__all__ = ["Measurement", "MetricsBackend", "PrometheusBackend", "buckets_from_result", "scalar_from_result"]


def scalar_from_result(result: Any) -> float | None:
    """The scalar of an instant-query result: one sample -> its value; none/NaN -> None.

    Accepts the ``data.result`` of a vector (``[{"metric": {}, "value": [ts, "1.5"]}]``) or a
    scalar (``[ts, "1.5"]``). More than one series is a malformed answer for our aggregated
    queries and raises ``ValueError``.
    """
    if isinstance(result, list) and len(result) == 2 and not isinstance(result[0], dict):
        raw: Any = result[1]
    elif isinstance(result, list):
        if not result:
            return None
        if len(result) > 1:
            raise ValueError(f"expected at most one series, got {len(result)}")
        item = result[0]
        if not isinstance(item, dict) or "value" not in item:
            raise ValueError(f"unexpected result item {item!r}")
        raw = item["value"][1]
    else:
        raise ValueError(f"unexpected result {result!r}")
    value = float(raw)
    if math.isnan(value):
        return None
    return value


def buckets_from_result(result: Any) -> tuple[tuple[float, float], ...] | None:
    """Histogram buckets from a ``sum by (le)`` vector: ``((le, count), ...)`` sorted by ``le``.

    None when the answer is not one series per ``le`` (then it is read as a scalar). A NaN
    count (no traffic in the window) makes the whole histogram "no data": an empty tuple.
    """
    if not isinstance(result, list) or not result or not isinstance(result[0], dict):
        return None
    if not all(isinstance(item, dict) and "le" in item.get("metric", {}) for item in result):
        return None
    buckets = sorted((float(item["metric"]["le"]), float(item["value"][1])) for item in result)
    if any(math.isnan(count) for _, count in buckets):
        return ()
    return tuple(buckets)


def groups_from_result(result: Any) -> tuple[tuple[str, float], ...] | None:
    """A ``sum by (label)`` vector of one label other than ``le``: ``((value, count), ...)``.

    None when the answer is not one series per value of a single label (then it is a scalar)."""
    if not isinstance(result, list) or not result or not all(isinstance(item, dict) for item in result):
        return None
    keys = {tuple(item.get("metric", {})) for item in result}
    if len(keys) != 1 or len(next(iter(keys))) != 1:
        return None
    (label,) = next(iter(keys))
    return tuple(sorted((str(item["metric"][label]), float(item["value"][1])) for item in result))


def measurement_from_result(query: str, result: Any) -> Measurement:
    buckets = buckets_from_result(result)
    if buckets is not None:
        return Measurement(query=query, buckets=buckets)
    groups = groups_from_result(result)
    if groups is not None:
        return Measurement(query=query, groups=groups)
    return Measurement(query=query, value=scalar_from_result(result))


class PrometheusBackend:
    """``MetricsBackend`` over a Prometheus HTTP API at ``url``."""

    def __init__(self, url: str, timeout: float = 5.0, bearer_token_file: str | os.PathLike[str] | None = None) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.token = credentials.TokenFile(bearer_token_file) if bearer_token_file else None
        self._client = PrometheusConnect(url=self.url, retry=Retry(total=0, raise_on_status=False))

    def close(self) -> None:
        self._client.close()

    def measure(self, queries: Sequence[str], at: float | None = None) -> Mapping[str, Measurement]:
        """Evaluate every query at one instant (``at``, Unix seconds; default: now)."""
        params = {"time": f"{time.time() if at is None else at:.3f}"}
        out: dict[str, Measurement] = {}
        unreachable: str | None = None
        if self.token is not None:
            try:
                self._client.headers = {"Authorization": f"Bearer {self.token.token()}"}
            except credentials.CredentialError as exc:
                unreachable = f"prometheus credentials: {exc}"
        for query in queries:
            if query in out:
                continue
            if unreachable is not None:
                out[query] = Measurement(query=query, error=unreachable)
                continue
            try:
                # requests takes float seconds; the client's annotation says int.
                result = self._client.custom_query(query, params=params, timeout=cast(int, self.timeout))
                out[query] = measurement_from_result(query, result)
                credentials.auth_ok("prometheus")
            except (requests.ConnectionError, requests.Timeout) as exc:
                unreachable = f"prometheus unreachable at {self.url}: {type(exc).__name__}"
                out[query] = Measurement(query=query, error=unreachable)
            except PrometheusApiClientException as exc:
                status = _status_code(str(exc))
                if status in (401, 403):
                    credentials.auth_failed("prometheus", f"HTTP {status} from {self.url}")
                    unreachable = f"prometheus rejected the operator's credentials: HTTP {status}"
                    out[query] = Measurement(query=query, error=unreachable)
                    continue
                credentials.auth_ok("prometheus")
                out[query] = Measurement(query=query, error=f"prometheus error: {_short(str(exc))}")
            except (requests.RequestException, ValueError, KeyError, TypeError, IndexError) as exc:
                out[query] = Measurement(query=query, error=f"bad response: {_short(repr(exc))}")
        return out


_STATUS = re.compile(r"^HTTP Status Code (\d{3})\b")


def _status_code(message: str) -> int | None:
    """The HTTP status of a prometheus-api-client error ("HTTP Status Code 401 (...)")."""
    match = _STATUS.match(message)
    return int(match.group(1)) if match else None


def _short(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."
