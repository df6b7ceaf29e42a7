"""T5X native checkpoints, as Google publishes them (gs://t5-data/pretrained_models/t5x/...).

A T5X checkpoint is a directory checkpoint_<step>/ holding a msgpack file named `checkpoint`,
written by flax.serialization as {'version': 3, 'optimizer': {'target': params, 'state':
{'step': ..., 'param_states': ...}}} (version 0: the optimizer state dict at the top level).
Each leaf is either the array itself (msgpack ext type 1: shape, dtype name, bytes) or, for arrays
T5X partitions, a tensorstore spec {'driver': 'zarr', 'kvstore': {'driver': 'file'|'gcs',
'path': 'target.encoder.layers_0.attention.query.kernel'}, 'metadata': {'shape': ...}, ...}
whose path is relative to the checkpoint directory (older specs keep 'path' beside 'kvstore').
Only 'target' is read; the optimizer's slots are left on disk.

T5X parameter names are t5tpu's; its attention kernels are stored 2-D ("flat layout", see
param_mapping). Version 2 checkpoints stored bfloat16 arrays as uint16 bit patterns; they are
reinterpreted as bfloat16.
"""

from __future__ import annotations

import os
import re

import ml_dtypes
import numpy as np
import tensorstore as ts
from etils import epath
from flax import serialization

from t5tpu.errors import UserError
from t5tpu.formats import param_mapping

INDEX_FILE = "checkpoint"
_TF_STATE_MAGIC = b"model_checkpoint_path"  # a TF checkpoint state file, also named `checkpoint`


def checkpoint_dir(path: str) -> str:
    """The checkpoint_<step> directory, given it or the `checkpoint` file inside it."""
    path = path.rstrip("/")
    if os.path.basename(path) == INDEX_FILE and not epath.Path(path).is_dir():
        return os.path.dirname(path)
    return path


def _is_tensorstore_spec(leaf) -> bool:
    return isinstance(leaf, dict) and {"driver", "kvstore"} <= set(leaf)


def _flatten(tree, prefix: str = "") -> dict:
    """{'encoder/layers_0/...': leaf}, a tensorstore spec counting as one leaf."""
    if not isinstance(tree, dict) or _is_tensorstore_spec(tree):
        return {prefix: tree}
    flat = {}
    for key, value in tree.items():
        flat.update(_flatten(value, f"{prefix}/{key}" if prefix else str(key)))
    return flat


class T5XCheckpoint(param_mapping.CheckpointReader):
    """The parameters ('target') of one T5X checkpoint directory, read lazily."""

    def __init__(self, path: str):
        self.directory = checkpoint_dir(path)
        self.description = f"T5X checkpoint {self.directory}"
        if not self.recognizes(self.directory):
            raise UserError(
                f"{self.directory} is not a T5X checkpoint (no msgpack `{INDEX_FILE}` file); "
                "point at a checkpoint_<step> directory"
            )
        index = os.path.join(self.directory, INDEX_FILE)
        with epath.Path(index).open("rb") as f:
            try:
                contents = serialization.msgpack_restore(f.read())
            except Exception as e:  # msgpack raises several unrelated types on bad bytes
                raise UserError(f"{index} is not a readable T5X msgpack index ({e})") from None
        state = contents.get("optimizer", {}) if contents.get("version", 0) else contents
        if not isinstance(state, dict) or "target" not in state:
            raise UserError(f"{index} has no 'target' parameters; is it a T5X checkpoint?")
        self._leaves = _flatten(state["target"])
        self._step = state.get("state", {}).get("step")

    @staticmethod
    def recognizes(path: str) -> bool:
        """A `checkpoint` file in msgpack, not TensorFlow's checkpoint state (Mesh TF's)."""
        index = epath.Path(checkpoint_dir(path), INDEX_FILE)
        if not index.exists() or index.is_dir():
            return False
        with index.open("rb") as f:
            return not f.read(len(_TF_STATE_MAGIC)).startswith(_TF_STATE_MAGIC)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: self._shape(leaf) for name, leaf in self._leaves.items()}

    def read(self, name: str) -> np.ndarray:
        leaf = self._leaves[name]
        if not _is_tensorstore_spec(leaf):
            return np.asarray(leaf)
        array = ts.open(self._absolute_spec(leaf), open=True, read=True).result().read().result()
        if array.dtype == np.uint16:  # version 2: bfloat16 written as its bits
            array = array.view(ml_dtypes.bfloat16)
        return array

    @property
    def step(self) -> int:
        if self._step is not None:
            return int(np.asarray(self._step))
        match = re.search(r"checkpoint_(\d+)$", self.directory)
        return int(match.group(1)) if match else 0

    def _shape(self, leaf) -> tuple[int, ...]:
        if not _is_tensorstore_spec(leaf):
            return tuple(np.shape(leaf))
        if "shape" in leaf.get("metadata", {}):
            return tuple(leaf["metadata"]["shape"])
        return tuple(ts.open(self._absolute_spec(leaf), open=True).result().shape)

    def _absolute_spec(self, spec: dict) -> dict:
        """A spec for the array's zarr directory under this checkpoint's actual location (the
        stored one names a relative path and, on GCS, a placeholder bucket)."""
        relative = spec["kvstore"].get("path") or spec.get("path")
        if not relative:
            raise UserError(f"{self.directory}: a tensorstore spec without a path: {spec}")
        gcs = re.fullmatch(r"gs://([^/]+)/(.*)", self.directory)
        if gcs:
            bucket, directory = gcs.groups()
            kvstore = {"driver": "gcs", "bucket": bucket, "path": f"{directory}/{relative}"}
        else:
            kvstore = {"driver": "file", "path": os.path.join(self.directory, relative)}
        return {"driver": spec.get("driver", "zarr"), "kvstore": kvstore}
