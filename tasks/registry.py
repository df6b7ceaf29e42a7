"""Which seqio task or mixture a run uses: t5tpu's own (the top-level tasks/ directory, installed
as `t5tpu.tasks`) and the user's module (MIXTURE_OR_TASK_MODULE), looked up by name."""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Callable
from typing import Protocol

import numpy as np

from t5tpu.errors import UserError
from t5tpu.runtime.lazy_imports import seqio, tf


class TextModel(Protocol):
    """What the tasks' helpers ask of a model (t5tpu.api's T5Model, which this layer does not
    import): output text for each input text, shaped as its run shaped its training inputs; the
    tasks it was trained on (its run record's; () when unknown) and where it was loaded from."""

    tasks: tuple[str, ...]
    source: str

    def predict(self, inputs: list[str], **decoding_settings) -> list[str]: ...


def add_text_task(
    name: str, *, source, vocabulary, preprocessors: list, postprocess_fn, metric_fns: list
) -> seqio.Task:
    """(Re-)registers a text-to-text task: `source`, its own `preprocessors` (which make the
    "inputs" and "targets" strings), then tokenizing with `vocabulary`, seqio's cache point and
    EOS after trimming, as every built-in task does."""
    features = {
        key: seqio.Feature(vocabulary=vocabulary, add_eos=True) for key in ("inputs", "targets")
    }
    seqio.TaskRegistry.remove(name)
    return seqio.TaskRegistry.add(
        name,
        source=source,
        output_features=features,
        preprocessors=[
            *preprocessors,
            seqio.preprocessors.tokenize,
            seqio.CacheDatasetPlaceholder(),
            seqio.preprocessors.append_eos_after_trim,
        ],
        postprocess_fn=postprocess_fn,
        metric_fns=metric_fns,
    )


def import_task_module(module: str) -> None:
    """Imports a user module that registers seqio tasks: a dotted module name or a .py path."""
    if module.endswith(".py"):
        if not os.path.exists(module):
            raise UserError(f"task module file not found: {module}; fix MIXTURE_OR_TASK_MODULE")
        spec = importlib.util.spec_from_file_location(os.path.basename(module)[:-3], module)
        loaded = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(loaded)
        return
    try:
        importlib.import_module(module)
    except ModuleNotFoundError as e:
        raise UserError(
            f"cannot import task module {module!r} ({e}); set MIXTURE_OR_TASK_MODULE to an "
            "importable module or a .py file that registers your seqio tasks"
        ) from None


def get_task(name: str, module: str | None = None) -> seqio.Task | seqio.Mixture:
    """The registered task or mixture `name`, after registering t5tpu's own and `module`'s."""
    from t5tpu import tasks  # registers with the gin-bound vocabulary, so only after parsing

    tasks.register_builtin_tasks()
    if module:
        import_task_module(module)
    known = ", ".join(sorted(set(seqio.TaskRegistry.names()) | set(seqio.MixtureRegistry.names())))
    # None when an experiment leaves it unset: infer.gin's default (inference needs no task
    # when given texts), included after finetune.gin and eval.gin, replaces their REQUIRED.
    if not name:
        raise UserError(f"MIXTURE_OR_TASK_NAME is not set; set it to one of: {known}")
    try:
        return seqio.get_mixture_or_task(name)
    except ValueError:
        raise UserError(
            f"unknown task or mixture {name!r}; known: {known}. Set MIXTURE_OR_TASK_NAME, and "
            "MIXTURE_OR_TASK_MODULE to the module that registers it"
        ) from None


def python_text(fn: Callable[..., str], *texts: tf.Tensor) -> tf.Tensor:
    """`fn` (strings in, a string out) on scalar string tensors, inside a tf.data map: a task
    makes its training inputs with the same Python function that every front end calls on a raw
    input, so the two cannot drift apart. Stateless, so an input stream holding it can still save
    its position with a checkpoint."""

    def call(*values: bytes) -> bytes:
        return fn(*(value.decode("utf-8") for value in values)).encode("utf-8")

    return tf.ensure_shape(tf.numpy_function(call, list(texts), tf.string, stateful=False), [])


def with_python_text(
    dataset: tf.data.Dataset,
    fn: Callable[..., str],
    *,
    fields: tuple[str, ...],
    output: str,
    batch: int = 256,
) -> tf.data.Dataset:
    """Each example with `output` = fn(*its `fields`' texts), as python_text makes it, but one
    Python call for `batch` examples: tf.data's threads would otherwise take turns at Python's
    lock an example at a time. The examples' features must be scalars (they are batched)."""

    def call(*columns) -> np.ndarray:
        rows = zip(*(column.tolist() for column in columns), strict=True)
        made = [fn(*(value.decode("utf-8") for value in row)).encode("utf-8") for row in rows]
        return np.array(made, dtype=object)

    def add(examples: dict) -> dict:
        made = tf.numpy_function(
            call, [examples[field] for field in fields], tf.string, stateful=False
        )
        return {**examples, output: tf.ensure_shape(made, examples[fields[0]].shape)}

    batched = dataset.batch(batch).map(add, num_parallel_calls=tf.data.AUTOTUNE)
    return batched.unbatch()
