"""Evaluation of a prepared file's examples (data/prepared.py) without seqio or TensorFlow: what
TaskEvaluator does through seqio's Evaluator, done here in the same order: each example decoded
by the engine, its ids made text by the model's vocabulary (SentencePiece's, as seqio's does),
the task's postprocessor applied (with no example: the file keeps the postprocessed targets,
not the examples), then each of the task's metric functions on (targets, predictions).

The results go where TaskEvaluator's go (eval_metrics.json, eval_examples/), the scalars to
eval/scalars.jsonl in place of TensorBoard's events (storage/scalar_log.py).
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable

import jax

from t5tpu import validators
from t5tpu.data import prepared
from t5tpu.data.prepared import EvalTask, PreparedData
from t5tpu.data.sentencepiece_vocab import SentencePieceVocabulary
from t5tpu.errors import UserError
from t5tpu.model import decoding_settings, engine
from t5tpu.model.encoder_decoder import EncoderDecoderModel
from t5tpu.partitioning import Partitioner
from t5tpu.runners import evaluator as task_evaluator
from t5tpu.runners import example_lines
from t5tpu.storage import atomic_files, scalar_log
from t5tpu.storage import model_dir as paths


def import_name(fn: Callable) -> str | None:
    """ "module:function" that imports `fn` itself again, else None (a lambda, a partial)."""
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or "<" in name:
        return None
    try:
        return f"{module}:{name}" if imported(f"{module}:{name}") is fn else None
    except (ImportError, AttributeError):
        return None


def imported(name: str) -> Callable:
    """The function an import_name names."""
    module, _, qualname = name.partition(":")
    found = importlib.import_module(module)
    for part in qualname.split("."):
        found = getattr(found, part)
    return found


class PreparedEvaluator:
    """TaskEvaluator's call (params, step) -> {task: metrics}, on a prepared file's examples."""

    def __init__(
        self,
        *,
        model: EncoderDecoderModel,
        data: PreparedData,
        batch_size: int,
        partitioner: Partitioner,
        param_shardings,
        model_dir: str,
        settings: decoding_settings.DecodingSettings,
        output_dir: str | None = None,
    ):
        if not validators.is_instance(model.vocabulary, SentencePieceVocabulary):
            raise UserError(
                f"{prepared.SETTING}: evaluating without seqio needs a SentencePiece "
                "vocabulary; evaluate this model where seqio is installed"
            )
        self.data = data
        self.vocabulary = model.vocabulary
        results = output_dir or model_dir
        self.results_dir = results
        self.metrics_file = paths.eval_metrics(results, data.eval_split)
        task_evaluator.recorded_metrics(self.metrics_file)  # a damaged file: refused first
        self.summaries_dir = paths.eval_summaries(results, data.eval_split)
        self._writer = None
        lengths = data.settings.lengths
        self.request = engine.Request(settings, max_length=lengths["targets"])
        self._engine_args = dict(
            model=model,
            param_shardings=param_shardings,
            partitioner=partitioner,
            batch_size=batch_size,
            max_input_length=lengths["inputs"],
            max_target_length=lengths["targets"],
            pinned=self.request,
            cast=False,
        )
        self._engine: engine.Engine | None = None
        # Imported now: a function that is gone is refused before any decoding.
        self._functions = {task.name: _functions(task) for task in data.eval_tasks}

    def _use(self, params) -> engine.Engine:
        self._engine = engine.reused(self._engine, params=params, **self._engine_args)
        return self._engine

    def __call__(self, params, step: int) -> dict:
        start = time.time()
        eng = self._use(params)
        metrics, lines = {}, {}
        for task in self.data.eval_tasks:
            examples = [
                task_evaluator.ModelExample(i, ex.inputs, ex.targets)
                for i, ex in enumerate(task.examples)
            ]
            found = task_evaluator.decoded(eng, self.request, examples, label=f"eval step {step}")
            ids = [row for _, row in sorted(found, key=lambda pair: pair[0])]
            metrics[task.name], lines[task.name] = self._task_metrics(task, ids)
        took = f"eval at step {step} ({time.time() - start:.1f}s)"
        if jax.process_index() != 0:  # as TaskEvaluator: process 0 records
            print(f"{took}: done; process 0 has the metrics", flush=True)
            return {}
        for name, text in lines.items():
            path = paths.eval_examples(self.results_dir, self.data.eval_split, name, step)
            atomic_files.write_atomically(path, text, setting=task_evaluator.OUTPUT_SETTING)
        self._record(step, metrics)
        print(f"{took}: {metrics}", flush=True)
        return metrics

    def _task_metrics(self, task: EvalTask, ids: list) -> tuple[dict, str]:
        """The task's metrics of the decoded `ids` (in example order) and its examples file."""
        postprocess, metric_fns = self._functions[task.name]
        predictions = [self.vocabulary.decode(row) for row in ids]
        if postprocess is not None:
            predictions = [postprocess(p, example=None, is_target=False) for p in predictions]
        targets = [ex.reference for ex in task.examples]
        results = {}
        for fn in metric_fns:
            results.update(fn(targets, predictions))
        text = "".join(
            example_lines.line(
                input_text=ex.input_text,
                target_text=ex.target_text,
                target=ex.reference,
                outputs={"prediction": prediction},
            )
            for ex, prediction in zip(task.examples, predictions, strict=True)
        )
        return results, text

    def _record(self, step: int, metrics: dict) -> None:
        if self._writer is None:
            self._writer = scalar_log.writer(
                self.summaries_dir,
                just_logging=jax.process_index() > 0,
                setting=task_evaluator.OUTPUT_SETTING,
            )
        self._writer.write_scalars(step, task_evaluator.summary_scalars(metrics))
        self._writer.flush()
        counts = {task.name: len(task.examples) for task in self.data.eval_tasks}
        task_evaluator.write_metrics(self.metrics_file, step, metrics, counts)


def _functions(task: EvalTask) -> tuple[Callable | None, list[Callable]]:
    try:
        postprocess = imported(task.postprocess_fn) if task.postprocess_fn else None
        return postprocess, [imported(name) for name in task.metric_fns]
    except (ImportError, AttributeError) as e:
        raise UserError(
            f"{prepared.SETTING}: task {task.name!r}'s metric or postprocessing function cannot "
            f"be imported here ({e}); install the module that defines it"
        ) from None
