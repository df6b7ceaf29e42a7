"""`t5tpu eval`: restore checkpoints and compute the task's metrics with seqio's Evaluator.

Metrics go to TensorBoard (MODEL_DIR/eval) and to MODEL_DIR/eval_metrics.json, which maps
step -> task -> metric (and the task's num_examples); a new evaluation of a task at a step
replaces that task's entry and keeps every other. Splits other than 'validation' are kept apart,
in MODEL_DIR/eval_<split> and eval_<split>_metrics.json (runners/evaluator.py writes them).
EVAL_OUTPUT_DIR puts these files and eval_config.gin in another folder, for a MODEL_DIR that is
read-only (runners/results_dir.py); the config is written with the first metrics.
PREPARED_DATA evaluates a `t5tpu prepare-data` file's examples instead, without seqio or
TensorFlow (runners/prepared_eval.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterable

import jax
import numpy as np
from jax.experimental import multihost_utils

from t5tpu import validators
from t5tpu.config import gin_setup, runner_settings
from t5tpu.data import availability, prepared
from t5tpu.errors import UserError
from t5tpu.model import decoding_settings, param_shapes
from t5tpu.model.encoder_decoder import EncoderDecoderModel
from t5tpu.partitioning import Partitioner
from t5tpu.runners import prepared_eval, results_dir, run_lengths, train
from t5tpu.runners.evaluator import TaskEvaluator, recorded_metrics
from t5tpu.storage import checkpoints
from t5tpu.storage import model_dir as paths
from t5tpu.tasks import registry

CONTINUOUS = "continuous"


def _newest_evaluated(output_dir: str, split: str) -> int | None:
    """The newest step in this split's metrics file: continuous eval goes on after it."""
    recorded = recorded_metrics(paths.eval_metrics(output_dir, split))
    return max(map(int, recorded), default=None)


def _last_train_step() -> int | None:
    """TRAIN_STEPS when the experiment trains too (its finetune.gin) and counts it absolutely:
    continuous eval stops after that checkpoint."""
    bound = runner_settings.bound_settings(train.train, runner_settings.TrainSteps)
    if not validators.is_whole(bound.train_steps) or bound.relative_steps:
        return None
    return bound.train_steps


def _check_waits(poll_seconds: float, wait_seconds: float) -> None:
    validators.number(above=0).check("evaluate.poll_seconds", poll_seconds)
    validators.number(low=0).check("evaluate.wait_seconds", wait_seconds)


def _steps_as_they_appear(
    model_dir: str, output_dir: str, split: str, poll_seconds: float, wait_seconds: float
) -> Iterable[int]:
    """CHECKPOINT_STEP = 'continuous': each checkpoint after the newest step evaluated into
    `output_dir`, as training writes it."""
    _check_waits(poll_seconds, wait_seconds)
    after = _newest_evaluated(output_dir, split)
    steps = checkpoints.follow_steps(
        model_dir, after, _last_train_step(), poll_seconds, wait_seconds
    )
    print(f"evaluating each checkpoint after step {after or 0} as it appears", flush=True)
    return steps


def _checked_steps(model_dir: str, checkpoint_step: int | str, params_shape) -> list[int]:
    """The steps CHECKPOINT_STEP names, each checked against the model's geometry before
    anything is written."""
    from t5tpu.formats import loader  # TensorFlow's importers: not at gin parsing

    steps = checkpoints.steps_to_restore(model_dir, checkpoint_step)
    for step in steps:
        loader.in_model_dir(model_dir, step).check_geometry(params_shape)
    return steps


def _lengths(told: dict | None, model_dir: str, steps: list[int] | None) -> dict:
    """TASK_FEATURE_LENGTHS, else the lengths the newest of `steps` was trained with (its run
    record; continuous eval, whose steps are yet to come, needs them told)."""
    from t5tpu.formats import loader

    record = loader.in_model_dir(model_dir, max(steps)).run_record() if steps else None
    lengths = run_lengths.chosen(
        told, record, setting="TASK_FEATURE_LENGTHS", say=print, default=None
    )
    return {"inputs": lengths[0], "targets": lengths[1]}


def _restored(model_dir: str, step: int, params_shape, shardings, continuous: bool):
    """The parameters of checkpoint `step`, or None when continuous eval finds it deleted
    (KEEP_CHECKPOINTS) before it could read it."""
    from t5tpu.formats import loader

    try:
        checkpoint = loader.in_model_dir(model_dir, step)
        if continuous:  # the other modes check every step before anything is written
            checkpoint.check_geometry(params_shape)
        return checkpoint.load(params_shape, shardings)
    except Exception:
        if continuous and not checkpoints.params_readable(model_dir, step):
            return None
        raise


def _skipped_on_any_host(skipped: bool) -> bool:
    # Hosts that disagree would run different programs and hang; restore has no host sync.
    return bool(np.any(multihost_utils.process_allgather(np.asarray(skipped))))


def _checked_task(
    name: str, module: str | None, split: str, num_examples: int | None, path: str | None
) -> prepared.PreparedData | None:
    """The prepared file's data when PREPARED_DATA names one (of this task, split and number of
    examples), else None once the task's split is found readable."""
    if not path:
        registry.get_task(name, module)
        availability.check_readable(name, split, "EVAL_SPLIT")
        return None
    found = prepared.read(path)
    if found.settings.task != name:
        raise UserError(
            f"PREPARED_DATA: {path} holds task {found.settings.task!r}, this run evaluates "
            f"MIXTURE_OR_TASK_NAME={name!r}; prepare that task's data"
        )
    prepared.check_eval(found, split=split, num_examples=num_examples)
    return found


def _evaluator(source: prepared.PreparedData | None, lengths: dict, *, task: dict, **kwargs):
    """TaskEvaluator of the `task`'s split, or the evaluator of the prepared examples, which
    were cut at the lengths they were made with: the run's must be those."""
    if source is None:
        return TaskEvaluator(task_feature_lengths=lengths, **task, **kwargs)
    if {k: int(n) for k, n in lengths.items()} != source.settings.lengths:
        raise UserError(
            f"PREPARED_DATA: {source.path} holds examples of TASK_FEATURE_LENGTHS="
            f"{source.settings.lengths}, this run's are {lengths}; prepare them with these"
        )
    return prepared_eval.PreparedEvaluator(data=source, **kwargs)


def _evaluate_each(
    evaluator: TaskEvaluator | prepared_eval.PreparedEvaluator,
    steps: Iterable[int],
    *,
    model_dir: str,
    params_shape,
    shardings,
    continuous: bool,
    config: str,
) -> dict:
    """{step: metrics} of each checkpoint in `steps`, restored in turn; the operative config
    goes to `config` with the first metrics (a run that fails before them keeps the earlier
    run's)."""
    results = {}
    for step in steps:
        params = _restored(model_dir, step, params_shape, shardings, continuous)
        if continuous and _skipped_on_any_host(params is None):
            name = paths.checkpoint_name(step)
            print(f"{name} was deleted before it was read; skipped", flush=True)
            continue
        results[step] = evaluator(params, step)
        if len(results) == 1:
            results_dir.write_config(config)
        if jax.process_index() == 0:
            print(f"step {step}: {json.dumps(results[step], default=float)}", flush=True)
    return results


@gin_setup.runner
def evaluate(
    *,
    model_dir: str,
    model: EncoderDecoderModel,
    mixture_or_task_name: str,
    task_feature_lengths: dict | None = None,
    batch_size: int = 32,
    checkpoint_step: int | str = "latest",
    split: str = "validation",
    num_examples: int | None = None,
    mixture_or_task_module: str | None = None,
    output_dir: str | None = None,
    partitioner: Partitioner | None = None,
    num_beams: int = 1,
    beam_alpha: float = 0.6,
    length_penalty: float | None = None,
    poll_seconds: float = 30.0,
    wait_seconds: float = 3600.0,
    prepared_data: str | None = None,
) -> dict:
    """Evaluates the checkpoint(s) in MODEL_DIR chosen by CHECKPOINT_STEP: 'latest', a step,
    'all' (every checkpoint, oldest first), or 'continuous': every checkpoint after the newest
    step in the metrics file, then each new one as training writes it (looking every
    `poll_seconds`), until the one at TRAIN_STEPS or `wait_seconds` without a new one.
    Results go to `output_dir` (EVAL_OUTPUT_DIR), else MODEL_DIR. Returns {step: metrics}."""
    partitioner = partitioner or Partitioner()
    partitioner.check_batch_size("EVAL_BATCH_SIZE", batch_size)
    (settings := decoding_settings.of_arguments(locals())).check(model.config.vocab_size)
    output_dir = results_dir.checked_output_dir(model_dir, output_dir, "EVAL_OUTPUT_DIR")
    source = _checked_task(
        mixture_or_task_name, mixture_or_task_module, split, num_examples, prepared_data
    )
    params_shape, shardings = param_shapes.sharded_abstract_params(model.config, partitioner)
    continuous = checkpoint_step == CONTINUOUS
    if continuous:
        steps = _steps_as_they_appear(model_dir, output_dir, split, poll_seconds, wait_seconds)
    else:
        steps = _checked_steps(model_dir, checkpoint_step, params_shape)
    lengths = _lengths(task_feature_lengths, model_dir, None if continuous else steps)
    evaluator = _evaluator(
        source,
        lengths,
        task=dict(task_name=mixture_or_task_name, split=split, num_examples=num_examples),
        model=model,
        batch_size=batch_size,
        partitioner=partitioner,
        param_shardings=shardings,
        model_dir=model_dir,
        output_dir=output_dir,
        settings=settings,
    )
    return _evaluate_each(
        evaluator,
        steps,
        model_dir=model_dir,
        params_shape=params_shape,
        shardings=shardings,
        continuous=continuous,
        config=paths.eval_config(output_dir),
    )
