"""The training input: seqio's EncDecFeatureConverter over a task, as an endless, seeded stream of
this host's share of each global batch, whose position is saved beside each checkpoint.

On several hosts each one reads only its shard of the training data (seqio's ShardInfo) and
holds only its rows of each global batch (batches.to_global places them).
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Mapping

import jax
import numpy as np
import seqio
import tensorflow as tf

from t5tpu.errors import UserError, one_line_message
from t5tpu.partitioning import DataLayout


def feature_converter(pack: bool) -> seqio.FeatureConverter:
    return seqio.EncDecFeatureConverter(pack=pack)


def model_lengths(task_feature_lengths: Mapping[str, int]) -> tuple[int, int]:
    """(encoder length, decoder length) from {'inputs': n, 'targets': m}."""
    try:
        return int(task_feature_lengths["inputs"]), int(task_feature_lengths["targets"])
    except (KeyError, TypeError):
        raise UserError(
            f"TASK_FEATURE_LENGTHS={task_feature_lengths!r}; bind it as "
            "{'inputs': 512, 'targets': 128}"
        ) from None


def train_batches(
    task_name: str,
    task_feature_lengths: Mapping[str, int],
    batch_size: int,
    seed: int,
    pack: bool,
    split: str = "train",
    skip_batches: int = 0,
    layout: DataLayout | None = None,
    saved_position: str | None = None,
) -> InputStream:
    """An endless, deterministic stream of this host's share of each global batch.

    The order is fixed by `seed`. A resumed run continues where the stream stood when its
    checkpoint was saved: from `saved_position` (InputStream.save) if that was written for this
    pipeline, else by reading and dropping the `skip_batches` batches already used; either way
    it sees exactly the examples an uninterrupted run would. Resumed with other settings (a
    position of another pipeline), it skips as many batches of the new shape, with a warning:
    where a run that always had those settings would stand. `layout`
    (Partitioner.data_layout(batch_size)) says which shard this host reads; without it every
    host reads its own shard, which is right unless the 'model' axis spans hosts.
    """
    if layout is None:
        num_hosts = jax.process_count()
        if batch_size % num_hosts:
            raise UserError(f"BATCH_SIZE={batch_size} must be a multiple of the {num_hosts} hosts")
        layout = DataLayout(jax.process_index(), num_hosts, batch_size // num_hosts)
    # A position only fits the pipeline that saved it: a run resumed with another batch size,
    # task or host layout must not get the old pipeline's buffered batches.
    settings = (task_name, sorted(task_feature_lengths.items()), seed, pack, split, layout)
    pipeline = hashlib.sha256(repr(settings).encode()).hexdigest()[:12]

    def stream():
        ds = seqio.get_dataset(
            task_name,
            task_feature_lengths,
            feature_converter(pack),
            dataset_split=split,
            shuffle=True,
            num_epochs=None,
            seed=seed,
            use_cached=False,
            verbose=False,
            shard_info=seqio.ShardInfo(index=layout.shard_index, num_shards=layout.num_shards),
        )
        ds = ds.batch(layout.local_batch_size, drop_remainder=True)
        return InputStream(ds.prefetch(tf.data.AUTOTUNE), pipeline)

    if saved_position and tf.io.gfile.exists(f"{saved_position}.{pipeline}.index"):
        restored = stream()
        try:
            restored.restore(saved_position)
            return restored
        # A lost, truncated or foreign file raises many kinds of errors; skipping is always right.
        except Exception as e:
            print(
                f"t5tpu: warning: input position {saved_position} does not fit this pipeline "
                f"({one_line_message(e)[:200]}); skipping {skip_batches} batches instead",
                file=sys.stderr,
            )
    elif saved_position and tf.io.gfile.glob(f"{saved_position}.*.index"):
        print(
            f"t5tpu: warning: {saved_position} was saved by another input pipeline (batch size, "
            f"task, lengths, seed, packing or hosts changed); skipping {skip_batches} batches of "
            "the new shape, as if the run had always used it",
            file=sys.stderr,
        )
    skipped = stream()
    skipped.skip(skip_batches)
    return skipped


class InputStream:
    """An iterator of numpy batches whose position can be saved beside a checkpoint: restoring
    it costs a fraction of a second, where skipping runs every skipped example through the
    pipeline again (minutes at step 20,000 of a batch-256 recipe)."""

    def __init__(self, ds: tf.data.Dataset, pipeline: str):
        self._iterator = iter(ds)
        self._pipeline = pipeline  # names the saved files: a fingerprint of the settings

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        return {name: value.numpy() for name, value in next(self._iterator).items()}

    def skip(self, batches: int) -> None:
        for _ in range(batches):
            next(self._iterator)

    def save(self, prefix: str) -> None:
        """Writes the position (the shuffle and prefetch buffers included) to `prefix`.*."""
        tf.train.Checkpoint(input=self._iterator).write(f"{prefix}.{self._pipeline}")

    def restore(self, prefix: str) -> None:
        checkpoint = tf.train.Checkpoint(input=self._iterator)
        checkpoint.read(f"{prefix}.{self._pipeline}").assert_consumed()
