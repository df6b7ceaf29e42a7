"""The refusals before the routes, as ASGI middleware: a request without the API key (401), a
POST whose body is not JSON (415), a request beyond the requests in flight (503), and the
requests still running when a shutdown's drain time is spent (503), each {"error": ...} JSON.

The health routes need no key and are never refused as busy: an orchestrator probing them
must not take a loaded server for a dead one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac

from starlette.responses import JSONResponse

# Seconds a busy server asks a client to wait (as the routes' queue-full 503 does).
RETRY_AFTER = "1"
SHUTTING_DOWN = (
    "the server is shutting down and stopped waiting for this request's answer "
    "(--shutdown_timeout passed, or a second signal came); retry it elsewhere or once it is back"
)


@dataclasses.dataclass(frozen=True)
class GuardOptions:
    api_key: str | None  # None: no key asked
    max_in_flight: int
    open_paths: frozenset[str]  # the health routes


def _header(scope, name: bytes) -> bytes | None:
    return next((value for key, value in scope["headers"] if key == name), None)


def _json(content_type: bytes) -> bool:
    media = content_type.split(b";")[0].strip().lower()
    return media == b"application/json" or (
        media.startswith(b"application/") and media.endswith(b"+json")
    )


class Guard:
    def __init__(self, app, *, options: GuardOptions):
        self.app = app
        self.options = options
        self.key = None if options.api_key is None else options.api_key.encode()
        self.in_flight = 0

    def _refusal(self, scope) -> JSONResponse | None:
        if scope["path"] in self.options.open_paths:
            return None
        if self.key is not None:
            given = _header(scope, b"authorization") or b""
            scheme, _, token = given.partition(b" ")
            # compare_digest's time depends on the lengths alone, never on where bytes differ.
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                message = "missing or wrong API key; send the header Authorization: Bearer KEY"
                return JSONResponse({"error": message}, 401, {"WWW-Authenticate": "Bearer"})
        content_type = _header(scope, b"content-type")
        if scope["method"] == "POST" and content_type is not None and not _json(content_type):
            message = (
                f"the body's Content-Type is {content_type.decode('latin-1')!r}; "
                "send JSON, with Content-Type: application/json"
            )
            return JSONResponse({"error": message}, 415)
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
