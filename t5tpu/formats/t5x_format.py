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
checkpoint_reader). Version 2 checkpoints stored bfloat16 arrays as uint16 bit patterns; they are
reinterpreted as bfloat16.

T5X's scalable_t5 (umT5's released checkpoints) keeps attention kernels 3-D as t5tpu does and a
position bias in every layer; scanned, each stack is one subtree `encoder/encoder/...` (the
scan is a module named like its stack) whose leaves hold every layer along one axis, 1 unless
T5Config.param_scan_axis said otherwise: `encoder/encoder/attention/query/kernel` is [embed,
layers, heads, kv]. The reader shows those as the unrolled layers_N names, each read as its
slice of the stacked array (TensorStore reads only that slice's chunks).
"""

from __future__ import annotations

import functools
import os
import re

import ml_dtypes
import numpy as np
import tensorstore as ts
from etils import epath
from flax import serialization

from t5tpu import validators
from t5tpu.errors import UserError, one_line_message
from t5tpu.formats import checkpoint_reader
from t5tpu.storage import user_files

INDEX_FILE = "checkpoint"
_TF_STATE_MAGIC = b"model_checkpoint_path"  # a TF checkpoint state file, also named `checkpoint`
_WHAT = "T5X checkpoint"
# A scanned stack's leaf (scalable_t5): the stack's name twice, then the layer's own path.
_SCANNED = re.compile(r"(encoder|decoder)/\1/(.+)$")
_SCAN_AXIS = 1  # T5X's default param_scan_axis


def checkpoint_dir(path: str) -> str:
    """The checkpoint_<step> directory, given it or the `checkpoint` file inside it."""
    path = path.rstrip("/")
    if os.path.basename(path) == INDEX_FILE and not epath.Path(path).is_dir():
        return os.path.dirname(path)
    return path


def _layer_axis(shapes: dict, stack: str) -> int:
    """The layer axis of a scanned stack's leaves, read off a norm's scale ([embed, layers] or
    [layers, embed], embed from the embedding's width); T5X's default where it cannot tell."""
    scale = shapes.get(f"{stack}/{stack}/pre_mlp_layer_norm/scale", ())
    embedding = shapes.get("token_embedder/embedding", ())
    if len(scale) == 2 and len(embedding) == 2 and scale.count(embedding[1]) == 1:
        return 1 - scale.index(embedding[1])
    return _SCAN_AXIS


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


def _shown(value) -> str:
    """A value read from the index, as one short line for an error message."""
    if isinstance(value, np.ndarray):
        return f"an array of {value.dtype} {value.shape}"
    return " ".join(repr(value).split())[:120]


def _is_count(value) -> bool:
    """A count (>= 0), as msgpack or flax left it: an int or a 0-d integer array."""
    if not validators.is_instance(value, (int, np.integer, np.ndarray)):
        return False
    return np.ndim(value) == 0 and np.asarray(value).dtype.kind in "iu" and value >= 0


def _numeric(dtype: np.dtype) -> bool:
    """Whether a parameter may be stored in `dtype` (T5X's: floats, bfloat16, uint16 bits)."""
    return dtype.kind in "fiu" or dtype == ml_dtypes.bfloat16


class T5XCheckpoint(checkpoint_reader.CheckpointReader):
    """The parameters ('target') of one T5X checkpoint directory, read lazily. The index's
    structure and each leaf (an array, or a tensorstore spec) are checked before anything is
    read: a damaged index is one UserError naming it, never a traceback."""

    def __init__(self, path: str):
        self.directory = checkpoint_dir(path)
        self.description = f"T5X checkpoint {self.directory}"
        if not self.recognizes(self.directory):
            raise UserError(
                f"{self.directory} is not a T5X checkpoint (no msgpack `{INDEX_FILE}` file); "
                "point at a checkpoint_<step> directory"
            )
        self._index = os.path.join(self.directory, INDEX_FILE)
        data = user_files.read_bytes(self._index, what=_WHAT)
        try:
            contents = serialization.msgpack_restore(data)
        except Exception as e:  # msgpack and numpy raise several unrelated types on bad bytes
            raise UserError(
                f"{self._index} is not a readable T5X msgpack index "
                f"({one_line_message(e)[:160]}); give an undamaged copy"
            ) from None
        state = self._object(contents, "the index")
        version = state.get("version", 0)
        if not isinstance(version, (int, np.integer)):
            raise self._damaged(f"its version is {_shown(version)}")
        if version:  # version 0 keeps the optimizer's state dict at the top level
            state = self._object(state.get("optimizer"), "'optimizer'")
        if "target" not in state:
            raise UserError(f"{self._index} has no 'target' parameters; is it a T5X checkpoint?")
        self._leaves = _flatten(self._object(state["target"], "'target'"))
        self._step = self._object(state.get("state", {}), "'state'").get("step")

    def _object(self, value, what: str) -> dict:
        if not isinstance(value, dict):
            raise self._damaged(f"{what} is a {type(value).__name__}, not a map")
        return value

    def _damaged(self, what: str) -> UserError:
        return UserError(f"{_WHAT}: {self._index} is damaged ({what}); give an undamaged copy")

    @staticmethod
    def recognizes(path: str) -> bool:
        """A `checkpoint` file in msgpack, not TensorFlow's checkpoint state (Mesh TF's)."""
        index = epath.Path(checkpoint_dir(path), INDEX_FILE)
        if not index.exists() or index.is_dir():
            return False
        with index.open("rb") as f:
            return not f.read(len(_TF_STATE_MAGIC)).startswith(_TF_STATE_MAGIC)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self._view[0])

    def source(self, name: str, shape: tuple[int, ...]) -> checkpoint_reader.Source:
        """scalable_t5's kernels are stored in t5tpu's own shape; the others flat."""
        if self._view[0].get(name) == tuple(shape):
            return checkpoint_reader.Source(name, tuple(shape), lambda array: array)
        return super().source(name, shape)

    @functools.cached_property
    def _view(self) -> tuple[dict, dict]:
        """({name: shape} as read, scanned stacks' leaves as layers_N; {layers_N name: (stored
        name, layer axis, layer)} of those)."""
        stored = {name: self._shape(name, leaf) for name, leaf in self._leaves.items()}
        shapes, slices = {}, {}
        for name, shape in stored.items():
            match = _SCANNED.match(name)
            if not match or not shape:
                shapes[name] = shape
                continue
            stack, rest = match.groups()
            axis = _layer_axis(stored, stack)
            layer_shape = shape[:axis] + shape[axis + 1 :]
            for i in range(shape[axis] if axis < len(shape) else 0):
                slices[f"{stack}/layers_{i}/{rest}"] = (name, axis, i)
                shapes[f"{stack}/layers_{i}/{rest}"] = layer_shape
        return shapes, slices

    def read(self, name: str) -> np.ndarray:
        stored, axis, layer = self._view[1].get(name, (name, None, None))
        index = () if axis is None else (slice(None),) * axis + (layer,)
        leaf = self._leaves[stored]
        if not _is_tensorstore_spec(leaf):
            return np.asarray(leaf)[index]
        return self._read_store(stored, leaf, index)

    def _read_store(self, name: str, leaf: dict, index: tuple) -> np.ndarray:
        """`index` of the TensorStore array `leaf` (checked against the index's shape first)."""
        try:
            store = ts.open(self._absolute_spec(leaf), open=True, read=True).result()
            # The array's own metadata may say another shape than the index (whose shape the
            # model was checked against): read nothing of a size the index did not give.
            if tuple(store.shape) != self._shape(name, leaf) or not _numeric(
                store.dtype.numpy_dtype
            ):
                raise self._damaged(
                    f"{name}'s array is a {store.dtype.name} {tuple(store.shape)}, not the "
                    f"{self._shape(name, leaf)} the index gives"
                )
            array = store[index].read().result() if index else store.read().result()
        except ValueError as e:  # TensorStore's errors: missing, cut or undecodable data
            raise UserError(
                f"{self.description}: {name} cannot be read ({one_line_message(e)[:160]}); "
                "give an undamaged copy"
            ) from None
        if array.dtype == np.uint16:  # version 2: bfloat16 written as its bits
            array = array.view(ml_dtypes.bfloat16)
        return array

    @property
    def step(self) -> int:
        if self._step is not None:
            if not _is_count(self._step):
                raise self._damaged(f"its step is {_shown(self._step)}, not a count")
            return int(self._step)
        match = re.search(r"checkpoint_(\d+)$", self.directory)
        return int(match.group(1)) if match else 0

    def _shape(self, name: str, leaf) -> tuple[int, ...]:
        if validators.is_instance(leaf, (np.ndarray, np.number, int, float)):
            if not _numeric(np.asarray(leaf).dtype):
                raise self._damaged(f"{name!r} is an array of {np.asarray(leaf).dtype}")
            return tuple(np.shape(leaf))
        if not _is_tensorstore_spec(leaf):
            raise self._damaged(f"{name!r} is a {type(leaf).__name__}, not an array")
        metadata = leaf.get("metadata", {})
        if isinstance(metadata, dict) and "shape" in metadata:
            shape = metadata["shape"]
            if isinstance(shape, np.ndarray) and shape.ndim == 1:
                shape = shape.tolist()
            if not isinstance(shape, (list, tuple)) or not all(
                validators.is_whole(d, low=0) for d in shape
            ):
                raise self._damaged(f"{name!r} has shape {_shown(shape)}")
            return tuple(shape)
        try:
            return tuple(ts.open(self._absolute_spec(leaf), open=True).result().shape)
        except ValueError as e:
            raise UserError(
                f"{self.description}: {name!r} cannot be opened ({one_line_message(e)[:160]}); "
                "give an undamaged copy"
            ) from None

    def _absolute_spec(self, spec: dict) -> dict:
        """A spec for the array's zarr directory under this checkpoint's actual location (the
        stored one names a relative path and, on GCS, a placeholder bucket)."""
        kvstore = spec["kvstore"] if isinstance(spec["kvstore"], dict) else {}
        relative = kvstore.get("path") or spec.get("path")
        driver = spec.get("driver", "zarr")
        if not isinstance(relative, str) or not relative or not isinstance(driver, str):
            raise self._damaged(f"a tensorstore spec without a path: {_shown(spec)}")
        gcs = re.fullmatch(r"gs://([^/]+)/(.*)", self.directory)
        if gcs:
            bucket, directory = gcs.groups()
            kvstore = {"driver": "gcs", "bucket": bucket, "path": f"{directory}/{relative}"}
        else:
            kvstore = {"driver": "file", "path": os.path.join(self.directory, relative)}
        return {"driver": driver, "kvstore": kvstore}
