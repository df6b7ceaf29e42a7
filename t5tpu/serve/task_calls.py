"""The task routes (/v1/is_duplicate, /v1/similar_question, /v1/answer): the tasks' own
functions (`quora.is_duplicate`, `quora.similar_question`, `squad.answer`), called with a model
whose `predict` queues its prompt on the batcher, so their prompts and post-processing are
exactly the tasks' and their decoding is batched with everyone else's.

The task functions build prompts with the registered seqio tasks, which they register again on
every call: two threads doing that at once would see each other's half-registered tasks. So
task calls hold one lock, and release it only while their prompt waits for the model; prompts
are built one at a time, and their decoding still overlaps.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
from collections.abc import Callable

from t5tpu.serve.payloads import Decoding, TaskRequest

# (texts, decoding, index of the first text in its request) -> (a future per text giving its
# decoded text, warnings about the texts): the server's way of queueing decode rows.
QueuePrompts = Callable[
    [list[str], Decoding, int], tuple[list[concurrent.futures.Future], list[str]]
]


@dataclasses.dataclass(frozen=True)
class TaskAnswer:
    """A task function's result for one instance, and the warnings its prompt raised."""

    value: object
    warnings: tuple[str, ...]


class _QueuedModel:
    """registry.TextModel for one task call: `predict` queues the prompts and waits, holding
    the task lock again when it returns (the task function goes on under it)."""

    def __init__(
        self, *, queue: QueuePrompts, lock: threading.Lock, decoding: Decoding, index: int
    ):
        self._queue = queue
        self._lock = lock
        self._decoding = decoding
        self._index = index
        self.warnings: list[str] = []

    def predict(self, inputs: list[str], **settings) -> list[str]:
        decoding = dataclasses.replace(self._decoding, **settings)
        self._lock.release()
        try:
            futures, warnings = self._queue(list(inputs), decoding, self._index)
            texts = [future.result() for future in futures]
        finally:
            self._lock.acquire()
        self.warnings += warnings
        return texts


def _call(request: TaskRequest, fields: tuple[str, ...], model: _QueuedModel):
    """The task function of the request's route, on one instance."""
    # Imported here: the tasks import seqio and TensorFlow, which the rest of the server
    # does not need.
    from t5tpu.tasks import quora, squad

    if request.route == "is_duplicate":  # decodes as the function says, from the defaults
        return quora.is_duplicate(model, *fields)
    settings = request.decoding.as_settings()
    if request.route == "similar_question":
        return quora.similar_question(model, *fields, **settings)
    return squad.answer(model, *fields, task=request.squad_task, **settings)


class TaskRunner:
    """Runs task calls in a pool of threads (they mostly wait for the model)."""

    def __init__(self, *, queue: QueuePrompts, threads: int):
        self._queue = queue
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=threads, thread_name_prefix="t5tpu-task"
        )

    def start(self, request: TaskRequest) -> list[concurrent.futures.Future]:
        """A future per instance, giving its TaskAnswer."""
        return [
            self._pool.submit(self._answer, request, fields, index)
            for index, fields in enumerate(request.instances)
        ]

    def _answer(self, request: TaskRequest, fields: tuple[str, ...], index: int) -> TaskAnswer:
        model = _QueuedModel(
            queue=self._queue,
            lock=self._lock,
            decoding=request.decoding,
            index=index,
        )
        with self._lock:
            value = _call(request, fields, model)
        return TaskAnswer(value=value, warnings=tuple(model.warnings))

    def warm_up(self) -> None:
        """Registers the tasks and builds one prompt (TensorFlow's first graphs take seconds),
        so that the first request does not wait for it."""
        from t5tpu.tasks import quora

        with self._lock:
            quora.is_duplicate_prompt("warm up", "warm up")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
