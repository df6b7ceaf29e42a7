"""`t5tpu prepare-data`: the training batches and eval examples of a run, written into one file
(PREPARED_DATA, data/prepared.py) that `t5tpu train` and `t5tpu eval` read on a machine without
TensorFlow or seqio (a GPU image: scripts/accelerator_check.sh).

It reads the gin files `t5tpu train` reads, and their settings: the first TRAIN_STEPS batches of
the seeded input stream (those a fresh run trains on, exactly as the pipeline feeds them), and
the EVAL_SPLIT examples (EVAL_NUM_EXAMPLES of them) with the targets their metrics compare. A run
from the file is the run from the pipeline, bit for bit, on the same machine.
"""

from __future__ import annotations

import json

import jax
import numpy as np

from t5tpu import validators
from t5tpu.config import gin_setup
from t5tpu.data import availability, pipeline, prepared
from t5tpu.errors import UserError
from t5tpu.partitioning import DataLayout
from t5tpu.runners import evaluator, example_lines, prepared_eval
from t5tpu.runtime.lazy_imports import seqio
from t5tpu.tasks import registry, shaping


def _check_one_host() -> None:
    if jax.process_count() > 1:
        raise UserError("t5tpu prepare-data runs on one host; run it without --num_processes")


def _batches(settings: prepared.BatchSettings, count: int) -> dict[str, np.ndarray]:
    """The first `count` batches of the run's input stream, as one host of one reads them."""
    stream = pipeline.train_batches(
        settings.task,
        settings.lengths,
        settings.batch_size,
        settings.seed,
        settings.packing,
        layout=DataLayout(0, 1, settings.batch_size),
    )
    taken = [next(stream) for _ in range(count)]
    return {name: np.stack([batch[name] for batch in taken]) for name in taken[0]}


def _function_name(fn, *, task: str, what: str) -> str:
    name = prepared_eval.import_name(fn)
    if name is None:
        raise UserError(
            f"task {task!r}'s {what} {fn!r} is not a module-level function, which a prepared "
            "file can only name; evaluate this task where seqio is installed"
        )
    return name


def _references(task: seqio.Task, dataset) -> list[tuple[str, str, object]]:
    """(input text, target text, postprocessed target) of each example, as seqio's metrics
    postprocess the targets (with the example at hand)."""
    vocabulary = task.output_features["targets"].vocabulary
    rows = []
    for ex in dataset.as_numpy_iterator():
        target = ex.get("targets_pretokenized")
        target = vocabulary.decode(ex["targets"].tolist()) if target is None else target
        target = target.decode("utf-8") if isinstance(target, bytes) else target
        reference = target
        if task.postprocessor:
            reference = task.postprocessor(target, example=ex, is_target=True)
        if json.loads(json.dumps(reference, default=str)) != reference:
            raise UserError(
                f"task {task.name!r}'s postprocessed targets are not JSON values, which a "
                "prepared file holds; evaluate this task where seqio is installed"
            )
        inputs = example_lines.plain(ex.get("inputs_pretokenized", b""))
        rows.append((inputs, example_lines.plain(target), reference))
    return rows


def _eval_task(task: seqio.Task, found: seqio.Evaluator) -> prepared.EvalTask:
    if (
        task.score_metric_fns
        or task.predict_with_aux_metric_fns
        or len(task.metric_objs) != len(task.predict_metric_fns)
    ):
        raise UserError(
            f"task {task.name!r} has metrics other than (targets, predictions) functions; a "
            "prepared file holds only what those need: evaluate it where seqio is installed"
        )
    texts = _references(task, found.cached_task_datasets[task.name])
    examples = evaluator.model_examples(found.cached_model_datasets[task.name])
    return prepared.EvalTask(
        name=task.name,
        metric_fns=tuple(
            _function_name(fn, task=task.name, what="metric") for fn in task.predict_metric_fns
        ),
        postprocess_fn=task.postprocessor
        and _function_name(task.postprocessor, task=task.name, what="postprocessor"),
        examples=tuple(
            prepared.EvalExample(ex.inputs, ex.targets, *text)
            for ex, text in zip(examples, texts, strict=True)
        ),
    )


def _eval_tasks(settings: prepared.BatchSettings, *, split: str, num_examples: int | None):
    """The eval examples of every task of the run's that has metrics, as seqio's evaluator
    (runners/evaluator.py) takes them."""
    found = seqio.Evaluator(
        settings.task,
        pipeline.feature_converter(pack=False),
        eval_split=split,
        sequence_length=dict(settings.lengths),
        num_examples=num_examples,
    )
    if not found.eval_tasks:
        raise UserError(
            f"nothing to evaluate: no task of {settings.task!r} has a {split!r} split and "
            "metrics; set EVAL_SPLIT to a split the task has"
        )
    return tuple(_eval_task(task, found) for task in found.eval_tasks)


@gin_setup.runner
def prepare_data(
    *,
    prepared_data: str,
    mixture_or_task_name: str,
    task_feature_lengths: dict,
    train_steps: int,
    batch_size: int,
    mixture_or_task_module: str | None = None,
    use_packing: bool = False,
    random_seed: int = 0,
    eval_split: str = "validation",
    eval_num_examples: int | None = None,
) -> str:
    """Writes PREPARED_DATA: the first TRAIN_STEPS batches and the eval examples (see the module
    docstring); returns its path."""
    validators.whole(low=1).check("TRAIN_STEPS", train_steps, example="300")
    validators.whole(low=1).check("BATCH_SIZE", batch_size, example="32")
    _check_one_host()
    pipeline.model_lengths(task_feature_lengths)  # {'inputs': n, 'targets': m}, else refused
    registry.get_task(mixture_or_task_name, mixture_or_task_module)
    availability.check_readable(mixture_or_task_name, "train")
    availability.check_readable(mixture_or_task_name, eval_split, "EVAL_SPLIT")
    settings = prepared.BatchSettings(
        task=mixture_or_task_name,
        lengths={key: int(n) for key, n in dict(task_feature_lengths).items()},
        batch_size=batch_size,
        seed=random_seed,
        packing=use_packing,
    )
    data = prepared.PreparedData(
        settings=settings,
        tasks=shaping.tasks_of(settings.task),
        batches=_batches(settings, train_steps),
        eval_split=eval_split,
        eval_num_examples=eval_num_examples,
        eval_tasks=_eval_tasks(settings, split=eval_split, num_examples=eval_num_examples),
    )
    prepared.write(prepared_data, data)
    examples = sum(len(task.examples) for task in data.eval_tasks)
    print(
        f"wrote {prepared_data}: {data.num_batches} batches of {batch_size} (TRAIN_STEPS="
        f"{train_steps}) and {examples} {eval_split} examples; train and eval with "
        f"--gin.PREPARED_DATA=\"'{prepared_data}'\" and the same flags, no TensorFlow needed",
        flush=True,
    )
    return prepared_data
