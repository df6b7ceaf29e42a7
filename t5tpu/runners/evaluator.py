"""TaskEvaluator: a task's seqio metrics for given parameters, recorded in MODEL_DIR.

`t5tpu eval` runs it for the checkpoints it restores and `t5tpu train` between steps
(EVAL_PERIOD). Metrics go to TensorBoard (MODEL_DIR/eval) and to MODEL_DIR/eval_metrics.json
(or the same names in EVAL_OUTPUT_DIR), which maps step -> task -> metric (and the task's
num_examples); a new evaluation of a task at a step replaces that task's entry and keeps every
other. Splits other than 'validation' are kept apart (storage.model_dir.eval_run).
"""

from __future__ import annotations

import json
import re
import time

import jax
import numpy as np
from etils import epath

from t5tpu.data import batches, pipeline
from t5tpu.errors import UserError
from t5tpu.model import decoding
from t5tpu.model.encoder_decoder import EncoderDecoderModel
from t5tpu.partitioning import Partitioner
from t5tpu.runners import example_progress
from t5tpu.runtime.lazy_imports import seqio, tf
from t5tpu.storage import atomic_files, remote, user_files
from t5tpu.storage import model_dir as paths

# Metrics of thousands of steps and tasks are a few MB; a far larger file is not this one.
MAX_METRICS_BYTES = 64 << 20

# What moves the results elsewhere, named when they cannot be written (MODEL_DIR too).
OUTPUT_SETTING = "EVAL_OUTPUT_DIR"


def recorded_metrics(path: str) -> dict:
    """{step: {task: metrics}} as written so far; {} before the first evaluation. A file that
    is not one is refused in one line, never replaced: it holds every earlier result."""
    what = "eval metrics"
    if not remote.answered(epath.Path(path).exists, path=path, setting=what):
        return {}
    recorded = user_files.read_json(path, what=what, max_bytes=MAX_METRICS_BYTES)
    for step, tasks in recorded.items():
        if not re.fullmatch(r"[0-9]{1,18}", step):
            problem = f"step {step[:40]!r} is not a number"
        elif not isinstance(tasks, dict) or not all(isinstance(m, dict) for m in tasks.values()):
            problem = f"step {step} is not {{task: {{metric: value}}}}"
        else:
            continue
        raise UserError(
            f"{what}: {path} is not the file t5tpu writes ({problem}); move it away (a new one "
            "is written) or restore it"
        )
    return recorded


def _scalars(metrics: dict) -> dict:
    """A task's metrics without the ones that are not numbers (a metric function may return
    texts or histograms too)."""
    return {name: value for name, value in metrics.items() if np.ndim(value) == 0}


class TaskEvaluator:
    """Runs a task's (or mixture's) seqio metrics for given parameters and records them."""

    def __init__(
        self,
        *,
        model: EncoderDecoderModel,
        task_name: str,
        task_feature_lengths,
        split: str,
        batch_size: int,
        partitioner: Partitioner,
        param_shardings,
        model_dir: str,
        num_examples: int | None = None,
        settings: decoding.DecodingSettings,
        output_dir: str | None = None,
    ):
        """Results go to `output_dir` (EVAL_OUTPUT_DIR), laid out as MODEL_DIR, or else to
        `model_dir`."""
        self.batch_size = batch_size
        self.metrics_file = paths.eval_metrics(output_dir or model_dir, split)
        recorded_metrics(self.metrics_file)  # a damaged file is refused before any work
        self.summaries_dir = paths.eval_summaries(output_dir or model_dir, split)
        self._writer = None
        target_length = pipeline.model_lengths(task_feature_lengths)[1]
        self.evaluator = _seqio_evaluator(task_name, task_feature_lengths, split, num_examples)
        self.batch_sharding = partitioner.batch_sharding()
        # Every host reads the whole eval set and needs every result: replicated outputs.
        with_sharding = dict(
            in_shardings=(param_shardings, self.batch_sharding),
            out_shardings=partitioner.replicated(),
        )
        self._predict = partitioner.jit(
            lambda p, b: model.predict(p, b, target_length, settings=settings), **with_sharding
        )
        self._score = partitioner.jit(model.score, **with_sharding)

    @property
    def writer(self):
        # Made with the first results: a writer makes its event file at once, and a run that
        # fails before any result (an unreadable checkpoint) must leave nothing behind.
        if self._writer is None:
            # clu's writers import TensorFlow: imported here, not when gin files are parsed.
            from t5tpu.storage import summaries

            self._writer = summaries.writer(
                self.summaries_dir, just_logging=jax.process_index() > 0, setting=OUTPUT_SETTING
            )
        return self._writer

    def _run(self, ds: tf.data.Dataset, fn, params, *, step: int, what: str) -> list:
        """fn's output for every example of `ds`, with a progress line on a long split."""
        results = []
        total = int(ds.cardinality())
        progress = example_progress.ExampleProgress(
            f"eval step {step} ({what})", total=total if total >= 0 else None
        )
        for indices, features in batches.padded_batches(ds, self.batch_size):
            real = len(indices)
            batch = batches.full_batch_to_global(
                {k: v for k, v in features.items() if k.startswith(("encoder_", "decoder_"))},
                self.batch_sharding,
            )
            out = np.asarray(jax.device_get(fn(params, batch)))[:real]
            results.extend(zip(indices.tolist(), out.tolist(), strict=True))
            progress.add(real)
        return results

    def __call__(self, params, step: int) -> dict:
        start = time.time()
        future, _ = self.evaluator.evaluate(
            compute_metrics=jax.process_index() == 0,
            step=step,
            predict_fn=lambda ds: self._run(ds, self._predict, params, step=step, what="decode"),
            score_fn=lambda ds: self._run(ds, self._score, params, step=step, what="score"),
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
        self.writer.write_scalars(
            step,
            {
                f"{task}/{name}": value
                for task, values in metrics.items()
                for name, value in _scalars(values).items()
            },
        )
        self.writer.flush()
        # A folder where the file goes is found here first, while reading it.
        with atomic_files.write_faults(self.metrics_file, OUTPUT_SETTING):
            recorded = recorded_metrics(self.metrics_file)
        datasets = self.evaluator.cached_task_datasets
        recorded.setdefault(str(step), {}).update(
            {
                task: {name: float(v) for name, v in _scalars(values).items()}
                | {"num_examples": int(datasets[task].cardinality())}
                for task, values in metrics.items()
            }
        )
        text = json.dumps(recorded, indent=2, sort_keys=True)
        atomic_files.write_atomically(self.metrics_file, text, setting=OUTPUT_SETTING)


def _seqio_evaluator(
    task_name: str, task_feature_lengths, split: str, num_examples: int | None
) -> seqio.Evaluator:
    evaluator = seqio.Evaluator(
        task_name,
        pipeline.feature_converter(pack=False),
        eval_split=split,
        sequence_length=dict(task_feature_lengths),
        num_examples=num_examples,
        logger_cls=(),
    )
    if not evaluator.eval_tasks:
        raise UserError(
            f"nothing to evaluate: no task of {task_name!r} has a {split!r} split and "
            "metrics; set EVAL_SPLIT to a split the task has"
        )
    return evaluator
