"""How a raw input becomes a model input, as the task a model was trained on made its inputs,
and the run record that carries it (storage/run_record.py) made at the start of training.

Each task owns one function that makes its model inputs, which its training preprocessing
calls: text_to_text's `model_input` (INPUT_PREFIX before the input), Quora's `model_input`
(questions lower-cased, double quotes dropped, unless the run bound normalize_questions off).
SQuAD's inputs, and a user's own seqio tasks', are taken as given. `shape` calls the same
function for every raw input that reaches a model through `t5tpu infer`, `t5tpu.load`'s
predict and score, or `t5tpu serve`; `exact_inputs` (the one switch, named alike in gin, the
API and serve) passes inputs to the model as they are.
"""

from __future__ import annotations

from t5tpu.tasks import quora, text_to_text

from t5tpu.model.decoding_settings import DecodingSettings
from t5tpu.runtime.lazy_imports import seqio
from t5tpu.storage import run_record
from t5tpu.storage.run_record import InputShaping, RunRecord


def shape(shaping: InputShaping, text: str) -> str:
    """`text` as the model's training task made its inputs."""
    if shaping.kind == run_record.PREFIX:
        return text_to_text.model_input(text, shaping.prefix)
    if shaping.kind == run_record.QUORA:
        return quora.model_input(text, shaping.normalize)
    return text


def describe(shaping: InputShaping) -> str:
    """What `shape` does, in a few words for a command's output."""
    if shaping.kind == run_record.PREFIX:
        return f"INPUT_PREFIX {shaping.prefix!r} put before each input"
    if shaping.kind == run_record.QUORA:
        if not shaping.normalize:
            return "taken as given (the run did not normalize its questions)"
        return "questions lower-cased and double quotes dropped, as the Quora tasks train"
    return "taken as given"


def for_task(task_name: str | None) -> InputShaping:
    """The shaping that the gin-described task (or mixture) `task_name` applies in training;
    reads gin only (nothing registered, no data read)."""
    text_task = text_to_text.text_to_text()
    if text_task is not None and task_name == text_task.name:
        if not text_task.input_prefix:
            return InputShaping()
        return InputShaping(run_record.PREFIX, prefix=text_task.input_prefix)
    if task_name and quora.tasks_of(task_name):
        return InputShaping(run_record.QUORA, normalize=quora.normalize_questions())
    return InputShaping()


def tasks_of(task_name: str | None) -> tuple[str, ...]:
    """The tasks a run of `task_name` trains on: a mixture's (registered by then), else the
    task itself."""
    if not task_name:
        return ()
    known = quora.tasks_of(task_name)
    if known:
        return known
    try:
        found = seqio.get_mixture_or_task(task_name)
    except ValueError:  # not registered in this process: the name is all there is to go on
        return (task_name,)
    return tuple(task.name for task in getattr(found, "tasks", [found]))


def record_for_run(
    task_name: str | None,
    lengths: tuple[int, int],
    decoding: DecodingSettings,
    tasks: tuple[str, ...] | None = None,
) -> RunRecord:
    """The record a training run saves with its checkpoints, from the parsed gin files; `tasks`
    when known already (a prepared file's), else tasks_of(task_name)."""
    return RunRecord(
        task=task_name,
        tasks=tasks_of(task_name) if tasks is None else tasks,
        input_length=lengths[0],
        target_length=lengths[1],
        shaping=for_task(task_name),
        decoding=decoding,
    )
