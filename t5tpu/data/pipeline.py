"""The training input: seqio's EncDecFeatureConverter over a task, as an endless, seeded stream of
this host's share of each global batch, whose position is saved beside each checkpoint.

On several hosts each one reads only its shard of the training data (seqio's ShardInfo) and
holds only its rows of each global batch (batches.to_global places them).
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from collections.abc import Mapping

import jax
import numpy as np
from etils import epath

from t5tpu import validators
from t5tpu.data import availability
from t5tpu.errors import UserError, one_line_message
from t5tpu.partitioning import DataLayout
from t5tpu.runtime.lazy_imports import seqio, tf
from t5tpu.storage import locations


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
    layout = layout or _one_shard_per_host(batch_size)
    # A position only fits the pipeline that saved it: a run resumed with another batch size,
    # task or host layout must not get the old pipeline's buffered batches.
    settings = (task_name, sorted(task_feature_lengths.items()), seed, pack, split, layout)
    fingerprint = hashlib.sha256(repr(settings).encode()).hexdigest()[:12]

    def stream() -> InputStream:
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
        return InputStream(ds.prefetch(tf.data.AUTOTUNE), fingerprint, (task_name, split))

    restored = _restored_stream(stream, saved_position, fingerprint, skip_batches)
    if restored:
        return restored
    skipped = stream()
    skipped.skip(skip_batches)
    return skipped


def _one_shard_per_host(batch_size: int) -> DataLayout:
    num_hosts = jax.process_count()
    validators.multiple(num_hosts, f"the {num_hosts} hosts").check("BATCH_SIZE", batch_size)
    return DataLayout(jax.process_index(), num_hosts, batch_size // num_hosts)


def _restored_stream(make_stream, saved_position, fingerprint, skip_batches) -> InputStream | None:
    """The stream at `saved_position` when that was saved by this pipeline, else None (with a
    warning when a position is there but cannot be used: skipping is then always right)."""
    if not saved_position:
        return None
    if epath.Path(f"{saved_position}.{fingerprint}.index").exists():
        restored = make_stream()
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
    elif list(epath.Path(saved_position).parent.glob(f"{epath.Path(saved_position).name}.*.index")):
        print(
            f"t5tpu: warning: {saved_position} was saved by another input pipeline (batch size, "
            f"task, lengths, seed, packing or hosts changed); skipping {skip_batches} batches of "
            "the new shape, as if the run had always used it",
            file=sys.stderr,
        )
    return None


class InputStream:
    """An iterator of numpy batches whose position can be saved beside a checkpoint: restoring
    it is quick, where skipping runs every skipped example through the pipeline again, which
    grows with the step a run resumes at (docs/PERFORMANCE.md has both rates).

    The position is a tf.train.Checkpoint of the iterator, which TensorFlow writes through its
    own filesystems; for a gs:// checkpoint it is written to a local folder and copied with
    etils' epath, the client that writes the rest of the checkpoint."""

    def __init__(self, ds: tf.data.Dataset, fingerprint: str, source: tuple[str, str] = ("", "")):
        self._iterator = iter(ds)
        self._fingerprint = fingerprint  # names the saved files: a fingerprint of the settings
        self._source = source  # (task, split), named when a record is damaged

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        return {name: value.numpy() for name, value in self._next().items()}

    def skip(self, batches: int) -> None:
        for _ in range(batches):
            self._next()

    def _next(self) -> dict:
        """The next batch; a damaged record (data too large for availability's check before the
        run, or damaged since) is one line naming the task's files, not tf.data's traceback."""
        try:
            return next(self._iterator)
        except tf.errors.DataLossError as e:
            task, split = self._source
            raise UserError(
                f"a record of the {split!r} split of task {task!r} is damaged "
                f"({availability.tensorflow_message(e)}; its files: "
                f"{availability.described_files(task, split)}); restore its data"
            ) from None

    def save(self, prefix: str) -> None:
        """Writes the position (the shuffle and prefetch buffers included) to `prefix`.*."""
        name = f"{prefix}.{self._fingerprint}"
        if not locations.is_remote(prefix):
            tf.train.Checkpoint(input=self._iterator).write(name)
            return
        with tempfile.TemporaryDirectory() as local:
            tf.train.Checkpoint(input=self._iterator).write(os.path.join(local, "position"))
            destination = epath.Path(name)
            destination.parent.mkdir(parents=True, exist_ok=True)
            for file in epath.Path(local).iterdir():
                suffix = file.name[len("position") :]
                file.copy(destination.with_name(destination.name + suffix), overwrite=True)

    def restore(self, prefix: str) -> None:
        name = f"{prefix}.{self._fingerprint}"
        if not locations.is_remote(prefix):
            tf.train.Checkpoint(input=self._iterator).read(name).assert_consumed()
            return
        with tempfile.TemporaryDirectory() as local:
            source = epath.Path(name)
            for file in source.parent.glob(f"{source.name}.*"):
                suffix = file.name[len(source.name) :]
                file.copy(epath.Path(local) / f"position{suffix}")
            checkpoint = tf.train.Checkpoint(input=self._iterator)
            checkpoint.read(os.path.join(local, "position")).assert_consumed()
