"""TaskEvaluator: a task's seqio metrics for given parameters, recorded in MODEL_DIR.

`t5tpu eval` runs it for the checkpoints it restores and `t5tpu train` between steps
(EVAL_PERIOD). Metrics go to TensorBoard (MODEL_DIR/eval) and to MODEL_DIR/eval_metrics.json
(or the same names in EVAL_OUTPUT_DIR), which maps step -> task -> metric (and the task's
num_examples); a new evaluation of a task at a step replaces that task's entry and keeps every
other. Splits other than 'validation' are kept apart (storage.model_dir.eval_run). Each
example's input, target and prediction goes to eval_examples/<task>-<step>.jsonl beside them
(runners/eval_examples.py), written before the metrics: a step in eval_metrics.json has its
examples.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import time

import jax
import numpy as np
from etils import epath

from t5tpu.data import pipeline
from t5tpu.errors import UserError
from t5tpu.model import decoding_settings, engine
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
        settings: decoding_settings.DecodingSettings,
        output_dir: str | None = None,
    ):
        """Results go to `output_dir` (EVAL_OUTPUT_DIR), laid out as MODEL_DIR, or else to
        `model_dir`."""
        self.batch_size = batch_size
        self.metrics_file = paths.eval_metrics(output_dir or model_dir, split)
        recorded_metrics(self.metrics_file)  # a damaged file is refused before any work
        self.summaries_dir = paths.eval_summaries(output_dir or model_dir, split)
        self._writer = None
        input_length, target_length = pipeline.model_lengths(task_feature_lengths)
        self.evaluator = _seqio_evaluator(
            task_name,
            task_feature_lengths,
            split,
            num_examples,
            results_dir=output_dir or model_dir,
        )
        (self.examples,) = self.evaluator.loggers  # eval_examples.ExamplesLogger, its only one
        self.request = engine.Request(settings, max_length=target_length)
        # The engine that infer and serve decode with; it reads the parameters as each call
        # gives them (training's float32 copy is not cast into a second one).
        self._engine_args = dict(
            model=model,
            param_shardings=param_shardings,
            partitioner=partitioner,
            batch_size=batch_size,
            max_input_length=input_length,
            max_target_length=target_length,
            pinned=self.request,
            cast=False,
        )
        self._engine: engine.Engine | None = None

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

    def _use(self, params) -> engine.Engine:
        self._engine = engine.reused(self._engine, params=params, **self._engine_args)
        return self._engine

    def _decode(self, ds: tf.data.Dataset, *, step: int) -> list:
        """(index, ids) of every example of `ds`, decoded as `t5tpu infer` decodes."""
        return decoded(self._engine, self.request, model_examples(ds), label=f"eval step {step}")

    def _score(self, ds: tf.data.Dataset, *, step: int) -> list:
        """(index, log-likelihood of the targets) of every example of `ds`."""
        examples = model_examples(ds)
        progress = example_progress.ExampleProgress(
            f"eval step {step} (score)", total=len(examples)
        )
        results = []
        turn = 8 * self._engine.batch_size  # a progress line now and then
        for start in range(0, len(examples), turn):
            some = examples[start : start + turn]
            scores = self._engine.score([ex.inputs for ex in some], [ex.targets for ex in some])
            results.extend((ex.index, float(score)) for ex, score in zip(some, scores, strict=True))
            progress.add(len(some))
        return results

    def __call__(self, params, step: int) -> dict:
        start = time.time()
        self._use(params)
        future, _ = self.evaluator.evaluate(
            compute_metrics=jax.process_index() == 0,
            step=step,
            predict_fn=lambda ds: self._decode(ds, step=step),
            score_fn=lambda ds: self._score(ds, step=step),
        )
        took = f"eval at step {step} ({time.time() - start:.1f}s)"
        if jax.process_index() != 0:  # seqio computes the metrics on process 0 only
            print(f"{took}: done; process 0 has the metrics", flush=True)
            return {}
        metrics = future.result()
        self.examples.write(setting=OUTPUT_SETTING)
        self._record(step, metrics)
        print(f"{took}: {metrics}", flush=True)
        return metrics

    def _record(self, step: int, metrics: dict) -> None:
        self.writer.write_scalars(step, summary_scalars(metrics))
        self.writer.flush()
        datasets = self.evaluator.cached_task_datasets
        counts = {task: int(datasets[task].cardinality()) for task in metrics}
        write_metrics(self.metrics_file, step, metrics, counts)


def decoded(eng: engine.Engine, request: engine.Request, examples: list, *, label: str) -> list:
    """(index, ids) of each of `examples` (each with .index and .inputs), decoded as `t5tpu
    infer` decodes, with a progress line a batch at a time."""
    progress = example_progress.ExampleProgress(f"{label} (decode)", total=len(examples))
    feed = engine.ListFeed(
        (
            engine.Row(ex.inputs, index=i, seed=request.settings.seed, tag=ex.index)
            for i, ex in enumerate(examples)
        ),
        bucket=eng.bucket,
        fill=eng.few_rows,
    )
    results = []
    for done in eng.stream(feed, request):
        results.append((done.row.tag, done.ids.tolist()))
        if len(results) % eng.batch_size == 0 or len(results) == len(examples):
            progress.add(len(results) - progress.count)  # a batch's worth at a time
    return results


def summary_scalars(metrics: dict) -> dict:
    """{task/metric: value} of {task: metrics}, the numbers only: TensorBoard's names."""
    return {
        f"{task}/{name}": value
        for task, values in metrics.items()
        for name, value in _scalars(values).items()
    }


def write_metrics(metrics_file: str, step: int, metrics: dict, counts: dict) -> None:
    """Records {task: metrics} at `step` in `metrics_file`, each task's with its number of
    examples (`counts`), keeping every other step's and task's."""
    # A folder where the file goes is found here first, while reading it.
    with atomic_files.write_faults(metrics_file, OUTPUT_SETTING):
        recorded = recorded_metrics(metrics_file)
    recorded.setdefault(str(step), {}).update(
        {
            task: {name: float(v) for name, v in _scalars(values).items()}
            | {"num_examples": counts[task]}
            for task, values in metrics.items()
        }
    )
    text = json.dumps(recorded, indent=2, sort_keys=True)
    atomic_files.write_atomically(metrics_file, text, setting=OUTPUT_SETTING)


@dataclasses.dataclass(frozen=True)
class ModelExample:
    """An evaluation example as seqio's feature converter gives it, its padding cut off."""

    index: int
    inputs: tuple[int, ...]
    targets: tuple[int, ...]


def model_examples(ds: tf.data.Dataset) -> list[ModelExample]:
    """Every (index, features) of an enumerated, finite dataset."""

    def unpadded(ids: np.ndarray) -> tuple[int, ...]:
        return tuple(int(i) for i in ids[: int(np.count_nonzero(ids))])

    return [
        ModelExample(
            int(index),
            unpadded(features["encoder_input_tokens"]),
            unpadded(features["decoder_target_tokens"]),
        )
        for index, features in ds.as_numpy_iterator()
    ]


def _seqio_evaluator(
    task_name: str, task_feature_lengths, split: str, num_examples: int | None, *, results_dir: str
) -> seqio.Evaluator:
    # Here, not at the top: its class subclasses seqio's, which imports TensorFlow.
    from t5tpu.runners import eval_examples

    evaluator = seqio.Evaluator(
        task_name,
        pipeline.feature_converter(pack=False),
        eval_split=split,
        sequence_length=dict(task_feature_lengths),
        num_examples=num_examples,
        # seqio makes each logger as cls(output_dir=log_dir); TensorBoard and eval_metrics.json
        # are written by TaskEvaluator itself.
        logger_cls=(functools.partial(eval_examples.ExamplesLogger, split=split),),
        log_dir=results_dir,
    )
    if not evaluator.eval_tasks:
        raise UserError(
            f"nothing to evaluate: no task of {task_name!r} has a {split!r} split and "
            "metrics; set EVAL_SPLIT to a split the task has"
        )
    return evaluator
