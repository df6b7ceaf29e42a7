"""The HTTP routes: a Starlette app whose handlers check a request, queue its rows on the
batcher and wait for them, answering every failure as {"error": "<one line>"} with its status.

    POST /v1/predict (and AIP_PREDICT_ROUTE)  {"instances": ["..."] or [{"input": "..."}],
                                               "parameters": {num_beams, max_new_tokens,
                                               temperature, top_k, top_p, seed, the
                                               penalties, task, exact_inputs, adapter,
                                               stream (server-sent events: streams.py)}}
    POST /v1/score                            {"instances": [{"input": ..., "target": ...}],
                                               "parameters": {task, exact_inputs, adapter}}
    POST /v1/<route>                          each route the tasks offer (task_calls.py):
                                               {"instances": [{<its fields>}], "parameters"}
    GET  /health (and AIP_HEALTH_ROUTE)       200 once the model is loaded and compiled, else 503;
                                               {"status", "adapters": [names]} (--adapter)
    GET  /metrics                             Prometheus text format (serve_metrics.py)

Inputs are shaped as the model's run shaped its training inputs (text_to_text's INPUT_PREFIX,
Quora's lower-casing) unless "exact_inputs" is true; a task route refuses a model trained on
another task with a 400 unless "check_task" is false.

docs/SERVING.md has the answers' shapes. Parsing, checking and tokenizing run in Starlette's
thread pool, the model in the batcher's worker thread; the event loop only moves bytes. A
client that disconnects while its rows wait has them dropped from the queue, without touching
anyone else's batch.
"""

from __future__ import annotations

import asyncio
import dataclasses
import traceback

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route as Path

from t5tpu.errors import one_line_message
from t5tpu.model.decoding_settings import DecodingSettings
from t5tpu.model.engine import Row
from t5tpu.serve import payloads, streams
from t5tpu.serve.batcher import Batcher, BatchFailed, QueueFull, Stopped
from t5tpu.serve.http_guard import Guard, GuardOptions
from t5tpu.serve.model_worker import Group, ModelWorker, ScoreRow
from t5tpu.serve.payloads import PayloadError
from t5tpu.serve.serve_metrics import CLIENT_GONE, CONTENT_TYPE, MetricsMiddleware, ServeMetrics
from t5tpu.serve.task_calls import TaskRoutes
from t5tpu.tasks.serving import INPUT, Route

PREDICT_ROUTE = "/v1/predict"
TASK_ROUTES = "/v1/{name}"
HEALTH_ROUTE = "/health"
# Seconds a client is told to wait before retrying a 503 (queue full, model loading).
RETRY_AFTER = "1"


@dataclasses.dataclass(frozen=True)
class HttpOptions:
    """What the routes enforce, and where Vertex AI looks for them."""

    max_instances: int
    max_body_bytes: int
    truncation: str  # 'warn': cut long inputs and say so; 'error': refuse them with a 400
    max_queue: int
    predict_routes: tuple[str, ...] = (PREDICT_ROUTE,)
    health_routes: tuple[str, ...] = (HEALTH_ROUTE,)


class NotReady(Exception):
    """The model is still loading or compiling."""


class ClientGone(Exception):
    """The client closed the connection before its answer was ready."""


@dataclasses.dataclass(frozen=True)
class _Prepared:
    """A request checked and tokenized: its (group, row) pairs for the batcher, warnings to
    return, and the task route whose `respond` makes the answers' values (None: as decoded)."""

    rows: list[tuple[Group, object]]
    warnings: list[str]
    request: object
    route: Route | None = None

    def values(self, decoded: list) -> list:
        return decoded if self.route is None else [self.route.respond(text) for text in decoded]


class Service:
    """The routes' state: the model worker (None until loaded), the batcher, the tasks'
    routes, and the route names /metrics counts requests by (path -> name)."""

    def __init__(self, *, batcher: Batcher, metrics: ServeMetrics, options: HttpOptions):
        self.batcher = batcher
        self.metrics = metrics
        self.options = options
        self.worker: ModelWorker | None = None
        self.tasks = TaskRoutes()
        self.route_names: dict[str, str] = {}

    def ready(self, worker: ModelWorker) -> None:
        self.worker = worker
        self.metrics.watch_programs(lambda: worker.program_count)
        self.metrics.ready.set(1)

    # --- checking and tokenizing (in the thread pool) ----------------------------------------

    def _worker(self) -> ModelWorker:
        if self.worker is None:
            raise NotReady
        return self.worker

    def _limits(self, worker: ModelWorker) -> payloads.Limits:
        return payloads.Limits(
            max_instances=self.options.max_instances,
            max_length=worker.max_target_length,
            vocab_size=worker.vocab_size,
            adapters=worker.adapter_names,
        )

    def _encoded(self, texts, *, limit: int, what: str, first: int, warnings: list) -> list:
        """Each text's ids; an overlong one is cut with a warning, or refused ('error')."""
        worker = self._worker()
        encoded = []
        for index, text in enumerate(texts, start=first):
            ids = worker.encode(text, limit)
            if ids.truncated:
                message = f"instances[{index}] {what} has {ids.tokens} tokens, above the {limit}"
                if self.options.truncation == "error":
                    raise PayloadError(f"{message} the model takes; shorten it")
                warnings.append(f"{message} the model takes: truncated")
                self.metrics.truncated.inc()
            encoded.append(ids)
        return encoded

    def _inputs(self, texts, request, where: str) -> tuple[list[str], Route | None]:
        """The model inputs of a request's texts: in the words of its "task" (a task offering
        the predict route) if it names one, then shaped as the model's (or its adapter's) run
        shaped its training inputs unless "exact_inputs"."""
        route = self.tasks.formatting(request.task, where)
        if route is not None:
            texts = self.tasks.prompts(route, [{INPUT: text} for text in texts])
        runs = self._worker().runs
        return runs.model_inputs(texts, adapter=request.adapter, exact=request.exact_inputs), route

    def prepare_predict(self, body: bytes) -> _Prepared:
        worker = self._worker()
        request = payloads.predict_request(
            payloads.parse_json(body), defaults=worker.runs.defaults, limits=self._limits(worker)
        )
        texts, route = self._inputs(request.texts, request, "/v1/predict")
        warnings: list[str] = []
        limit = worker.runs.input_length(request.adapter)
        encoded = self._encoded(texts, limit=limit, what="input", first=0, warnings=warnings)
        rows = _decode_rows(worker, encoded, request.decoding, request.adapter)
        return _Prepared(rows, warnings, request, route)

    def prepare_score(self, body: bytes) -> _Prepared:
        worker = self._worker()
        request = payloads.score_request(payloads.parse_json(body), limits=self._limits(worker))
        formatted, _ = self._inputs(request.inputs, request, "/v1/score")
        warnings: list[str] = []
        limits = {
            "input": worker.runs.input_length(request.adapter),
            "target": worker.runs.defaults(request.adapter).max_new_tokens,
        }
        inputs, targets = (
            self._encoded(texts, limit=limits[what], what=what, first=0, warnings=warnings)
            for texts, what in ((formatted, "input"), (request.targets, "target"))
        )
        rows = [
            (Group.for_scoring(worker.input_bucket(a.ids), request.adapter), ScoreRow(a.ids, b.ids))
            for a, b in zip(inputs, targets, strict=True)
        ]
        return _Prepared(rows, warnings, request)

    def prepare_task(self, name: str, body: bytes) -> _Prepared:
        """A task route's request: checked against the route's fields, its prompts made by the
        task, tokenized."""
        worker = self._worker()
        offers = self.tasks.offers(name, "POST")
        self.route_names.setdefault(f"/v1/{name}", name)
        request = payloads.task_request(
            offers,
            payloads.parse_json(body),
            defaults=worker.runs.defaults,
            limits=self._limits(worker),
            model_tasks=worker.runs.tasks,
        )
        prompts = worker.runs.model_inputs(
            self.tasks.prompts(request.route, request.instances),
            adapter=request.adapter,
            exact=request.exact_inputs,
        )
        warnings: list[str] = []
        limit = worker.runs.input_length(request.adapter)
        encoded = self._encoded(prompts, limit=limit, what="prompt", first=0, warnings=warnings)
        rows = _decode_rows(worker, encoded, request.decoding, request.adapter)
        return _Prepared(rows, warnings, request, request.route)

    # --- the routes ------------------------------------------------------------------------

    async def predict(self, request: Request) -> Response:
        prepared = await run_in_threadpool(self.prepare_predict, await self._body(request))
        if prepared.request.stream:
            return self._streamed(prepared)
        texts = prepared.values(await _results(request, self.batcher.submit(prepared.rows)))
        n_best = prepared.request.decoding.num_return_sequences > 1  # lists of {prediction, score}
        if prepared.request.objects and not n_best:
            texts = [{"prediction": text} for text in texts]
        return _reply(texts, prepared.warnings)

    def _streamed(self, prepared: _Prepared) -> Response:
        """The prepared rows queued with a listener each, answered as server-sent events
        (streams.py); a full queue is still a 503, before the stream starts."""
        queue = streams.Events()
        listeners = queue.listeners(len(prepared.rows), decode=self._worker().vocabulary.decode)
        rows = [
            (dataclasses.replace(group, streams=True), dataclasses.replace(row, tag=listener))
            for (group, row), listener in zip(prepared.rows, listeners, strict=True)
        ]
        futures = self.batcher.submit(rows)
        self.metrics.streams_open.inc()

        def ended(outcome: str) -> None:
            self.metrics.streams_open.dec()
            self.metrics.streams.labels(outcome=outcome).inc()

        body = streams.sent(
            queue, futures=futures, rows=listeners, warnings=prepared.warnings, ended=ended
        )
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        return StreamingResponse(body, media_type="text/event-stream", headers=headers)

    async def score(self, request: Request) -> Response:
        prepared = await run_in_threadpool(self.prepare_score, await self._body(request))
        scores = await _results(request, self.batcher.submit(prepared.rows))
        return _reply([{"score": score} for score in scores], prepared.warnings)

    async def task(self, request: Request) -> Response:
        name = request.path_params["name"]
        prepared = await run_in_threadpool(self.prepare_task, name, await self._body(request))
        values = prepared.values(await _results(request, self.batcher.submit(prepared.rows)))
        return _reply([{name: value} for value in values], prepared.warnings)

    async def health(self, request: Request) -> Response:
        if self.worker is None:
            return JSONResponse({"status": "loading"}, 503, headers={"Retry-After": RETRY_AFTER})
        names = self.worker.adapter_names
        return JSONResponse({"status": "ready", **({"adapters": list(names)} if names else {})})

    async def metrics_text(self, request: Request) -> Response:
        return Response(self.metrics.exposition(), media_type=CONTENT_TYPE)

    async def _body(self, request: Request) -> bytes:
        """The body, refused with a 413 as soon as it is known to pass the bound."""
        limit = self.options.max_body_bytes
        too_large = PayloadError(
            f"the body is larger than {limit} bytes; send fewer instances per request", 413
        )
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_large
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)


def _decode_rows(
    worker: ModelWorker, encoded: list, decoding: DecodingSettings, adapter: str | None
) -> list:
    """(group, row) pairs of inputs to decode; row i samples from its index i, with the
    request's own values (its group's batches hold rows of any)."""
    own = worker.row_settings(decoding)
    return [
        (
            Group.for_decoding(decoding, worker.input_bucket(ids.ids), adapter),
            Row(ids=ids.ids, index=i, seed=decoding.seed, settings=own),
        )
        for i, ids in enumerate(encoded)
    ]


def _reply(predictions: list, warnings: list[str]) -> JSONResponse:
    body = {"predictions": predictions}
    if warnings:
        body["warnings"] = warnings
    return JSONResponse(body)


def _error(status: int, message: str, headers: dict | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status, headers=headers)


async def _disconnected(request: Request) -> None:
    """Returns once the client has closed the connection (its body was read already, so the
    only message left to receive is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _results(request: Request, futures: list) -> list:
    """The futures' results, in order; ClientGone (and the futures cancelled, so queued rows
    are dropped) if the client leaves first."""
    waiting = asyncio.gather(*(asyncio.wrap_future(future) for future in futures))
    gone = asyncio.ensure_future(_disconnected(request))
    done = set()
    try:
        done, _ = await asyncio.wait({waiting, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not waiting.done():
            for future in futures:
                future.cancel()  # rows not yet taken by the worker are dropped
            waiting.cancel()
            # Its outcome is of no interest now; retrieving it keeps asyncio from logging it.
            waiting.add_done_callback(lambda f: f.cancelled() or f.exception())
    if waiting not in done:
        raise ClientGone
    return waiting.result()


def _guarded(handler):
    """`handler`, its failures answered as one-line JSON errors with their status."""

    async def endpoint(request: Request) -> Response:
        try:
            return await handler(request)
        except PayloadError as e:
            return _error(e.status, str(e))
        except NotReady:
            message = "the model is still loading; retry once GET /health answers 200"
            return _error(503, message, {"Retry-After": RETRY_AFTER})
        except QueueFull as e:
            return _error(503, f"the server is busy ({e}); retry", {"Retry-After": RETRY_AFTER})
        except Stopped as e:
            return _error(503, str(e))
        except (ClientGone, ClientDisconnect):
            return Response(status_code=CLIENT_GONE)
        except BatchFailed as e:  # the batcher printed its traceback
            return _error(500, f"the model failed: {e}")
        except Exception as e:  # a bug: answered in one line, its traceback printed
            traceback.print_exc()
            return _error(500, f"internal error: {type(e).__name__}: {one_line_message(e)}")

    return endpoint


async def _http_error(request: Request, error: HTTPException) -> Response:
    """Starlette's own refusals (404 unknown path, 405 wrong method) in the same JSON shape."""
    message = f"{error.detail}: {request.method} {request.url.path}"
    return _error(error.status_code, message, error.headers)


async def _uncaught(request: Request, error: Exception) -> Response:
    """A bug outside the routes' handlers (in a middleware): Starlette prints its traceback."""
    return _error(500, f"internal error: {type(error).__name__}: {one_line_message(error)}")


def routes(service: Service) -> dict[str, tuple[str, str, object]]:
    """path -> (route name for /metrics, method, handler). The tasks' routes come last, after
    the server's own paths: /v1/{name} is looked up in the tasks' list at request time."""
    table = {path: ("predict", "POST", service.predict) for path in service.options.predict_routes}
    table["/v1/score"] = ("score", "POST", service.score)
    for path in service.options.health_routes:
        table[path] = ("health", "GET", service.health)
    table["/metrics"] = ("metrics", "GET", service.metrics_text)
    table[TASK_ROUTES] = ("other", "POST", service.task)
    return table


def build_app(*, service: Service, lifespan, guard: GuardOptions) -> Starlette:
    """The routes, behind the guard's refusals (key, Content-Type, in flight), all counted."""
    table = routes(service)
    service.route_names.update({path: name for path, (name, _, _) in table.items()})
    return Starlette(
        routes=[
            Path(path, _guarded(handler), methods=[method])
            for path, (_, method, handler) in table.items()
        ],
        middleware=[
            Middleware(MetricsMiddleware, metrics=service.metrics, route_names=service.route_names),
            Middleware(Guard, options=guard),
        ],
        exception_handlers={HTTPException: _http_error, Exception: _uncaught},
        lifespan=lifespan,
    )
