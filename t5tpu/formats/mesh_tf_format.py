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

import dataclasses
import math
import os
import re

import numpy as np
from etils import epath

from t5tpu.errors import UserError, one_line_message
from t5tpu.formats import param_mapping
from t5tpu.runtime.lazy_imports import tf
from t5tpu.storage import remote, user_files

_TF_STATE_MAGIC = b"model_checkpoint_path"
_STEP_VARIABLE = "global_step"
# Other spellings of the norms in some `t5` library checkpoints -> NAMES' spelling.
_ALIASES = (
    (re.compile(r"^(encoder|decoder)/rms_norm/scale$"), r"\1/final_layer_norm/scale"),
    (re.compile(r"/rms_norm/scale$"), "/layer_norm/scale"),
)
# The `t5` library's name of each t5tpu parameter.
NAMES = param_mapping.T5Names(
    embedding="shared/embedding",
    logits="decoder/logits/kernel",
    relpos_bias="{stack}/block_000/layer_000/SelfAttention/relative_attention_bias",
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


# ---------------------------------------------------------------------------------------------
# The checkpoint's index, read here before TensorFlow reads anything: TensorFlow's reader
# allocates what a damaged index declares (a block size, a tensor's shape) and aborts the
# process on some of it, so every length in the index is checked against the files first.
#
# The .index file is a LevelDB-style table (tensorflow/tsl/lib/io/format.h): a 48-byte footer
# (two block handles, then a magic number) names an index block whose entries are the handles
# of the data blocks; each block is prefix-compressed key/value entries and a restart array,
# followed by a type byte and a CRC. Keys are variable names, '' the header; values are
# BundleEntryProto and BundleHeaderProto (tensorflow/core/protobuf/tensor_bundle.proto).

_WHAT = "Mesh TF checkpoint"
_FOOTER_SIZE = 48
_TABLE_MAGIC = 0xDB4775248B80FB57
_BLOCK_TRAILER = 5  # type byte + masked CRC32C
_MAX_INDEX_BYTES = 256 * 2**20  # t5-11b's index is tens of kilobytes
_STRING_DTYPE, _INT32, _INT64 = 7, 3, 9
# Bytes per element of the DataType enum's fixed-size types (types.proto).
_ITEMSIZES = {
    1: 4,  # float
    2: 8,  # double
    3: 4,  # int32
    4: 1,  # uint8
    5: 2,  # int16
    6: 1,  # int8
    9: 8,  # int64
    10: 1,  # bool
    14: 2,  # bfloat16
    17: 2,  # uint16
    19: 2,  # half
    22: 4,  # uint32
    23: 8,  # uint64
}


class _Damaged(ValueError):
    """What is wrong with the index; MeshTFCheckpoint names the file."""


@dataclasses.dataclass(frozen=True)
class _Entry:
    dtype: int
    shape: tuple[int, ...]
    shard: int
    offset: int
    size: int


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise _Damaged("a number runs past its record")
        byte = data[pos]
        result |= (byte & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if byte < 0x80:
            return result, pos


def _proto_fields(data: bytes) -> dict[int, list]:
    """{field number: [values]} of a protobuf message: varints as ints, the rest as bytes."""
    fields: dict[int, list] = {}
    pos = 0
    while pos < len(data):
        tag, pos = _varint(data, pos)
        number, wire = tag >> 3, tag & 7
        if wire == 0:
            value, pos = _varint(data, pos)
        elif wire in (1, 5):
            width = 8 if wire == 1 else 4
            value, pos = data[pos : pos + width], pos + width
        elif wire == 2:
            length, pos = _varint(data, pos)
            value, pos = data[pos : pos + length], pos + length
        else:
            raise _Damaged(f"a record of wire type {wire}")
        if pos > len(data):
            raise _Damaged("a record runs past its end")
        fields.setdefault(number, []).append(value)
    return fields


def _signed(value: int) -> int:
    """An int64 field's varint as the signed number it encodes."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _block(index: bytes, handle: bytes) -> bytes:
    """The contents of the block a handle (two varints: offset, size) names."""
    offset, pos = _varint(handle, 0)
    size, _ = _varint(handle, pos)
    if offset + size + _BLOCK_TRAILER > len(index):
        raise _Damaged(f"a block of {size:,} bytes at {offset:,} lies past its end")
    if index[offset + size] != 0:  # TensorFlow writes bundle indexes uncompressed
        raise _Damaged(f"a block of compression type {index[offset + size]}")
    return index[offset : offset + size]


def _block_entries(block: bytes):
    """(key, value) of each entry of a block, keys restored from their shared prefixes."""
    if len(block) < 4:
        raise _Damaged("a block too short for its restart count")
    restarts = int.from_bytes(block[-4:], "little")
    end = len(block) - 4 * (restarts + 1)
    if end < 0:
        raise _Damaged(f"a block declaring {restarts:,} restarts")
    pos, key = 0, b""
    while pos < end:
        shared, pos = _varint(block, pos)
        unshared, pos = _varint(block, pos)
        length, pos = _varint(block, pos)
        if shared > len(key) or pos + unshared + length > end:
            raise _Damaged("an entry runs past its block")
        key = key[:shared] + block[pos : pos + unshared]
        pos += unshared
        yield key, block[pos : pos + length]
        pos += length


def index_records(index: bytes) -> dict[bytes, bytes]:
    """{key: value} of every record of a .index table (its blocks' checksums are left to
    TensorFlow, which checks them on reading)."""
    if len(index) < _FOOTER_SIZE:
        raise _Damaged(f"{len(index)} bytes, less than a table's footer")
    footer = index[-_FOOTER_SIZE:]
    if int.from_bytes(footer[-8:], "little") != _TABLE_MAGIC:
        raise _Damaged("not a TensorFlow table (no magic number at its end)")
    _, pos = _varint(footer, _varint(footer, 0)[1])  # the metaindex handle: unused
    table = {}
    for _, handle in _block_entries(_block(index, footer[pos:])):
        table.update(_block_entries(_block(index, handle)))
    return table


def _messages(fields: dict[int, list], number: int, name: str) -> list[dict[int, list]]:
    """The fields of each message in field `number` (a repeated message field)."""
    values = fields.get(number, [])
    if not all(isinstance(value, bytes) for value in values):
        raise _Damaged(f"{name!r} has a field {number} of the wrong type")
    return [_proto_fields(value) for value in values]


def _number(fields: dict[int, list], number: int, name: str) -> int:
    """An integer field's last value (0 when absent), signed as int64 fields are."""
    value = fields.get(number, [0])[-1]
    if not isinstance(value, int):
        raise _Damaged(f"{name!r} has a field {number} of the wrong type")
    return _signed(value)


def _entry(name: str, value: bytes) -> _Entry:
    """A BundleEntryProto: 1 dtype, 2 shape (TensorShapeProto: 2 dim, each 1 size), 3 shard_id,
    4 offset, 5 size, 7 slices."""
    fields = _proto_fields(value)
    dims = [
        _number(dim, 1, name)
        for shape in _messages(fields, 2, name)
        for dim in _messages(shape, 2, name)
    ]
    if any(d < 0 for d in dims):
        raise _Damaged(f"{name!r} has shape {dims}")
    if 7 in fields:  # TensorFlow reads these through another path, never checked here
        raise _Damaged(
            f"{name!r} is a partitioned variable's slice, which the `t5` library never writes"
        )
    dtype, shard, offset, size = (_number(fields, n, name) for n in (1, 3, 4, 5))
    return _Entry(dtype, tuple(dims), shard, offset, size)


def read_index(index: bytes) -> tuple[int, dict[str, _Entry]]:
    """(number of data shards, {variable name: entry}) of a checkpoint's .index bytes; _Damaged
    when they are not a complete, consistent index."""
    table = index_records(index)
    if b"" not in table:
        raise _Damaged("no header record")
    num_shards = _number(_proto_fields(table.pop(b"")), 1, "header")
    if not 1 <= num_shards < 1 << 31:
        raise _Damaged(f"a header naming {num_shards} data shards")
    entries = {}
    for key, value in table.items():
        try:
            name = key.decode("utf-8")
        except UnicodeDecodeError:
            raise _Damaged(f"a variable name that is not text: {key[:40]!r}") from None
        entries[name] = _entry(name, value)
    return num_shards, entries


def _check_entries(entries: dict[str, _Entry], shard_sizes: list[int]) -> None:
    """Each tensor lies inside its data shard and, of a fixed-size type, fills exactly its
    shape: TensorFlow allocates the shape before it reads the bytes."""
    total = sum(shard_sizes)
    for name, entry in entries.items():
        elements = math.prod(entry.shape)
        where = f"{name!r} (shape {list(entry.shape)}, {entry.size:,} bytes)"
        if not 0 <= entry.shard < len(shard_sizes):
            raise _Damaged(f"{where} is in shard {entry.shard}, of {len(shard_sizes)}")
        if entry.offset < 0 or entry.size < 0:
            raise _Damaged(f"{where} is at offset {entry.offset:,}")
        if entry.offset + entry.size > shard_sizes[entry.shard] or elements > total:
            raise _Damaged(f"{where} lies past the end of its data shard")
        itemsize = _ITEMSIZES.get(entry.dtype)
        if itemsize is None and entry.dtype != _STRING_DTYPE:
            raise _Damaged(f"{where} has data type {entry.dtype}, not a number type")
        if itemsize is not None and elements * itemsize != entry.size:
            raise _Damaged(f"{where} does not hold the bytes of its shape")


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
    prefix = named if named.startswith("/") or "://" in named else os.path.join(path, named)
    if not remote.answered(epath.Path(prefix + ".index").exists, path=prefix, setting=_WHAT):
        raise UserError(
            f"cannot read a TensorFlow checkpoint at {path} ({state} names {named}, but "
            f"{prefix}.index is not there); give a complete checkpoint"
        )
    return prefix


def checked_index(prefix: str) -> tuple[dict[str, _Entry], int]:
    """The entries of `prefix`.index, once every data shard it names is there and holds
    every tensor's bytes; and the number of shards. Damage is one UserError."""
    index_path = prefix + ".index"
    index = user_files.read_bytes(index_path, what=_WHAT, max_bytes=_MAX_INDEX_BYTES)
    try:
        num_shards, entries = read_index(index)
    except _Damaged as e:
        raise UserError(f"{_WHAT}: {index_path} is damaged ({e}); give an undamaged copy") from None
    shard_sizes = []
    for shard in range(num_shards):  # stops at the first one missing
        shard_sizes.append(user_files.size(shard_path(prefix, shard, num_shards), what=_WHAT))
    try:
        _check_entries(entries, shard_sizes)
    except _Damaged as e:
        raise UserError(
            f"{_WHAT}: {prefix} is damaged or incomplete ({e}); give an undamaged copy"
        ) from None
    return entries, num_shards


class MeshTFCheckpoint(param_mapping.CheckpointReader):
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
            if entry.shape != () or entry.dtype not in (_INT32, _INT64):
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
