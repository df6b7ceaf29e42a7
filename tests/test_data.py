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
