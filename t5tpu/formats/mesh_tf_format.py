"""Mesh TensorFlow checkpoints of the original `t5` library (gs://t5-data/pretrained_models/
{small,base,large,3B,11B}/model.ckpt-N), read with TensorFlow's checkpoint reader: its variables
come through TensorFlow's own filesystems (gs:// on a TPU VM), which no test emulator reaches.
Everything before that goes through storage.user_files (etils' epath) like every other format's
reads: the `checkpoint` state file, the .index (parsed and checked here, see read_index) and the
size of every data shard it names, so that TensorFlow opens only a complete, consistent one.

Variable names: shared/embedding; {encoder,decoder}/block_NNN/layer_MMM/... with layer_000 the
self-attention (SelfAttention/{q,k,v,o}, relative_attention_bias in block_000 only) and its
layer_norm/scale, decoder layer_001 the cross-attention (EncDecAttention), and the last layer the
feed-forward (DenseReluDense/{wi,wo}/kernel for T5 1.0, wi_0/wi_1 for T5 1.1);
{encoder,decoder}/final_layer_norm/scale; decoder/logits/kernel (T5 1.1's separate output
layer). Kernels are stored as T5X stores them ([in, out], attention 2-D, heads major), and the
relative attention bias as [heads, buckets]. Adafactor's slots (<name>_slot_vr, _slot_vc,
_slot_v) and global_step are not parameters; global_step gives the step.
"""

from __future__ import annotations

import os
import re

import numpy as np
from etils import epath

from t5tpu.errors import UserError, one_line_message
from t5tpu.formats import checkpoint_reader, tf_bundle_index
from t5tpu.runtime.lazy_imports import tf
from t5tpu.storage import locations, remote, user_files

_TF_STATE_MAGIC = b"model_checkpoint_path"
_STEP_VARIABLE = "global_step"
# Other spellings of the norms in some `t5` library checkpoints -> NAMES' spelling.
_ALIASES = (
    (re.compile(r"^(encoder|decoder)/rms_norm/scale$"), r"\1/final_layer_norm/scale"),
    (re.compile(r"/rms_norm/scale$"), "/layer_norm/scale"),
)
# The `t5` library's name of each t5tpu parameter.
NAMES = checkpoint_reader.T5Names(
    embedding="shared/embedding",
    logits="decoder/logits/kernel",
    relpos_bias="{stack}/block_{index:03d}/layer_000/SelfAttention/relative_attention_bias",
    final_norm="{stack}/final_layer_norm/scale",
    layer_norm="{stack}/block_{index:03d}/layer_{sublayer:03d}/layer_norm/scale",
    mlp="{stack}/block_{index:03d}/layer_{sublayer:03d}/DenseReluDense/{part}/kernel",
    attention="{stack}/block_{index:03d}/layer_{sublayer:03d}/{module}/{part}",
)


def _canonical(name: str) -> str:
    for pattern, replacement in _ALIASES:
        name = pattern.sub(replacement, name)
    return name


def _is_parameter(name: str) -> bool:
    return name != _STEP_VARIABLE and "_slot_" not in name.rsplit("/", 1)[-1]


_WHAT = "Mesh TF checkpoint"
_MAX_INDEX_BYTES = 256 * 2**20  # t5-11b's index is tens of kilobytes


def shard_path(prefix: str, shard: int, num_shards: int) -> str:
    return f"{prefix}.data-{shard:05d}-of-{num_shards:05d}"


def checkpoint_prefix(path: str) -> str:
    """The model.ckpt-N prefix at `path`: itself, or the one a directory's `checkpoint` state
    file names (read here, not by TensorFlow, which only warns when it cannot parse it)."""
    if remote.answered(epath.Path(path + ".index").exists, path=path, setting=_WHAT):
        return path
    state = os.path.join(path, "checkpoint")
    text = user_files.read_text(state, what=_WHAT, max_bytes=2**20)
    match = re.search(r'^\s*model_checkpoint_path\s*:\s*"([^"\\]+)"\s*$', text, re.MULTILINE)
    if not match:
        raise UserError(
            f"{_WHAT}: {state} names no model_checkpoint_path; give a model.ckpt-N prefix or "
            "a directory whose `checkpoint` file names one"
        )
    named = match.group(1)
    prefix = named if locations.is_absolute(named) else os.path.join(path, named)
    if not remote.answered(epath.Path(prefix + ".index").exists, path=prefix, setting=_WHAT):
        raise UserError(
            f"cannot read a TensorFlow checkpoint at {path} ({state} names {named}, but "
            f"{prefix}.index is not there); give a complete checkpoint"
        )
    return prefix


def checked_index(prefix: str) -> tuple[dict[str, tf_bundle_index.Entry], int]:
    """The entries of `prefix`.index, once every data shard it names is there and holds
    every tensor's bytes; and the number of shards. Damage is one UserError."""
    index_path = prefix + ".index"
    index = user_files.read_bytes(index_path, what=_WHAT, max_bytes=_MAX_INDEX_BYTES)
    try:
        num_shards, entries = tf_bundle_index.read_index(index)
    except tf_bundle_index.Damaged as e:
        raise UserError(f"{_WHAT}: {index_path} is damaged ({e}); give an undamaged copy") from None
    shard_sizes = []
    for shard in range(num_shards):  # stops at the first one missing
        shard_sizes.append(user_files.size(shard_path(prefix, shard, num_shards), what=_WHAT))
    try:
        tf_bundle_index.check_entries(entries, shard_sizes)
    except tf_bundle_index.Damaged as e:
        raise UserError(
            f"{_WHAT}: {prefix} is damaged or incomplete ({e}); give an undamaged copy"
        ) from None
    return entries, num_shards


class MeshTFCheckpoint(checkpoint_reader.CheckpointReader):
    """The parameters of a `t5` library checkpoint (prefix or directory), read lazily. Its
    index and the presence and sizes of its data shards are checked (checked_index) before
    TensorFlow's reader opens it."""

    def __init__(self, path: str):
        self.path = path
        self.description = f"Mesh TF checkpoint {path}"
        self._prefix = checkpoint_prefix(path)
        entries, _ = checked_index(self._prefix)
        try:
            self._reader = tf.train.load_checkpoint(self._prefix)
        except (ValueError, tf.errors.OpError) as e:
            message = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise UserError(
                f"cannot read a TensorFlow checkpoint at {path} ({message}); give a "
                "model.ckpt-N prefix or a directory with a `checkpoint` file"
            ) from None
        self._names = {_canonical(n): n for n in entries if _is_parameter(n)}
        self._shapes = {name: entries[stored].shape for name, stored in self._names.items()}
        self._step_entry = entries.get(_STEP_VARIABLE)

    @staticmethod
    def recognizes(path: str) -> bool:
        """A checkpoint prefix (model.ckpt-N, with its .index file) or a directory whose
        `checkpoint` file is TensorFlow's checkpoint state."""
        if epath.Path(path + ".index").exists():
            return True
        state = epath.Path(path, "checkpoint")
        if not state.exists() or state.is_dir():
            return False
        with state.open("rb") as f:
            return f.read(len(_TF_STATE_MAGIC)) == _TF_STATE_MAGIC

    def stored_name(self, name: str) -> str:
        return NAMES(name)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self._shapes)

    def read(self, name: str) -> np.ndarray:
        return self.read_stored(self._names[name])

    @property
    def step(self) -> int:
        entry = self._step_entry
        if entry is not None:
            if entry.shape != () or entry.dtype not in tf_bundle_index.STEP_DTYPES:
                raise UserError(
                    f"{self.description}: its {_STEP_VARIABLE} is not a step (shape "
                    f"{list(entry.shape)}, type {entry.dtype}); give an undamaged copy"
                )
            return int(self.read_stored(_STEP_VARIABLE))
        match = re.search(r"-(\d+)$", self._prefix)
        return int(match.group(1)) if match else 0

    def read_stored(self, stored_name: str) -> np.ndarray:
        try:
            return np.asarray(self._reader.get_tensor(stored_name))
        except tf.errors.OpError as e:
            raise UserError(
                f"{self.description}: {stored_name} cannot be read "
                f"({one_line_message(e)[:160]}); give an undamaged copy"
            ) from None
