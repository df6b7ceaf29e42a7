"""A run's input prepared where TensorFlow is, for a machine without it (a GPU image with jax and
numpy alone): `t5tpu prepare-data` (runners/prepare_data.py) writes the training batches, exactly
those the seqio pipeline feeds and in its order, and the eval split's examples into one .npz
file; `t5tpu train` and `t5tpu eval` read it when PREPARED_DATA names it, and then import neither
seqio nor TensorFlow.

The file, read by numpy without pickle:
  train/<feature>          (batches, BATCH_SIZE, length) int32: the feature converter's batches
  eval/<i>/inputs|targets  each example's ids, concatenated, with eval/<i>/input|target_lengths
  record                   JSON text: the batches' settings (task, lengths, batch size, seed,
                           packing), the run record's tasks, the eval split, and per eval task
                           its name, metric and postprocessing functions (import names) and each
                           example's texts and the target its metrics compare.
"""

from __future__ import annotations

import dataclasses
import io
import json
import zipfile
import zlib
from typing import Any

import numpy as np

from t5tpu import validators
from t5tpu.errors import UserError
from t5tpu.storage import atomic_files, user_files

FORMAT = "t5tpu prepared data 1"
SETTING = "PREPARED_DATA"
# The macro that sets each of BatchSettings' fields, named when a run's differs from the file's.
MACROS = {
    "task": "MIXTURE_OR_TASK_NAME",
    "lengths": "TASK_FEATURE_LENGTHS",
    "batch_size": "BATCH_SIZE",
    "seed": "RANDOM_SEED",
    "packing": "USE_PACKING",
}


@dataclasses.dataclass(frozen=True)
class BatchSettings:
    """What the training batches depend on: a run with other settings would see other ones."""

    task: str
    lengths: dict  # {'inputs': n, 'targets': m}
    batch_size: int
    seed: int
    packing: bool


@dataclasses.dataclass(frozen=True)
class EvalExample:
    """One eval example: the ids the model gets and scores, the texts the examples file shows,
    and `reference`, the postprocessed target the task's metrics compare."""

    inputs: tuple[int, ...]
    targets: tuple[int, ...]
    input_text: str
    target_text: str
    reference: Any


@dataclasses.dataclass(frozen=True)
class EvalTask:
    name: str
    metric_fns: tuple[str, ...]  # "module:function", each (targets, predictions) -> dict
    postprocess_fn: str | None
    examples: tuple[EvalExample, ...]


@dataclasses.dataclass(frozen=True)
class PreparedData:
    settings: BatchSettings
    tasks: tuple[str, ...]  # the run record's
    batches: dict[str, np.ndarray]
    eval_split: str
    eval_num_examples: int | None
    eval_tasks: tuple[EvalTask, ...]
    path: str = ""  # where it was read from, named in messages

    @property
    def num_batches(self) -> int:
        return len(next(iter(self.batches.values())))


def _ragged(rows) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.array([len(r) for r in rows], np.int32)
    flat = np.array([i for r in rows for i in r], np.int32)
    return flat, lengths


def write(path: str, data: PreparedData) -> None:
    """Writes `data` to `path`, replacing it whole (storage.atomic_files)."""
    arrays = {f"train/{name}": np.asarray(a, np.int32) for name, a in data.batches.items()}
    tasks = []
    for i, task in enumerate(data.eval_tasks):
        for part in ("inputs", "targets"):
            flat, lengths = _ragged([getattr(ex, part) for ex in task.examples])
            arrays[f"eval/{i}/{part}"], arrays[f"eval/{i}/{part[:-1]}_lengths"] = flat, lengths
        texts = [[ex.input_text, ex.target_text, ex.reference] for ex in task.examples]
        tasks.append(
            {"name": task.name, "metric_fns": list(task.metric_fns)}
            | {"postprocess_fn": task.postprocess_fn, "texts": texts}
        )
    record = {
        "format": FORMAT,
        "settings": dataclasses.asdict(data.settings),
        "tasks": list(data.tasks),
        "eval": {"split": data.eval_split, "num_examples": data.eval_num_examples, "tasks": tasks},
    }
    arrays["record"] = np.array(json.dumps(record))
    buffer = io.BytesIO()
    np.savez_compressed(buffer, **arrays)
    atomic_files.write_atomically(path, buffer.getvalue(), setting=SETTING)


def _damaged(path: str, why: str) -> UserError:
    return UserError(
        f"{SETTING}: {path} is not a file `t5tpu prepare-data` wrote ({why[:200]}); write it "
        "again with `t5tpu prepare-data` and this run's gin files"
    )


def read(path: str) -> PreparedData:
    """The data of `path`, its shapes checked against its record; refused in one line when it
    is missing or damaged."""
    raw = user_files.read_bytes(path, what=SETTING)
    try:
        with np.load(io.BytesIO(raw), allow_pickle=False) as npz:
            arrays = {name: npz[name] for name in npz.files}
        record = json.loads(str(arrays.pop("record")))
        if record.get("format") != FORMAT:
            raise ValueError(f"format {str(record.get('format'))[:40]!r}, not {FORMAT!r}")
        data = _parsed(record, arrays)
        _check_shapes(data, path)
    # A damaged zip, a record that is not the one written (AttributeError: a list for a dict).
    except (
        zipfile.BadZipFile,
        zlib.error,
        EOFError,
        ValueError,
        KeyError,
        TypeError,
        AttributeError,
    ) as e:
        raise _damaged(path, f"{type(e).__name__}: {e}") from None
    return dataclasses.replace(data, path=path)


def _parsed(record: dict, arrays: dict) -> PreparedData:
    settings = BatchSettings(**record["settings"])
    evals = record["eval"]
    tasks = []
    for i, task in enumerate(evals["tasks"]):
        ids = {}
        for part in ("inputs", "targets"):
            flat, lengths = arrays[f"eval/{i}/{part}"], arrays[f"eval/{i}/{part[:-1]}_lengths"]
            if int(lengths.sum()) != len(flat) or len(lengths) != len(task["texts"]):
                raise ValueError(f"eval task {i}'s {part} do not add up")
            ends = np.cumsum(lengths)
            ids[part] = [
                tuple(flat[e - n : e].tolist()) for e, n in zip(ends, lengths, strict=True)
            ]
        examples = tuple(
            EvalExample(inputs, targets, str(text[0]), str(text[1]), text[2])
            for inputs, targets, text in zip(
                ids["inputs"], ids["targets"], task["texts"], strict=True
            )
        )
        tasks.append(
            EvalTask(task["name"], tuple(task["metric_fns"]), task["postprocess_fn"], examples)
        )
    batches = {name[len("train/") :]: a for name, a in arrays.items() if name.startswith("train/")}
    return PreparedData(
        settings,
        tuple(record["tasks"]),
        batches,
        evals["split"],
        evals["num_examples"],
        tuple(tasks),
    )


def _check_shapes(data: PreparedData, path: str) -> None:
    """Every batch array is (batches, batch size, its feature's length); the lengths counts."""
    lengths, size = data.settings.lengths, data.settings.batch_size
    if not data.batches or not all(validators.is_whole(n, low=1) for n in lengths.values()):
        raise _damaged(path, "no batches or no lengths")
    for name, array in data.batches.items():
        length = lengths["inputs"] if name.startswith("encoder_") else lengths["targets"]
        wanted = (data.num_batches, size, length)
        if array.shape != wanted or array.dtype != np.int32:
            raise _damaged(path, f"train/{name} is {array.dtype}{list(array.shape)}, not {wanted}")


def check_settings(data: PreparedData, run: BatchSettings) -> None:
    """The run's settings are those the batches were made with, else one line naming the first
    that differs: other settings would train on other batches."""
    made = dataclasses.asdict(data.settings)
    for name, value in dataclasses.asdict(run).items():
        if name == "lengths":
            value = {key: int(n) for key, n in dict(value).items()}
        if value != made[name]:
            macro = MACROS[name]
            raise UserError(
                f"{SETTING}: {data.path} holds batches made with {macro}={made[name]!r}, this "
                f"run has {macro}={value!r}; set {macro} to the file's or run `t5tpu prepare-data` "
                "again with this run's settings"
            )


def check_eval(data: PreparedData, *, split: str, num_examples: int | None) -> None:
    """The evaluation asked for is the one prepared: its split and number of examples."""
    for macro, asked, made in (
        ("EVAL_SPLIT", split, data.eval_split),
        ("EVAL_NUM_EXAMPLES", num_examples, data.eval_num_examples),
    ):
        if asked != made:
            raise UserError(
                f"{SETTING}: {data.path} holds the eval examples of {macro}={made!r}, this run "
                f"asks {macro}={asked!r}; set {macro} to the file's or run `t5tpu prepare-data` "
                "again"
            )


class PreparedStream:
    """The training batches from a prepared file, as pipeline.InputStream gives them: the next
    one is the step's, whose position is the step itself (save and restore write nothing)."""

    def __init__(self, batches: dict[str, np.ndarray], first: int):
        self._batches = batches
        self._next = first

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        batch = {name: array[self._next] for name, array in self._batches.items()}
        self._next += 1
        return batch

    def skip(self, batches: int) -> None:
        self._next += batches

    def save(self, prefix: str) -> None:
        del prefix  # a resume skips to its step's batch: nothing to save

    def restore(self, prefix: str) -> None:
        del prefix


def stream(data: PreparedData, *, skip: int, needed: int) -> PreparedStream:
    """The stream from batch `skip` on, after checking that the file holds the `needed` batches
    the run trains on (from its first)."""
    if needed > data.num_batches:
        raise UserError(
            f"{SETTING}: {data.path} holds {data.num_batches} batches, this run trains on "
            f"{needed}; run `t5tpu prepare-data` with TRAIN_STEPS={needed} or lower TRAIN_STEPS"
        )
    return PreparedStream(data.batches, skip)
