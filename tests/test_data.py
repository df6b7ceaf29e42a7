"""batches.examples_in: the progress line's example count, packed or not."""

import numpy as np
import tensorflow as tf

from t5tpu.data import batches, pipeline

LENGTHS = {"inputs": 16, "targets": 8}


def converted_batch(pack: bool) -> dict:
    """Six short examples through seqio's feature converter, batched as the trainer reads them."""
    examples = [
        {"inputs": list(range(2, 2 + n)) + [1], "targets": [3, 4, 1]} for n in (1, 2, 3, 4, 5, 6)
    ]
    ds = tf.data.Dataset.from_generator(
        lambda: iter(examples),
        output_signature={
            "inputs": tf.TensorSpec([None], tf.int32),
            "targets": tf.TensorSpec([None], tf.int32),
        },
    )
    ds = pipeline.feature_converter(pack)(ds, LENGTHS)
    return next(ds.batch(6).as_numpy_iterator())


def test_unpacked_rows_are_examples():
    batch = converted_batch(pack=False)
    assert len(batch["decoder_target_tokens"]) == 6
    assert batches.examples_in(batch) == 6


def test_packed_rows_count_each_segment():
    batch = converted_batch(pack=True)
    rows = len(batch["decoder_target_tokens"])
    assert rows < 6  # several examples share a row
    assert batches.examples_in(batch) == 6
    assert np.all(batch["decoder_segment_ids"].max(axis=1) >= 1)


AUTOGRAPH_RULES = """
from t5tpu.runtime import lazy_imports
lazy_imports.import_tensorflow_quietly()  # as every command does first
from t5tpu.runtime.lazy_imports import seqio
from tensorflow.python.autograph.impl import conversion
from t5tpu.data import pipeline

def users_own(x):
    return x

print(conversion.is_allowlisted(seqio.preprocessors.tokenize),
      conversion.is_allowlisted(pipeline.feature_converter),
      conversion.is_allowlisted(users_own))
"""


def test_tf_data_traces_seqio_and_t5tpu_as_written_and_the_users_code_through_autograph():
    """Imported by t5tpu, TensorFlow's autograph leaves seqio's and t5tpu's dataset functions as
    written (graph code; rewriting them cost seconds of every command's start) and still
    converts a user's own preprocessor."""
    import subprocess
    import sys

    from cli_runs import ROOT

    run = subprocess.run(
        [sys.executable, "-c", AUTOGRAPH_RULES], cwd=ROOT, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["True", "True", "False"]
