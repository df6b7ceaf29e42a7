"""Which seqio task or mixture a run uses: t5tpu's own (the top-level tasks/ directory, installed
as `t5tpu.tasks`) and the user's module (MIXTURE_OR_TASK_MODULE), looked up by name."""

from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Protocol

from t5tpu.errors import UserError
from t5tpu.runtime.lazy_imports import seqio, tf


class TextModel(Protocol):
    """What the tasks' helpers ask of a model (t5tpu.api's T5Model, which this layer does not
    import): output text for each input text."""

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


def preprocessed_input(task_name: str, example: dict) -> str:
    """The model input that registered task `task_name` makes of one raw `example`, so the
    tasks' helpers ask a model exactly as it saw inputs in training (seqio keeps the text before
    tokenizing as "inputs_pretokenized")."""
    task = get_task(task_name)
    dataset = task.preprocess_precache(tf.data.Dataset.from_tensors(example))
    (processed,) = list(dataset.as_numpy_iterator())
    return processed["inputs_pretokenized"].decode("utf-8")
