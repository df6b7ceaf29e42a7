"""Batches as the compiled functions take them: host rows to global arrays on the mesh (training),
and fixed-size zero-padded batches of a finite data set (evaluation reads every example on every
host and places the full batch; inference and serving batch through model/engine.py instead)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import jax
import numpy as np

from t5tpu.partitioning import host_data_rows
from t5tpu.runtime.lazy_imports import tf


def examples_in(batch: Mapping[str, np.ndarray]) -> int:
    """Examples in a host batch: one per row, or, when packed, one per segment (a segment starts
    where its decoder position is 0)."""
    if "decoder_segment_ids" not in batch:
        return len(batch["decoder_target_tokens"])
    starts = (batch["decoder_positions"] == 0) & (batch["decoder_segment_ids"] > 0)
    return int(starts.sum())


def to_global(batch: Mapping[str, np.ndarray], sharding: jax.sharding.NamedSharding) -> dict:
    """This host's rows of a global batch -> global arrays sharded over the mesh's 'data' axis.

    The host's devices hold some rows (data shards) of the global batch, not necessarily
    adjacent ones (on a TPU pod the mesh follows the physical torus); jax fills them with the
    local rows in order. Which example lands in which global row does not matter to a step."""
    host_shards = len(host_data_rows(sharding)[jax.process_index()])
    scale = sharding.mesh.shape["data"] / host_shards  # global rows per local row
    placed = {}
    for name, local in batch.items():
        local = np.asarray(local)
        global_shape = (round(local.shape[0] * scale),) + local.shape[1:]
        placed[name] = jax.make_array_from_process_local_data(sharding, local, global_shape)
    return placed


def full_batch_to_global(batch: Mapping[str, np.ndarray], sharding: jax.sharding.Sharding) -> dict:
    """A batch that every host holds in full (evaluation) -> global arrays."""
    return {
        k: jax.make_array_from_process_local_data(sharding, np.asarray(v), np.shape(v))
        for k, v in batch.items()
    }


def padded_batches(ds: tf.data.Dataset, batch_size: int) -> Iterator[tuple[np.ndarray, dict]]:
    """Batches of an enumerated, finite dataset of (index, features), zero-padded to a fixed size
    so one compiled function serves them all. Yields (indices of the real rows, features)."""
    for indices, features in ds.batch(batch_size).as_numpy_iterator():
        yield indices, _padded(features, batch_size)


def _padded(features: dict, batch_size: int) -> dict:
    missing = batch_size - len(next(iter(features.values())))
    if not missing:
        return features
    return {
        k: np.concatenate([v, np.zeros((missing,) + v.shape[1:], v.dtype)])
        for k, v in features.items()
    }
