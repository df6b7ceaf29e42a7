"""Dynamic batching: rows queued by many requests, run together by one worker thread.

Requests put rows (one per instance) on a bounded queue and get a future per row. Each row has
a group: rows that one compiled program can run together (for a model: the same kind of work,
the same decoding settings, the same padded input length, the same LoRA adapter). The worker
takes the oldest row's group, waits up to `max_wait_s` from that row's arrival for more of it,
then runs the group (one whose programs compile apart waits for them, others running
meanwhile): `run_group(group, feed)` takes rows from the group's queue through the
feed as it has room for them (a continuous batch takes new rows while others are still
decoding) and answers each row when it is done. A group keeps taking rows until another group's
oldest row has waited `max_wait_s` or a second (_HOLD_S), whichever is longer, so one busy group
cannot starve the others.

A row whose future was cancelled (its client went away) before it was taken is dropped unrun.
A `run_group` that raises fails the rows it took and did not answer, and no others. Nothing
here knows about models or HTTP.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import threading
import time
import traceback
from collections.abc import Callable, Hashable, Sequence

# How long a running group may keep taking new rows while another group's rows wait: switching
# groups drains the running batch, whose last rows then decode in a batch of few.
_HOLD_S = 1.0


class QueueFull(Exception):
    """The queue cannot take a request's rows now; the client should retry later."""


class Stopped(Exception):
    """The server is shutting down (or never got its model) and takes no more rows."""


class BatchFailed(Exception):
    """`run_group` raised on the group a row was in (the cause is chained, and printed once)."""


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
        on_rows: Callable[[Hashable, int], None] = lambda group, rows: None,
        on_run: Callable[[Hashable, float], None] = lambda group, seconds: None,
    ):
        self.limits = limits
        # Rows are counted when taken, before any is answered; a group's time when it ends.
        self._on_rows, self._on_run = on_rows, on_run
        self._ready = threading.Condition()
        self._groups: dict[Hashable, collections.deque[_Row]] = {}
        self._count = 0
        self._stopping = False
        self._failure: Exception | None = None
        self._is_ready: Callable[[Hashable, Callable[[], None]], bool] = lambda group, wake: True

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

    def serve(
        self,
        run_group: Callable[[Hashable, GroupFeed], None],
        *,
        ready: Callable[[Hashable, Callable[[], None]], bool] = lambda group, wake: True,
    ) -> None:
        """Runs groups in this thread until `stop` was called and the queue is empty. A group
        runs once `ready(group, wake)` says so: one that is not (its programs compile apart)
        waits, others run, and `wake()` says when to ask again."""
        self._is_ready = ready
        while (group := self._next_group()) is not None:
            self._run(run_group, group)

    def wake(self) -> None:
        """Ask `ready` again: a group's programs are compiled."""
        with self._ready:
            self._ready.notify_all()

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

    def _next_group(self) -> Hashable | None:
        """The group to run next; None once stopped and empty. Waits while nothing is queued,
        or while the oldest group is short of a full batch and its first row is younger than
        max_wait_s."""
        with self._ready:
            while True:
                if not self._count:
                    if self._stopping:
                        return None
                    self._ready.wait()
                    continue
                waiting = self._ready_groups()
                if not waiting:
                    self._ready.wait()
                    continue
                group, rows = min(waiting.items(), key=lambda kv: kv[1][0].arrived)
                wait = rows[0].arrived + self.limits.max_wait_s - time.monotonic()
                if len(rows) >= self.limits.max_batch_size or wait <= 0 or self._stopping:
                    return group
                self._ready.wait(wait)

    def _take(self, group: Hashable, count: int, *, first: bool) -> list[_Row]:
        """Up to `count` of the group's rows, oldest first, without the cancelled ones (whose
        futures can no longer be cancelled once taken). After the first take, none while
        another group's oldest row has waited max_wait_s or _HOLD_S."""
        with self._ready:
            queue = self._groups.get(group)
            if not queue or (not first and self._others_waited(group)):
                return []
            taken = []
            while queue and len(taken) < count:
                row = queue.popleft()
                self._count -= 1
                if row.future.set_running_or_notify_cancel():
                    taken.append(row)
            if not queue:
                del self._groups[group]
        if taken:
            self._on_rows(group, len(taken))
        return taken

    def _ready_groups(self) -> dict[Hashable, collections.deque[_Row]]:
        return {g: rows for g, rows in self._groups.items() if self._is_ready(g, self.wake)}

    def _others_waited(self, group: Hashable) -> bool:
        oldest = time.monotonic() - max(self.limits.max_wait_s, _HOLD_S)
        waiting = self._ready_groups().items()
        return any(rows[0].arrived <= oldest for g, rows in waiting if g != group)

    def _run(self, run_group: Callable, group: Hashable) -> None:
        feed = GroupFeed(self, group)
        start = time.perf_counter()
        try:
            run_group(group, feed)
            if feed.unanswered:
                raise RuntimeError(f"{len(feed.unanswered)} rows were taken and not answered")
        except Exception as error:  # the group's requests fail; the worker goes on
            traceback.print_exc()
            lines = str(error).strip().splitlines() or [""]
            for row in feed.unanswered:
                failure = BatchFailed(f"{type(error).__name__}: {lines[0]}".rstrip(": "))
                failure.__cause__ = error
                row.future.set_exception(failure)
        finally:
            if feed.taken:
                self._on_run(group, time.perf_counter() - start)


class GroupFeed:
    """The worker's hold on one group's queue while it runs it: `take` rows that wait now
    (never blocks), `answer` each one taken."""

    def __init__(self, batcher: Batcher, group: Hashable):
        self._batcher, self._group = batcher, group
        self.taken = 0
        self._unanswered: dict[int, _Row] = {}

    @property
    def unanswered(self) -> list[_Row]:
        return list(self._unanswered.values())

    def take(self, count: int) -> list[_Row]:
        rows = self._batcher._take(self._group, count, first=not self.taken)
        self.taken += len(rows)
        self._unanswered.update((id(row), row) for row in rows)
        return rows

    def answer(self, row: _Row, result) -> None:
        del self._unanswered[id(row)]
        row.future.set_result(result)
