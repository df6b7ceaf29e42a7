"""The HTTP connections' limits, below the routes: how long a client may take over a request's
head and body, how large a head may be, and which connection goes when too many are open.

uvicorn's httptools protocol (its choice when httptools is installed, and the fastest) times out
only a keep-alive connection after an answer, and takes heads of any size; its h11 protocol
bounds a head's size but times out no slow client either. This subclass adds, per connection:

- the request's head (request line and headers) within `header_timeout_s` of the connection's
  start, or of the next request's first byte; its body within `body_timeout_s` of the head's
  end; idle after an answer, uvicorn's own `timeout_keep_alive`. Past one: 408 and closed (a
  connection that sent nothing is just closed).
- a head over `max_header_bytes` or with more than `max_headers` headers: 431 and closed, as
  soon as the bytes received say so: a held head costs the limit and a read or two at most.
- past `max_connections` open, the connection waiting longest on its client (idle, or sending
  its head or body) is closed; one whose request is being answered never is.

Its refusals, uvicorn's 400 for a request that is not HTTP included, are {"error": ...} JSON
with Connection: close, as the routes answer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from typing import ClassVar

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol


@dataclasses.dataclass(frozen=True)
class ConnectionLimits:
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keep_alive_timeout_s: float = 5.0  # uvicorn's timeout_keep_alive
    max_header_bytes: int = 16384  # h11's bound on a head; gunicorn's is 8190 a header
    max_headers: int = 100  # gunicorn's limit_request_fields


# Seconds a refused connection is still read (and its bytes dropped) before it is closed.
LINGER_S = 2.0


class _HeadTooLarge(Exception):
    """Raised in a parser callback: httptools stops parsing and re-raises it as the context."""


def protocol_class(limits: ConnectionLimits, max_connections: int) -> type[HttpToolsProtocol]:
    """The protocol class for uvicorn's Config(http=...): its connections share one registry of
    those waiting on their client, so each server built has its own."""
    shared = {"limits": limits, "max_connections": max_connections, "waiting": {}}
    return type("LimitedHttpProtocol", (LimitedHttpProtocol,), shared)


def refusal(status: int, message: str, default_headers=()) -> bytes:
    """A whole HTTP answer {"error": message}, the connection closed after it."""
    body = json.dumps({"error": message}).encode()
    head = [STATUS_LINE[status]]
    head += [name + b": " + value + b"\r\n" for name, value in default_headers]
    head += [
        b"content-type: application/json\r\n",
        b"content-length: %d\r\n" % len(body),
        b"connection: close\r\n\r\n",
    ]
    return b"".join(head) + body


class LimitedHttpProtocol(HttpToolsProtocol):
    limits: ClassVar[ConnectionLimits]
    max_connections: ClassVar[int]
    waiting: ClassVar[dict]  # connections waiting on their client, the longest-waiting first

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.deadline: asyncio.TimerHandle | None = None
        self.in_head = True  # the bytes that come next are a request's head
        self.began = False  # a byte of that head has come
        self.heads = 0  # heads parsed so far
        self.head_bytes = 0  # bytes of reads that held nothing but the current head
        self.parsed_bytes = 0  # the current head's URL and headers parsed so far
        self.headers_seen = 0
        self.refused = False  # answered with a refusal: nothing more is read

    # --- the connection's life ---------------------------------------------------------------

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm(self.limits.header_timeout_s)
        self.waiting[self] = None
        if len(self.connections) > self.max_connections:
            oldest = next((c for c in self.waiting if c is not self), None)
            if oldest is not None:
                del self.waiting[oldest]
                oldest.transport.close()

    def connection_lost(self, exc) -> None:
        self.waiting.pop(self, None)
        self._disarm()
        super().connection_lost(exc)

    def _note_wait(self) -> None:
        """Noted as a request begins, ends and is answered: a connection is evicted only while
        it waits on its client (not while its whole request is being answered), and a fresh
        wait goes to the back of the line."""
        cycle = self.cycle
        answering = cycle is not None and not cycle.more_body and not cycle.response_complete
        self.waiting.pop(self, None)
        if not answering:
            self.waiting[self] = None

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self.deadline = self.loop.call_later(seconds, self._timed_out)

    def _disarm(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    def _timed_out(self) -> None:
        self.deadline = None
        if self.transport.is_closing():
            return
        if self.in_head and self.began:
            seconds = self.limits.header_timeout_s
            self._refuse(408, f"the request's headers took over {seconds:g} s; send them at once")
        elif not self.in_head and not (self.cycle and self.cycle.response_started):
            seconds = self.limits.body_timeout_s
            self._refuse(408, f"the request's body took over {seconds:g} s; send it at once")
        else:
            self.transport.close()

    def _refuse(self, status: int, message: str) -> None:
        """Answers and half-closes, then reads and drops what the client still sends, for a
        while: closing with unread bytes would reset the connection, and the client could lose
        the answer before reading it (nginx's lingering close)."""
        self.transport.write(refusal(status, message, self.server_state.default_headers))
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True  # the app's request ends; its answer goes nowhere
            self.cycle.message_event.set()
        self.refused = True
        self._note_wait()
        self.flow.resume_reading()
        self.transport.write_eof()
        self._disarm()
        self.deadline = self.loop.call_later(LINGER_S, self.transport.close)

    # --- bytes in ----------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        """uvicorn's, but for the head limits: 431, where any parser error is its 400."""
        if self.refused:
            return  # lingering: dropped
        self._unset_keepalive_if_required()
        whole_head, heads = self.in_head and self.began, self.heads
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            # A callback's exception comes back as this error, the exception its context.
            if isinstance(e.__context__, _HeadTooLarge):
                self._refuse(431, str(e.__context__))
            else:
                self._refuse(400, f"the bytes sent are not an HTTP/1.1 request ({e})")
            return
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        if whole_head and self.in_head and self.heads == heads:
            self.head_bytes += len(data)  # httptools holds a header until its end: count reads
            if self.head_bytes > self.limits.max_header_bytes:
                self._refuse(431, self._too_large())
        elif not self.in_head and self.deadline is None:
            # The head has come and the body has not, all of it: armed here, after the read,
            # not at the head's end, so a request whole in one read arms no timer for it.
            self._arm(self.limits.body_timeout_s)

    def _too_large(self) -> str:
        return (
            f"the request's head is over {self.limits.max_header_bytes} bytes (URL and headers); "
            "send shorter headers"
        )

    def _count(self, size: int) -> None:
        self.parsed_bytes += size
        if self.parsed_bytes > self.limits.max_header_bytes:
            raise _HeadTooLarge(self._too_large())

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.began = True
        self.head_bytes = self.parsed_bytes = self.headers_seen = 0
        self._note_wait()
        if self.deadline is None:  # a keep-alive connection's next request
            self._arm(self.limits.header_timeout_s)

    def on_url(self, url: bytes) -> None:
        self._count(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers_seen += 1
        if self.headers_seen > self.limits.max_headers:
            limit = self.limits.max_headers
            raise _HeadTooLarge(f"the request has over {limit} headers; send fewer")
        self._count(len(name) + len(value) + 4)
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self.in_head, self.heads = False, self.heads + 1
        self._disarm()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self.in_head, self.began = True, False
        self._disarm()
        super().on_message_complete()
        self._note_wait()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._note_wait()  # idle, its body still coming, or a pipelined request's turn
