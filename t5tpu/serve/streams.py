"""Streamed predictions: /v1/predict with `"stream": true` answers in server-sent events, each
instance's text as it decodes.

    data: {"index": 0, "text": "The"}
    data: {"index": 0, "text": " answer", "prediction": "The answer", "finish_reason": "stop"}
    data: [DONE]

An instance's texts join to its `prediction`, the answer the same request gets unstreamed; its
last event carries it, with "stop" (EOS) or "length". A first event holds the truncation
`warnings`, if any; a failing model ends the stream with {"error": ...}. The model thread hands
each row's ids over after every segment (Listener); the pieces reach the event loop through a
queue. A client that leaves has its rows taken out of their slots at the next segment boundary.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
from collections.abc import AsyncIterator, Callable

from t5tpu.api import streaming


class Listener:
    """One streamed row, between the model thread (`progress`, `finish`) and its request's
    events; `left` once its client has gone."""

    def __init__(self, *, index: int, put: Callable[[dict], None], decode: Callable):
        self.index = index
        self._put = put
        self._deltas = streaming.TextDeltas(decode)
        self.left = False

    def progress(self, ids) -> None:
        """The row's ids so far (in the model thread): its new text, if any, sent."""
        if piece := self._deltas.update(ids):
            self._put({"index": self.index, "text": piece})

    def finish(self, answer: str, reason: str) -> None:
        """The row's whole answer: the rest of its text sent, with the answer."""
        piece = self._deltas.finish(answer)
        self._put(
            {"index": self.index, "text": piece, "prediction": answer, "finish_reason": reason}
        )


class Events:
    """A streamed request's queue of events, filled from any thread, read in the event loop."""

    def __init__(self):
        self._loop, self._queue = asyncio.get_running_loop(), asyncio.Queue()

    def put(self, event: dict) -> None:
        self._loop.call_soon_threadsafe(self._queue.put_nowait, event)

    async def get(self) -> dict:
        return await self._queue.get()

    def listeners(self, count: int, *, decode: Callable) -> list[Listener]:
        return [Listener(index=i, put=self.put, decode=decode) for i in range(count)]

    def watch(self, future: concurrent.futures.Future) -> None:
        """A row that fails has no last event of its own: its error ends the stream."""

        def failed(future: concurrent.futures.Future) -> None:
            if not future.cancelled() and future.exception() is not None:
                self.put({"error": f"the model failed: {future.exception()}"})

        future.add_done_callback(failed)


def _sse(event) -> str:
    return f"data: {event if isinstance(event, str) else json.dumps(event)}\n\n"


async def sent(
    queue: Events,
    *,
    futures: list[concurrent.futures.Future],
    rows: list[Listener],
    warnings: list[str],
    ended: Callable[[str], None],
) -> AsyncIterator[str]:
    """The stream's events until every row has its last one; `ended(outcome)` says how it
    ended: "completed", "failed" (the model raised) or "disconnected" (the rows then leave)."""
    for future in futures:
        queue.watch(future)
    outcome, unfinished = "disconnected", len(rows)
    try:
        if warnings:
            yield _sse({"warnings": warnings})
        while unfinished:
            event = await queue.get()
            yield _sse(event)
            if "error" in event:
                outcome = "failed"
                return
            unfinished -= "prediction" in event
        yield _sse("[DONE]")
        outcome = "completed"
    finally:
        if outcome == "disconnected":
            for row in rows:
                row.left = True
            for future in futures:
                future.cancel()  # rows not yet taken are dropped from the queue
        ended(outcome)
