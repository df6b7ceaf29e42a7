"""`t5tpu eval`: restore checkpoints and compute the task's metrics with seqio's Evaluator.

Metrics go to TensorBoard (MODEL_DIR/eval) and to MODEL_DIR/eval_metrics.json, which maps
step -> task -> metric (and the task's num_examples); a new evaluation of a task at a step
replaces that task's entry and keeps every other. Splits other than 'validation' are kept apart,
in MODEL_DIR/eval_<split> and eval_<split>_metrics.json.
"""

from __future__ import annotations

import json
import os
import time

import jax
import numpy as np
import seqio
import tensorflow as tf
from clu import metric_writers
from jax.experimental import multihost_utils

from t5tpu import gin_setup
from t5tpu.data import availability, batches, pipeline, registry
from t5tpu.errors import UserError
from t5tpu.model import decoding
from t5tpu.model.encoder_decoder import EncoderDecoderModel
from t5tpu.partitioning import Partitioner
from t5tpu.storage import checkpoints
from t5tpu.training import trainer


def run_name(split: str) -> str:
    """'eval' for the validation split, else 'eval_<split>': names its TensorBoard directory
    and metrics file, so a quick look at another split never replaces validation results."""
    return "eval" if split == "validation" else f"eval_{split}"


def _metrics_file(model_dir: str, run: str) -> str:
    return os.path.join(model_dir, f"{run}_metrics.json")


def _recorded_metrics(path: str) -> dict:
    """{step: {task: metrics}} as written so far; {} before the first evaluation."""
    if not tf.io.gfile.exists(path):
        return {}
    with tf.io.gfile.GFile(path) as f:
        return json.load(f)


class TaskEvaluator:
    """Runs a task's (or mixture's) seqio metrics for given parameters and records them."""

    def __init__(
        self,
        model: EncoderDecoderModel,
        task_name: str,
        task_feature_lengths,
        split: str,
        batch_size: int,
        partitioner: Partitioner,
        param_shardings,
        model_dir: str,
        num_examples: int | None = None,
        num_beams: int = 1,
        beam_alpha: float = 0.6,
    ):
        self.model = model
        self.batch_size = batch_size
        self.model_dir = model_dir
        self.target_length = pipeline.model_lengths(task_feature_lengths)[1]
        self.evaluator = seqio.Evaluator(
            task_name,
            pipeline.feature_converter(pack=False),
            eval_split=split,
            sequence_length=dict(task_feature_lengths),
            num_examples=num_examples,
            logger_cls=(),
        )
        if not self.evaluator.eval_tasks:
            raise UserError(
                f"nothing to evaluate: no task of {task_name!r} has a {split!r} split and "
                "metrics; set EVAL_SPLIT to a split the task has"
            )
        self.batch_sharding = partitioner.batch_sharding()
        # Every host reads the whole eval set and needs every result: replicated outputs.
        with_sharding = dict(
            in_shardings=(param_shardings, self.batch_sharding),
            out_shardings=partitioner.replicated(),
        )
        self._predict = partitioner.jit(
            lambda p, b: model.predict(
                p,
                b,
                self.target_length,
                settings=decoding.DecodingSettings(num_beams=num_beams, beam_alpha=beam_alpha),
            ),
            **with_sharding,
        )
        self._score = partitioner.jit(model.score, **with_sharding)
        self.name = run_name(split)
        self.writer = metric_writers.create_default_writer(
            os.path.join(model_dir, self.name), just_logging=jax.process_index() > 0
        )

    def _run(self, ds: tf.data.Dataset, fn, params) -> list:
        results = []
        for indices, features in batches.padded_batches(ds, self.batch_size):
            real = len(indices)
            batch = batches.full_batch_to_global(
                {k: v for k, v in features.items() if k.startswith(("encoder_", "decoder_"))},
                self.batch_sharding,
            )
            out = np.asarray(jax.device_get(fn(params, batch)))[:real]
            results.extend(zip(indices.tolist(), out.tolist(), strict=True))
        return results

    def __call__(self, params, step: int) -> dict:
        start = time.time()
        future, _ = self.evaluator.evaluate(
            compute_metrics=jax.process_index() == 0,
            step=step,
            predict_fn=lambda ds: self._run(ds, self._predict, params),
            score_fn=lambda ds: self._run(ds, self._score, params),
        )
        took = f"eval at step {step} ({time.time() - start:.1f}s)"
        if jax.process_index() != 0:  # seqio computes the metrics on process 0 only
            print(f"{took}: done; process 0 has the metrics", flush=True)
            return {}
        metrics = future.result()
        self._record(step, metrics)
        print(f"{took}: {metrics}", flush=True)
        return metrics

    def _record(self, step: int, metrics: dict) -> None:
        scalars = {
            f"{task}/{name}": value
            for task, values in metrics.items()
            for name, value in values.items()
            if np.ndim(value) == 0
        }
        self.writer.write_scalars(step, scalars)
        self.writer.flush()
        path = _metrics_file(self.model_dir, self.name)
        recorded = _recorded_metrics(path)
        datasets = self.evaluator.cached_task_datasets
        recorded.setdefault(str(step), {}).update(
            {
                task: {name: float(v) for name, v in values.items() if np.ndim(v) == 0}
                | {"num_examples": int(datasets[task].cardinality())}
                for task, values in metrics.items()
            }
        )
        _write_atomically(path, json.dumps(recorded, indent=2, sort_keys=True))


def _write_atomically(path: str, text: str) -> None:
    tmp = f"{path}.tmp"
    with tf.io.gfile.GFile(tmp, "w") as f:
        f.write(text)
    tf.io.gfile.rename(tmp, path, overwrite=True)


CONTINUOUS = "continuous"


def _newest_evaluated(model_dir: str, split: str) -> int | None:
    """The newest step in this split's metrics file: continuous eval goes on after it."""
    recorded = _recorded_metrics(_metrics_file(model_dir, run_name(split)))
    return max(map(int, recorded), default=None)


def _last_train_step() -> int | None:
    """TRAIN_STEPS when the experiment trains too (its finetune.gin) and counts it absolutely:
    continuous eval stops after that checkpoint."""
    steps = gin_setup.bound_value("train.train_steps")
    if not isinstance(steps, int) or gin_setup.bound_value("train.relative_steps"):
        return None
    return steps


def _check_waits(poll_seconds: float, wait_seconds: float) -> None:
    if not poll_seconds > 0:
        raise UserError(f"evaluate.poll_seconds = {poll_seconds!r} must be above 0")
    if not wait_seconds >= 0:
        raise UserError(f"evaluate.wait_seconds = {wait_seconds!r} must be 0 or more")


def _restored(model_dir: str, step: int, params_shape, shardings, continuous: bool):
    """The parameters of checkpoint `step`, or None when continuous eval finds it deleted
    (KEEP_CHECKPOINTS) before it could read it."""
    mngr = checkpoints.manager(model_dir, read_only=True)
    try:
        if continuous:  # the other modes check every step before anything is written
            checkpoints.check_geometry(mngr, step, params_shape)
        return checkpoints.restore_params(mngr, step, params_shape, shardings)
    except Exception:
        if continuous and not checkpoints.params_readable(model_dir, step):
            return None
        raise


def _skipped_on_any_host(skipped: bool) -> bool:
    # Hosts that disagree would run different programs and hang; restore has no host sync.
    return bool(np.any(multihost_utils.process_allgather(np.asarray(skipped))))


@gin_setup.runner
def evaluate(
    *,
    model_dir: str,
    model: EncoderDecoderModel,
    mixture_or_task_name: str,
    task_feature_lengths: dict,
    batch_size: int = 32,
    checkpoint_step: int | str = "latest",
    split: str = "validation",
    num_examples: int | None = None,
    mixture_or_task_module: str | None = None,
    partitioner: Partitioner | None = None,
    num_beams: int = 1,
    beam_alpha: float = 0.6,
    poll_seconds: float = 30.0,
    wait_seconds: float = 3600.0,
) -> dict:
    """Evaluates the checkpoint(s) in MODEL_DIR chosen by CHECKPOINT_STEP: 'latest', a step,
    'all' (every checkpoint, oldest first), or 'continuous': every checkpoint after the newest
    step in the metrics file, then each new one as training writes it (looking every
    `poll_seconds`), until the one at TRAIN_STEPS or `wait_seconds` without a new one.
    Returns {step: metrics}."""
    partitioner = partitioner or Partitioner()
    partitioner.check_batch_size("EVAL_BATCH_SIZE", batch_size)
    decoding.DecodingSettings(num_beams=num_beams).check(model.config.vocab_size)
    registry.get_task(mixture_or_task_name, mixture_or_task_module)
    availability.check_readable(mixture_or_task_name, split, "EVAL_SPLIT")
    input_length, target_length = pipeline.model_lengths(task_feature_lengths)
    params_shape, shardings = trainer.abstract_params(
        model, partitioner, input_length, target_length
    )
    continuous = checkpoint_step == CONTINUOUS
    if continuous:
        _check_waits(poll_seconds, wait_seconds)
        after = _newest_evaluated(model_dir, split)
        steps = checkpoints.follow_steps(
            model_dir, after, _last_train_step(), poll_seconds, wait_seconds
        )
        print(f"evaluating each checkpoint after step {after or 0} as it appears", flush=True)
    else:
        steps = checkpoints.steps_to_restore(model_dir, checkpoint_step)
        mngr = checkpoints.manager(model_dir, read_only=True)
        for step in steps:
            checkpoints.check_geometry(mngr, step, params_shape)
    evaluator = TaskEvaluator(
        model,
        mixture_or_task_name,
        task_feature_lengths,
        split,
        batch_size,
        partitioner,
        shardings,
        model_dir,
        num_examples,
        num_beams,
        beam_alpha,
    )
    gin_setup.write_operative_config(model_dir, "eval_config.gin")
    results = {}
    for step in steps:
        params = _restored(model_dir, step, params_shape, shardings, continuous)
        if continuous and _skipped_on_any_host(params is None):
            print(f"checkpoint_{step} was deleted before it was read; skipped", flush=True)
            continue
        results[step] = evaluator(params, step)
        if jax.process_index() == 0:
            print(f"step {step}: {json.dumps(results[step], default=float)}", flush=True)
    return results
