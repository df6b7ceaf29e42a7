"""The user's own TSV or JSONL files as a seqio task, configured from gin alone.

configs/runs/text_to_text.gin binds `text_to_text` to the macros TRAIN_FILES, VALIDATION_FILES,
TEST_FILES, TEXT_TASK_NAME, INPUT_PREFIX and TEXT_METRICS; data/text_files.py reads the rows.
Nothing is registered unless some files are bound. The files are read when the task is first
registered (after gin is parsed, before anything is compiled; again only if they change), so a
malformed row, a missing or binary file ends the run in one line before any work; with
`text_to_text.skip_malformed = True` malformed rows are left out with one warning saying how
many.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Sequence

import gin
from etils import epath
from t5tpu.tasks import metrics, registry, serving

from t5tpu.data import text_files
from t5tpu.errors import UserError
from t5tpu.runtime.lazy_imports import seqio, tf
from t5tpu.storage import remote

METRICS = {
    "accuracy": metrics.accuracy,
    "exact_match": metrics.exact_match,
    "f1": metrics.token_f1,
    "bleu": metrics.bleu,
    "rouge": metrics.rouge,
}
# The macro that names each split's files, for messages.
SPLIT_SETTINGS = {"train": "TRAIN_FILES", "validation": "VALIDATION_FILES", "test": "TEST_FILES"}


@dataclasses.dataclass(frozen=True)
class TextTask:
    name: str
    files: dict[str, str | Sequence[str]]  # split -> file patterns
    input_prefix: str
    input_field: str
    target_field: str
    metric_names: tuple[str, ...]
    skip_malformed: bool


@gin.configurable
def text_to_text(
    name: str = "text_to_text",
    train_files: str | Sequence[str] | None = None,
    validation_files: str | Sequence[str] | None = None,
    test_files: str | Sequence[str] | None = None,
    input_prefix: str = "",
    input_field: str = "input",
    target_field: str = "target",
    metric_names: Sequence[str] = ("exact_match",),
    skip_malformed: bool = False,
) -> TextTask | None:
    """The task gin describes; None when no files are bound (the run uses another task)."""
    given = {"train": train_files, "validation": validation_files, "test": test_files}
    files = {split: patterns for split, patterns in given.items() if patterns}
    if not files:
        return None
    unknown = [m for m in metric_names if m not in METRICS]
    if unknown:
        raise UserError(f"TEXT_METRICS: unknown metric {unknown[0]!r}; choose from {list(METRICS)}")
    return TextTask(
        name=name,
        files=files,
        input_prefix=input_prefix,
        input_field=input_field,
        target_field=target_field,
        metric_names=tuple(metric_names),
        skip_malformed=skip_malformed,
    )


# The rows last read, by (files, their sizes and modification times, fields): a process
# registers its tasks more than once (infer for the model and again for its data, the Python
# API at every helper call), and a large file should be read, and its malformed rows reported,
# once. At most one entry per split is kept.
_ROWS_READ: dict[tuple, text_files.Rows] = {}


def _split_rows(task: TextTask, split: str) -> text_files.Rows:
    setting = SPLIT_SETTINGS[split]
    _check_storage(task.files[split], setting)
    paths = text_files.matching_files(task.files[split], setting)
    stats = [epath.Path(path).stat() for path in paths]
    key = (split, task.input_field, task.target_field, task.skip_malformed) + tuple(
        (path, stat.length, stat.mtime) for path, stat in zip(paths, stats, strict=True)
    )
    if key not in _ROWS_READ:
        rows = text_files.read_rows(paths, task.input_field, task.target_field)
        _check_rows(rows, task, setting, paths)
        for old in [k for k in _ROWS_READ if k[0] == split]:
            del _ROWS_READ[old]
        _ROWS_READ[key] = rows
    return _ROWS_READ[key]


def _check_storage(patterns: str | Sequence[str], setting: str) -> None:
    """The bucket of each gs:// pattern, asked within the storage answer time before the files
    are listed and read (through epath, whose client would retry a silent storage for long)."""
    if isinstance(patterns, str):
        patterns = patterns.split(",")
    for pattern in patterns:
        remote.check_storage(pattern.strip(), setting)


def _check_rows(rows: text_files.Rows, task: TextTask, setting: str, paths: list[str]) -> None:
    """Refuses malformed rows (or warns once, leaving them out, with skip_malformed) and files
    with no examples."""
    if rows.malformed:
        count = f"{rows.malformed} of {rows.malformed + len(rows.inputs)} rows"
        if not task.skip_malformed:
            raise UserError(
                f"{setting}: {count} malformed, first {rows.first_problem}; fix them, or set "
                "text_to_text.skip_malformed = True to leave them out"
            )
        print(
            f"t5tpu: warning: {setting}: left out {count} (first {rows.first_problem})",
            file=sys.stderr,
        )
    if not rows.inputs:
        raise UserError(f"{setting}: no examples in {', '.join(paths)}")


def model_input(text: str, prefix: str) -> str:
    """The model input this task makes of an input: INPUT_PREFIX before it. Training makes its
    inputs with this function, and every front end with a raw input of a model trained on this
    task (tasks/shaping.py), so both are shaped alike."""
    return prefix + text


def _source(rows_by_split: dict[str, text_files.Rows], prefix: str) -> seqio.FunctionDataSource:
    def dataset(split: str, shuffle_files: bool, seed: int | None = None) -> tf.data.Dataset:
        del shuffle_files, seed  # the rows are in memory; the Task shuffles examples itself
        rows = rows_by_split[split]
        inputs = [model_input(text, prefix) for text in rows.inputs]
        return tf.data.Dataset.from_tensor_slices({"inputs": inputs, "targets": rows.targets})

    counts = {split: len(rows.inputs) for split, rows in rows_by_split.items()}
    return seqio.FunctionDataSource(dataset, splits=list(counts), num_input_examples=counts)


def strip_output(output: str, example: dict | None = None, is_target: bool = False) -> str:
    del example, is_target
    return output.strip()


def register(vocabulary: seqio.Vocabulary) -> list[str]:
    """Registers the gin-described task with `vocabulary`; [] when no files are bound."""
    task = text_to_text()
    if task is None:
        return []
    rows = {split: _split_rows(task, split) for split in task.files}
    registry.add_text_task(
        task.name,
        source=_source(rows, task.input_prefix),
        vocabulary=vocabulary,
        preprocessors=[],
        postprocess_fn=strip_output,
        metric_fns=[METRICS[name] for name in task.metric_names],
    )
    return [task.name]


def routes() -> tuple[serving.Route, ...]:
    """None: /v1/predict and /v1/score put INPUT_PREFIX before a model's inputs when the model's
    run trained on this task, from its run record (tasks/shaping.py), with no route."""
    return ()
