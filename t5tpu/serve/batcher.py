"""Dynamic batching: rows queued by many requests, run together by one worker thread.

Requests put rows (one per instance) on a bounded queue and get a future per row. Each row has
a group: rows that one compiled program can run together (for a model: the same kind of work,
the same decoding settings, the same padded input length). The worker takes the oldest row's
group, waits up to `max_wait_s` from that row's arrival for more of it, then runs up to
`max_batch_size` of its rows in one call. While a batch runs, new rows queue
up, so under load the wait is spent decoding, not sleeping.

A row whose future was cancelled (its client went away) before its batch started is dropped
unrun; the others' batch is unchanged. A batch that raises fails its rows' futures only. Nothing
here knows about models or HTTP: `run_batch` does the work.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import threading
import time
import traceback
from collections.abc import Callable, Hashable, Sequence


class QueueFull(Exception):
    """The queue cannot take a request's rows now; the client should retry later."""


class Stopped(Exception):
    """The server is shutting down (or never got its model) and takes no more rows."""


class BatchFailed(Exception):
    """`run_batch` raised on the batch a row was in (the cause is chained, and printed once)."""


@dataclasses.dataclass(frozen=True)
class BatchLimits:
    """max_batch_size rows per call, max_wait_s for batch mates, max_queue rows waiting."""

    max_batch_size: int
    max_wait_s: float
    max_queue: int


@dataclasses.dataclass
class _Row:
    item: object
    future: concurrent.futures.Future
    arrived: float


class Batcher:
    """The queue and its worker loop (`serve`, run in the one thread that calls the model)."""

    def __init__(
        self,
        *,
        limits: BatchLimits,
        on_batch: Callable[[Hashable, int, float], None] = lambda group, rows, seconds: None,
    ):
        self.limits = limits
        self._on_batch = on_batch
        self._ready = threading.Condition()
        self._groups: dict[Hashable, collections.deque[_Row]] = {}
        self._count = 0
        self._stopping = False
        self._failure: Exception | None = None

    @property
    def depth(self) -> int:
        """Rows waiting (those of clients that went away included until the worker drops them)."""
        return self._count

    def submit(self, rows: Sequence[tuple[Hashable, object]]) -> list[concurrent.futures.Future]:
        """Queues (group, item) rows, all or none; a future per row. Thread-safe."""
        with self._ready:
            if self._failure is not None or self._stopping:
                raise Stopped("the server is shutting down")
            if self._count + len(rows) > self.limits.max_queue:
                raise QueueFull(
                    f"{self._count} rows are queued; {len(rows)} more would pass the bound of "
                    f"{self.limits.max_queue}"
                )
            now = time.monotonic()
            queued = []
            for group, item in rows:
                row = _Row(item, concurrent.futures.Future(), now)
                self._groups.setdefault(group, collections.deque()).append(row)
                queued.append(row)
            self._count += len(queued)
            self._ready.notify()
        return [row.future for row in queued]

    def serve(self, run_batch: Callable[[Hashable, list], list]) -> None:
        """Runs batches in this thread until `stop` was called and the queue is empty."""
        while (batch := self._next_batch()) is not None:
            group, rows = batch
            if rows:
                self._run(run_batch, group, rows)

    def stop(self) -> None:
        """No more rows are taken; `serve` returns once the queued ones are done."""
        with self._ready:
            self._stopping = True
            self._ready.notify_all()

    def fail(self, error: Exception) -> None:
        """The worker cannot run (its model failed to load): queued and later rows fail."""
        with self._ready:
            self._failure = error
            groups, self._groups, self._count = self._groups, {}, 0
        for rows in groups.values():
            for row in rows:
                if row.future.set_running_or_notify_cancel():
                    row.future.set_exception(Stopped(f"the model could not be loaded: {error}"))

    def _next_batch(self) -> tuple[Hashable, list[_Row]] | None:
        """The next group and its rows (empty when all were cancelled); None once stopped and
        empty. Waits while nothing is queued, or while the oldest group is short of a full batch
        and its first row is younger than max_wait_s."""
        with self._ready:
            while True:
                if not self._count:
                    if self._stopping:
                        return None
                    self._ready.wait()
                    continue
                group, rows = min(self._groups.items(), key=lambda kv: kv[1][0].arrived)
                wait = rows[0].arrived + self.limits.max_wait_s - time.monotonic()
                if len(rows) >= self.limits.max_batch_size or wait <= 0 or self._stopping:
                    return group, self._take(group)
                self._ready.wait(wait)

    def _take(self, group: Hashable) -> list[_Row]:
        """Up to max_batch_size of the group's rows, oldest first, without the cancelled ones
        (whose futures can no longer be cancelled once taken)."""
        queue = self._groups[group]
        taken = []
        while queue and len(taken) < self.limits.max_batch_size:
            row = queue.popleft()
            self._count -= 1
            if row.future.set_running_or_notify_cancel():
                taken.append(row)
        if not queue:
            del self._groups[group]
        return taken

    def _run(self, run_batch: Callable, group: Hashable, rows: list[_Row]) -> None:
        start = time.perf_counter()
        try:
            results = run_batch(group, [row.item for row in rows])
            if len(results) != len(rows):
                raise RuntimeError(f"{len(results)} results for {len(rows)} rows")
        except Exception as error:  # the batch's requests fail; the worker goes on
            traceback.print_exc()
            lines = str(error).strip().splitlines() or [""]
            for row in rows:
                failure = BatchFailed(f"{type(error).__name__}: {lines[0]}".rstrip(": "))
                failure.__cause__ = error
                row.future.set_exception(failure)
            return
        finally:
            self._on_batch(group, len(rows), time.perf_counter() - start)
        for row, result in zip(rows, results, strict=True):
            row.future.set_result(result)
