"""The refusals before the routes, as ASGI middleware: a request beyond the requests in flight
(503), and the requests still running when a shutdown's drain time is spent (503), each
{"error": ...} JSON.

The health routes are never refused as busy: an orchestrator probing them must not take a
loaded server for a dead one.
"""

from __future__ import annotations

import asyncio
import dataclasses

from starlette.responses import JSONResponse

# Seconds a busy server asks a client to wait (as the routes' queue-full 503 does).
RETRY_AFTER = "1"
SHUTTING_DOWN = (
    "the server is shutting down and stopped waiting for this request's answer "
    "(--shutdown_timeout passed, or a second signal came); retry it elsewhere or once it is back"
)


@dataclasses.dataclass(frozen=True)
class GuardOptions:
    max_in_flight: int
    open_paths: frozenset[str]  # the health routes


class Guard:
    def __init__(self, app, *, options: GuardOptions):
        self.app = app
        self.options = options
        self.in_flight = 0

    def _refusal(self, scope) -> JSONResponse | None:
        if scope["path"] in self.options.open_paths:
            return None
        if self.in_flight >= self.options.max_in_flight:
            message = f"the server is busy ({self.options.max_in_flight} requests in flight); retry"
            return JSONResponse({"error": message}, 503, {"Retry-After": RETRY_AFTER})
        return None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._refusal(scope)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        started = False

        async def noting(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        self.in_flight += 1
        try:
            await self.app(scope, receive, noting)
        except asyncio.CancelledError:
            # uvicorn cancels the requests still running once --shutdown_timeout is spent (and
            # asyncio the rest when a second signal cuts the drain short): this answer is the
            # request's last act, so the cancellation ends here instead of in a traceback.
            if not started:
                await JSONResponse({"error": SHUTTING_DOWN}, 503)(scope, receive, send)
        finally:
            self.in_flight -= 1
