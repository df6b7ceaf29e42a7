"""Training batches as the compiled step takes them: this host's rows to global arrays on the
mesh. (Evaluation and inference hand rows to the decoding engine, model/engine.py, which pads
and places its own batches.)"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import numpy as np

from t5tpu.partitioning import host_data_rows


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
