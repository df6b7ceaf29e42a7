"""/metrics: the server's counters in Prometheus' text format (prometheus-client).

t5tpu_serve_requests_total{route, status}   every HTTP request; status 499 when the client left
t5tpu_serve_request_seconds{route}          latency, from the request's arrival to its answer
t5tpu_serve_batch_rows{kind}                rows per model call (how well requests batch)
t5tpu_serve_batch_seconds{kind}             model time per call
t5tpu_serve_queue_rows                      rows waiting for the model now
t5tpu_serve_truncated_inputs_total          inputs cut to the model's input length
t5tpu_serve_streams_total{outcome}          streamed predictions: completed, failed, disconnected
t5tpu_serve_streams_open                    streams being sent now
t5tpu_serve_ready                           1 once the model is loaded and compiled
t5tpu_serve_programs                        the engine's compiled programs
t5tpu_serve_programs_lowered                programs jax lowered for compiling in this process
                                            (rises after warm-up only for non-default settings)

The registry is the server's own (not prometheus-client's global one), so two servers in one
process (the tests) count apart. Routes are labelled by name, never by the raw path, so
requests for made-up paths cannot grow the label set.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import prometheus_client

from t5tpu.runtime import compile_events

CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST
CLIENT_GONE = 499  # nginx's status for a client that closed the connection before the answer
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_ROW_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


class ServeMetrics:
    def __init__(self):
        self.registry = prometheus_client.CollectorRegistry(auto_describe=True)
        kwargs = {"registry": self.registry, "namespace": "t5tpu_serve"}
        self.requests = prometheus_client.Counter(
            "requests", "HTTP requests by route and status", ["route", "status"], **kwargs
        )
        self.latency = prometheus_client.Histogram(
            "request_seconds", "request latency", ["route"], buckets=_LATENCY_BUCKETS, **kwargs
        )
        self.batch_rows = prometheus_client.Histogram(
            "batch_rows",
            "rows a batch took at once (at its start or into freed slots)",
            ["kind"],
            buckets=_ROW_BUCKETS,
            **kwargs,
        )
        self.batch_seconds = prometheus_client.Histogram(
            "batch_seconds",
            "model time per run of a group of rows",
            ["kind"],
            buckets=_LATENCY_BUCKETS,
            **kwargs,
        )
        self.queue_rows = prometheus_client.Gauge("queue_rows", "rows waiting", **kwargs)
        self.truncated = prometheus_client.Counter(
            "truncated_inputs", "inputs cut to the model's input length", **kwargs
        )
        self.ready = prometheus_client.Gauge("ready", "1 once the model can answer", **kwargs)
        self.streams = prometheus_client.Counter(
            "streams", "streamed predictions by how they ended", ["outcome"], **kwargs
        )
        self.streams_open = prometheus_client.Gauge("streams_open", "streams now", **kwargs)
        self.programs = prometheus_client.Gauge("programs", "compiled programs", **kwargs)
        self.lowered = prometheus_client.Gauge(
            "programs_lowered", "programs lowered for compiling", **kwargs
        )
        self.lowered.set_function(compile_events.lowered)

    def watch_programs(self, count: Callable[[], int]) -> None:
        self.programs.set_function(count)

    def watch_queue(self, depth: Callable[[], int]) -> None:
        self.queue_rows.set_function(depth)

    def observe_rows(self, group, rows: int) -> None:
        """Rows a batch took at once: when it started, or into slots that others left."""
        self.batch_rows.labels(kind=getattr(group, "kind", str(group))).observe(rows)

    def observe_run(self, group, seconds: float) -> None:
        """The time the model spent on a group's rows, from its first take to its last answer."""
        self.batch_seconds.labels(kind=getattr(group, "kind", str(group))).observe(seconds)

    def exposition(self) -> bytes:
        return prometheus_client.generate_latest(self.registry)


class MetricsMiddleware:
    """ASGI middleware counting every HTTP request (Starlette's 404s and 405s included) by
    route name and status, and timing it."""

    def __init__(self, app, *, metrics: ServeMetrics, route_names: dict[str, str]):
        self.app = app
        self.metrics = metrics
        self.route_names = route_names

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = [500]  # what an exception that escapes every handler becomes
        start = time.perf_counter()

        async def send_and_note(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            # Looked up at the end: a task route is named once the tasks' list has been read.
            route = self.route_names.get(scope["path"], "other")
            self.metrics.requests.labels(route=route, status=str(status[0])).inc()
            self.metrics.latency.labels(route=route).observe(time.perf_counter() - start)
