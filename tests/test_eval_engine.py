"""`t5tpu eval` decodes and scores through the engine that infer and serve use: its metrics and
its predictions are those of the whole-batch decoder it replaced (every eval batch padded to the
full batch and the full input length), token for token."""

from __future__ import annotations

import numpy as np
import pytest
import reference_decoding
import seqio
from cli_runs import TINY_EXPERIMENT, read_jsonl
from t5tpu.tasks import register_builtin_tasks

import t5tpu
from t5tpu.config import gin_setup
from t5tpu.model import decoding_settings
from t5tpu.runners.evaluator import TaskEvaluator, model_examples
from t5tpu.storage import model_dir as paths

pytestmark = pytest.mark.slow  # needs the trained_tiny run
LENGTHS = {"inputs": 96, "targets": 4}  # the tiny Quora experiment's


class _WholeBatchEvaluator(TaskEvaluator):
    """The evaluator as it was: fixed [batch, 96] batches through the reference decoder and the
    model's score, one jit each."""

    def _decode(self, ds, *, step):
        import jax

        network, length = self._engine.model, self.request.max_length
        predict = jax.jit(lambda p, t: reference_decoding.predict(network, p, t, length))
        return self._whole_batches(ds, lambda params, batch: predict(params, batch["inputs"]))

    def _score(self, ds, *, step):
        import jax

        score = jax.jit(self._engine.model.score)

        def scores(params, batch):
            targets = batch["targets"]
            decoder_inputs = np.pad(targets, ((0, 0), (1, 0)))[:, :-1]
            features = {
                "encoder_input_tokens": batch["inputs"],
                "decoder_input_tokens": decoder_inputs,
                "decoder_target_tokens": targets,
            }
            return score(params, features)

        return self._whole_batches(ds, scores)

    def _whole_batches(self, ds, fn):
        from t5tpu.model.slot_batch import padded

        examples, out = model_examples(ds), []
        for start in range(0, len(examples), self.batch_size):
            some = examples[start : start + self.batch_size]
            batch = {
                "inputs": padded([ex.inputs for ex in some], self.batch_size, LENGTHS["inputs"]),
                "targets": padded([ex.targets for ex in some], self.batch_size, LENGTHS["targets"]),
            }
            results = np.asarray(fn(self._engine.params, batch))[: len(some)]
            out.extend((ex.index, r.tolist()) for ex, r in zip(some, results, strict=True))
        return out


def test_eval_on_the_engine_gives_the_whole_batch_decoders_metrics(trained_tiny, tmp_path):
    model = t5tpu.load(str(trained_tiny))
    gin_setup.parse([TINY_EXPERIMENT], [], [])  # the task with the experiment's vocabulary
    register_builtin_tasks()
    kwargs = dict(
        model=model.model,
        task_name="qp_is_duplicate",
        task_feature_lengths=LENGTHS,
        split="validation",
        batch_size=32,
        partitioner=model.engine.partitioner,
        param_shardings=model.engine._param_shardings,
        settings=decoding_settings.DecodingSettings(),
    )
    ours = TaskEvaluator(model_dir=str(tmp_path / "engine"), **kwargs)
    reference = _WholeBatchEvaluator(model_dir=str(tmp_path / "whole"), **kwargs)
    ours._use(model.params), reference._use(model.params)
    ds = ours.evaluator.cached_model_datasets["qp_is_duplicate"]
    decoded = sorted(ours._decode(ds, step=0))
    assert len(decoded) == 105  # the bundled validation split
    assert decoded == sorted(reference._decode(ds, step=0))
    np.testing.assert_allclose(
        [s for _, s in sorted(ours._score(ds, step=0))],
        [s for _, s in sorted(reference._score(ds, step=0))],
        rtol=1e-5,
    )
    assert ours(model.params, 2) == reference(model.params, 2)
    # The examples file (runners/eval_examples.py): line i is example i, its prediction the text
    # the metric saw (the decoded ids, postprocessed).
    vocabulary = seqio.get_mixture_or_task("qp_is_duplicate").output_features["targets"].vocabulary
    examples = paths.eval_examples(str(tmp_path / "engine"), "validation", "qp_is_duplicate", 2)
    assert [row["prediction"] for row in read_jsonl(examples)] == [
        vocabulary.decode(ids).strip() for _, ids in decoded
    ]
