"""The server's life: listen at once, load and compile the model in the worker thread (/health
answers 503 meanwhile), answer, and on SIGTERM or Ctrl-C stop taking connections, finish every
request in flight, and exit 0.

uvicorn serves the app on a socket bound here, before anything is loaded, so a port in use is
one line at start-up; its connections are connections.py's (timeouts, head limits). A second
SIGTERM or Ctrl-C cuts the drain short: the requests in flight get 503 and the process exits.
The worker thread loads the model, compiles its programs, then runs the batcher until
shutdown; jax runs programs in no other thread (beam search's of a new width compile in one
beside it: model_worker.py). If loading fails, the server stops and the
command exits with the loading error's one line.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import signal
import socket
import threading
import time
from collections.abc import Callable

import uvicorn

from t5tpu.errors import UserError
from t5tpu.serve.app import HttpOptions, Service, build_app
from t5tpu.serve.batcher import Batcher, BatchLimits
from t5tpu.serve.connections import ConnectionLimits, protocol_class
from t5tpu.serve.http_guard import GuardOptions
from t5tpu.serve.model_worker import ModelWorker
from t5tpu.serve.serve_metrics import ServeMetrics


@dataclasses.dataclass(frozen=True)
class ServerOptions:
    max_connections: int  # open (then the longest idle goes) and in flight (then 503)
    shutdown_timeout_s: float  # in-flight requests get this long after SIGTERM
    warm_up: bool
    log_requests: bool
    limits: ConnectionLimits = ConnectionLimits()
    api_key: str | None = None


def say(message: str) -> None:
    print(f"t5tpu serve: {message}", flush=True)


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, or a UserError naming the address (in use, not this machine's)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        message = f"cannot listen on {host}:{port}: {e.strerror}; check --host and --port"
        raise UserError(message) from None
    return sock


class _Worker:
    """The model's thread: load, compile, then batches until the batcher stops."""

    def __init__(self, *, service: Service, load: Callable[[], ModelWorker], warm_up: bool):
        self.service = service
        self.load = load
        self.warm_up = warm_up
        self.stopping = threading.Event()  # set at shutdown: warming up ends early
        self.error: Exception | None = None
        self.on_failure: Callable[[], None] = lambda: None
        self.thread = threading.Thread(target=self._run, name="t5tpu-model", daemon=True)

    def _run(self) -> None:
        try:
            model_worker = self._prepare()
        except Exception as error:  # reported by the main thread once the server has stopped
            self.error = error
            self.service.batcher.fail(error)
            self.on_failure()
            return
        self.service.ready(model_worker)
        self.service.batcher.serve(model_worker.run_group, ready=model_worker.ready)

    def _prepare(self) -> ModelWorker:
        start = time.perf_counter()
        model_worker = self.load()  # parses the model's gin files: nothing may read gin now
        # The task modules (and the user's, which may import anything) are imported here, in
        # this one thread, before compiling starts threads of its own: a module imported
        # lazily while threads race to use it was half-imported to one of them.
        self.service.tasks.warm_up()
        if self.warm_up:
            say(
                f"compiling {model_worker.programs_needed} decoding programs "
                f"({len(model_worker.batch_sizes)} batch sizes)"
            )
            programs = model_worker.warm_up(stopping=self.stopping.is_set)
            say(f"{programs} programs ready")
        # What is loaded now lives as long as the server: a full collection walking it would
        # stall every request in flight (a few tenths of a second), so the collector skips it.
        gc.collect()
        gc.freeze()
        say(f"ready in {time.perf_counter() - start:.1f} s")
        return model_worker


def _noted_stop_signals() -> list[str]:
    """SIGTERM and SIGINT noted by name. uvicorn handles both while it serves (stop taking
    connections, finish the requests in flight) and then raises the signal again to the
    handler it found; this one lets the command exit 0 after a clean stop."""
    received: list[str] = []

    def note(signum, frame) -> None:
        received.append(signal.Signals(signum).name)

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, note)
    return received


class _Server(uvicorn.Server):
    """uvicorn's server, a second SIGTERM ending the drain at once as a second Ctrl-C does,
    and the first stop signal's time noted (what is left of the drain time after it)."""

    stop_signalled: float | None = None

    def handle_exit(self, sig, frame) -> None:
        if self.should_exit:
            self.force_exit = True
        elif self.stop_signalled is None:
            self.stop_signalled = time.monotonic()
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets=None) -> None:
        await super().shutdown(sockets=sockets)
        if self.force_exit:
            # uvicorn leaves the requests in flight and the lifespan to asyncio's teardown,
            # where a cancelled lifespan is a traceback: the requests get their 503 now.
            for task in self.server_state.tasks:
                task.cancel()
            await self.lifespan.shutdown()


@dataclasses.dataclass(frozen=True)
class Running:
    """A server ready to run (`server.run(sockets=[sock])`) and what it is made of."""

    server: _Server
    worker: _Worker
    service: Service


def build(
    *,
    options: ServerOptions,
    http: HttpOptions,
    batching: BatchLimits,
    load: Callable[[], ModelWorker],
) -> Running:
    """The app, its batcher and worker, and the uvicorn server around them; the worker starts
    with the server and stops after it."""
    metrics = ServeMetrics()
    batcher = Batcher(limits=batching, on_rows=metrics.observe_rows, on_run=metrics.observe_run)
    metrics.watch_queue(lambda: batcher.depth)
    service = Service(batcher=batcher, metrics=metrics, options=http)
    worker = _Worker(service=service, load=load, warm_up=options.warm_up)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        worker.thread.start()
        yield
        worker.stopping.set()
        batcher.stop()

    guard = GuardOptions(
        api_key=options.api_key,
        max_in_flight=options.max_connections,
        open_paths=frozenset(http.health_routes),
    )
    server = _Server(
        uvicorn.Config(
            build_app(service=service, lifespan=lifespan, guard=guard),
            http=protocol_class(options.limits, options.max_connections),
            lifespan="on",
            log_level="info" if options.log_requests else "warning",
            access_log=options.log_requests,
            timeout_keep_alive=options.limits.keep_alive_timeout_s,
            timeout_graceful_shutdown=options.shutdown_timeout_s,
        )
    )
    worker.on_failure = lambda: setattr(server, "should_exit", True)
    return Running(server=server, worker=worker, service=service)


def serve(
    *,
    sock: socket.socket,
    options: ServerOptions,
    http: HttpOptions,
    batching: BatchLimits,
    load: Callable[[], ModelWorker],
) -> int:
    """Serves on `sock` until SIGTERM or Ctrl-C; the model comes from `load`, called in the
    worker thread. Returns the exit code (0), or raises the loading error."""
    running = build(options=options, http=http, batching=batching, load=load)
    received = _noted_stop_signals()
    host, port = sock.getsockname()[:2]
    say(f"listening on http://{host}:{port}; GET /health answers 503 until the model is ready")
    running.server.run(sockets=[sock])
    worker = running.worker
    # A cut drain skips the lifespan's end; the queue is empty now either way, and the worker
    # ends once its last batch (or compile) is done: waited for while drain time is left.
    worker.stopping.set()
    running.service.batcher.stop()
    worker.thread.join(timeout=_time_left(running.server, options.shutdown_timeout_s))
    if worker.error is not None:
        raise worker.error
    if worker.thread.is_alive():
        # A model call that outlived the shutdown timeout answers no one now, and cannot be
        # interrupted; interpreter teardown under a running jax call can crash, so leave now.
        say("stopped with a model call still running")
        os._exit(0)
    answered = sum(
        sample.value
        for family in running.service.metrics.registry.collect()
        if family.name == "t5tpu_serve_requests"
        for sample in family.samples
        if sample.name.endswith("_total")
    )
    say(f"stopped ({', '.join(received) or 'server exit'}) after {answered:.0f} requests")
    return 0


def _time_left(server: _Server, drain_s: float) -> float:
    """How long the worker's last model call is waited for: the drain time left (at least a
    second), or a moment once a second signal has cut the drain."""
    if server.force_exit:
        return 0.2
    if server.stop_signalled is None:  # stopped by a loading failure: the worker is done
        return drain_s
    return max(1.0, drain_s - (time.monotonic() - server.stop_signalled))
