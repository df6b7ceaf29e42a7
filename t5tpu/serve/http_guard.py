"""The refusals before the routes, as ASGI middleware: a request beyond the requests in flight
(503), {"error": ...} JSON.

The health routes are never refused as busy: an orchestrator probing them must not take a
loaded server for a dead one.
"""

from __future__ import annotations

import dataclasses

from starlette.responses import JSONResponse

# Seconds a busy server asks a client to wait (as the routes' queue-full 503 does).
RETRY_AFTER = "1"


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
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1
