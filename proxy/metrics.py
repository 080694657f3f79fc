"""Prometheus metrics of the proxy, on a registry of its own.

Per-instance gauges are read from the balancers at scrape time by a
collector, so the request path pays nothing for them; counters are bound to
their label values once and cached.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from proxy.balancer import Balancer

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _StateCollector(Collector):
    def __init__(self, balancers: list[Balancer], pending: Callable[[], int]) -> None:
        self._balancers = balancers
        self._pending = pending

    def collect(self) -> Iterable[Metric]:
        inflight = GaugeMetricFamily(
            "ascend_offload_proxy_backend_inflight",
            "Requests the proxy has in flight on a backend instance",
            labels=["role", "instance"],
        )
        healthy = GaugeMetricFamily(
            "ascend_offload_proxy_backend_healthy",
            "1 unless the instance refused a connection within its cooldown",
            labels=["role", "instance"],
        )
        for b in self._balancers:
            for snap in b.snapshot():
                inflight.add_metric([b.role, str(snap["instance"])], float(snap["inflight"]))  # type: ignore[arg-type]
                healthy.add_metric([b.role, str(snap["instance"])], 1.0 if snap["healthy"] else 0.0)
        pending = GaugeMetricFamily(
            "ascend_offload_proxy_pending_requests",
            "Sub-requests forwarded to a decode and not finished yet",
        )
        pending.add_metric([], float(self._pending()))
        yield inflight
        yield healthy
        yield pending


class ProxyMetrics:
    def __init__(self, balancers: list[Balancer], pending: Callable[[], int]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self._requests = Counter(
            "ascend_offload_proxy_requests",
            "Client requests by endpoint and HTTP status",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self._errors = Counter(
            "ascend_offload_proxy_backend_errors",
            "Backend failures by role and kind",
            ["role", "kind"],
            registry=self.registry,
        )
        self._registrations = Counter(
            "ascend_offload_proxy_metaserver_registrations",
            "Metaserver registrations by result",
            ["result"],
            registry=self.registry,
        )
        self._claims = Counter(
            "ascend_offload_proxy_metaserver_claims",
            "Prefill claims of a decode's registration (early dispatch) by result",
            ["result"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "ascend_offload_proxy_request_seconds",
            "Client request latency, whole response",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
            registry=self.registry,
        )
        self.registry.register(_StateCollector(balancers, pending))
        self._req_children: dict[tuple[str, int], Counter] = {}
        self._err_children: dict[tuple[str, str], Counter] = {}
        self._reg_children: dict[str, Counter] = {}
        self._claim_children: dict[str, Counter] = {}

    def request(self, endpoint: str, status: int) -> None:
        key = (endpoint, status)
        child = self._req_children.get(key)
        if child is None:
            child = self._req_children[key] = self._requests.labels(endpoint, str(status))
        child.inc()

    def backend_error(self, role: str, kind: str) -> None:
        key = (role, kind)
        child = self._err_children.get(key)
        if child is None:
            child = self._err_children[key] = self._errors.labels(role, kind)
        child.inc()

    def registration(self, result: str) -> None:
        child = self._reg_children.get(result)
        if child is None:
            child = self._reg_children[result] = self._registrations.labels(result)
        child.inc()

    def claim(self, result: str) -> None:
        child = self._claim_children.get(result)
        if child is None:
            child = self._claim_children[result] = self._claims.labels(result)
        child.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
