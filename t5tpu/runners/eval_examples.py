"""Each example an evaluation saw, as seqio's metrics saw it: eval_examples/<task>-<step>.jsonl
(eval_<split>_examples/ for other splits; storage.model_dir.eval_examples), one line per example
in the evaluation's order:

    {"input": the input text as the task made it (inputs_pretokenized),
     "target": targets_pretokenized,
     "prediction": the postprocessed prediction the metrics compared (predict metrics),
     "score": the target's log-likelihood (score metrics),
     "references": the postprocessed target, only where it is not the target text (SQuAD: every
                   gold answer)}

ExamplesLogger is seqio's hook for this, a seqio.Logger that the Evaluator calls once per task
after computing its metrics (on process 0 only: seqio computes metrics nowhere else). It only
builds the lines there: seqio calls its loggers inside its own try block, which logs any error
and raises it again as "Failed to evaluate task ...", so a full disk met there would not be
t5tpu's one line. TaskEvaluator writes them afterwards (write), each file whole under a
temporary name and renamed (storage.atomic_files): a rerun of a step replaces that task's file,
never appends to it, and leaves every other file as it was. seqio's own JSONLogger is not used:
it writes in place, dumps token arrays and appends a metrics file of its own.

Imported when the first evaluator is made, not with the runners: subclassing seqio.Logger
imports seqio and TensorFlow.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from t5tpu.runners import example_lines
from t5tpu.runtime.lazy_imports import seqio, tf
from t5tpu.storage import atomic_files
from t5tpu.storage import model_dir as paths


def _text(example: Mapping, feature: str, task_name: str) -> str:
    """`feature`'s text as the task made it: seqio's tokenize keeps it as
    <feature>_pretokenized; for a task of the user's that drops it, its ids decoded."""
    raw = example.get(f"{feature}_pretokenized")
    if raw is not None:
        return example_lines.plain(raw)
    vocabulary = seqio.get_mixture_or_task(task_name).output_features[feature].vocabulary
    return vocabulary.decode(np.asarray(example[feature]).tolist())


def example_line(
    example: Mapping, *, task_name: str, target: Any, outputs: Mapping[str, Any]
) -> str:
    """One example's JSON line: its texts from the task's dataset, `target` as postprocessed for
    the metrics and its `outputs` (OUTPUTS present)."""
    return example_lines.line(
        input_text=_text(example, "inputs", task_name),
        target_text=_text(example, "targets", task_name),
        target=target,
        outputs=outputs,
    )


class ExamplesLogger(seqio.Logger):
    """seqio's logger of each task's examples at a step: the lines kept until write()."""

    def __init__(self, output_dir: str, *, split: str):
        """`output_dir`: the evaluation's results folder (EVAL_OUTPUT_DIR, else MODEL_DIR)."""
        super().__init__(output_dir)
        self.split = split
        self._pending: dict[str, str] = {}  # path -> the file's text

    def __call__(
        self,
        task_name: str,
        step: int | None,
        metrics: Mapping,
        dataset: tf.data.Dataset | None,
        inferences: Mapping[str, Sequence] | None,
        targets: Sequence | None,
    ) -> None:
        del metrics  # eval_metrics.json has them
        if dataset is None or targets is None:  # seqio's metrics that collect nothing
            return
        outputs = {
            name: values
            for name, values in (inferences or {}).items()
            if name in example_lines.OUTPUTS
        }
        lines = [
            example_line(
                example,
                task_name=task_name,
                target=target,
                outputs={name: values[i] for name, values in outputs.items()},
            )
            for i, (example, target) in enumerate(
                zip(dataset.as_numpy_iterator(), targets, strict=True)
            )
        ]
        path = paths.eval_examples(self.output_dir, self.split, task_name, step)
        self._pending[path] = "".join(lines)

    def write(self, *, setting: str) -> list[str]:
        """Writes each file built since the last write, whole; returns their paths. A failed
        write is atomic_files' one line naming `setting`."""
        pending, self._pending = self._pending, {}
        for path, text in pending.items():
            atomic_files.write_atomically(path, text, setting=setting)
        return list(pending)
