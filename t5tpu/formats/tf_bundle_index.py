"""TensorFlow's checkpoint index (model.ckpt-N.index), read and checked without TensorFlow.

TensorFlow's reader allocates what a damaged index declares (a block size, a tensor's shape) and
aborts the process on some of it, so mesh_tf_format reads the index here first and checks every
length in it against the data files before TensorFlow opens anything.

The .index file is a LevelDB-style table (tensorflow/tsl/lib/io/format.h): a 48-byte footer
(two block handles, then a magic number) names an index block whose entries are the handles of
the data blocks; each block is prefix-compressed key/value entries and a restart array, followed
by a type byte and a CRC. Keys are variable names, '' the header; values are BundleEntryProto
and BundleHeaderProto (tensorflow/core/protobuf/tensor_bundle.proto).
"""

from __future__ import annotations

import dataclasses
import math

_FOOTER_SIZE = 48
_TABLE_MAGIC = 0xDB4775248B80FB57
_BLOCK_TRAILER = 5  # type byte + masked CRC32C
_STRING_DTYPE = 7
# The integer types a step variable may have.
STEP_DTYPES = frozenset({3, 9})  # int32, int64
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


class Damaged(ValueError):
    """What is wrong with the index; MeshTFCheckpoint names the file."""


@dataclasses.dataclass(frozen=True)
class Entry:
    dtype: int
    shape: tuple[int, ...]
    shard: int
    offset: int
    size: int


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(data) or shift > 63:
            raise Damaged("a number runs past its record")
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
            raise Damaged(f"a record of wire type {wire}")
        if pos > len(data):
            raise Damaged("a record runs past its end")
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
        raise Damaged(f"a block of {size:,} bytes at {offset:,} lies past its end")
    if index[offset + size] != 0:  # TensorFlow writes bundle indexes uncompressed
        raise Damaged(f"a block of compression type {index[offset + size]}")
    return index[offset : offset + size]


def _block_entries(block: bytes):
    """(key, value) of each entry of a block, keys restored from their shared prefixes."""
    if len(block) < 4:
        raise Damaged("a block too short for its restart count")
    restarts = int.from_bytes(block[-4:], "little")
    end = len(block) - 4 * (restarts + 1)
    if end < 0:
        raise Damaged(f"a block declaring {restarts:,} restarts")
    pos, key = 0, b""
    while pos < end:
        shared, pos = _varint(block, pos)
        unshared, pos = _varint(block, pos)
        length, pos = _varint(block, pos)
        if shared > len(key) or pos + unshared + length > end:
            raise Damaged("an entry runs past its block")
        key = key[:shared] + block[pos : pos + unshared]
        pos += unshared
        yield key, block[pos : pos + length]
        pos += length


def index_records(index: bytes) -> dict[bytes, bytes]:
    """{key: value} of every record of a .index table (its blocks' checksums are left to
    TensorFlow, which checks them on reading)."""
    if len(index) < _FOOTER_SIZE:
        raise Damaged(f"{len(index)} bytes, less than a table's footer")
    footer = index[-_FOOTER_SIZE:]
    if int.from_bytes(footer[-8:], "little") != _TABLE_MAGIC:
        raise Damaged("not a TensorFlow table (no magic number at its end)")
    _, pos = _varint(footer, _varint(footer, 0)[1])  # the metaindex handle: unused
    table = {}
    for _, handle in _block_entries(_block(index, footer[pos:])):
        table.update(_block_entries(_block(index, handle)))
    return table


def _messages(fields: dict[int, list], number: int, name: str) -> list[dict[int, list]]:
    """The fields of each message in field `number` (a repeated message field)."""
    values = fields.get(number, [])
    if not all(isinstance(value, bytes) for value in values):
        raise Damaged(f"{name!r} has a field {number} of the wrong type")
    return [_proto_fields(value) for value in values]


def _number(fields: dict[int, list], number: int, name: str) -> int:
    """An integer field's last value (0 when absent), signed as int64 fields are."""
    value = fields.get(number, [0])[-1]
    if not isinstance(value, int):
        raise Damaged(f"{name!r} has a field {number} of the wrong type")
    return _signed(value)


def _entry(name: str, value: bytes) -> Entry:
    """A BundleEntryProto: 1 dtype, 2 shape (TensorShapeProto: 2 dim, each 1 size), 3 shard_id,
    4 offset, 5 size, 7 slices."""
    fields = _proto_fields(value)
    dims = [
        _number(dim, 1, name)
        for shape in _messages(fields, 2, name)
        for dim in _messages(shape, 2, name)
    ]
    if any(d < 0 for d in dims):
        raise Damaged(f"{name!r} has shape {dims}")
    if 7 in fields:  # TensorFlow reads these through another path, never checked here
        raise Damaged(
            f"{name!r} is a partitioned variable's slice, which the `t5` library never writes"
        )
    dtype, shard, offset, size = (_number(fields, n, name) for n in (1, 3, 4, 5))
    return Entry(dtype, tuple(dims), shard, offset, size)


def read_index(index: bytes) -> tuple[int, dict[str, Entry]]:
    """(number of data shards, {variable name: entry}) of a checkpoint's .index bytes; Damaged
    when they are not a complete, consistent index."""
    table = index_records(index)
    if b"" not in table:
        raise Damaged("no header record")
    num_shards = _number(_proto_fields(table.pop(b"")), 1, "header")
    if not 1 <= num_shards < 1 << 31:
        raise Damaged(f"a header naming {num_shards} data shards")
    entries = {}
    for key, value in table.items():
        try:
            name = key.decode("utf-8")
        except UnicodeDecodeError:
            raise Damaged(f"a variable name that is not text: {key[:40]!r}") from None
        entries[name] = _entry(name, value)
    return num_shards, entries


def check_entries(entries: dict[str, Entry], shard_sizes: list[int]) -> None:
    """Each tensor lies inside its data shard and, of a fixed-size type, fills exactly its
    shape: TensorFlow allocates the shape before it reads the bytes."""
    total = sum(shard_sizes)
    for name, entry in entries.items():
        elements = math.prod(entry.shape)
        where = f"{name!r} (shape {list(entry.shape)}, {entry.size:,} bytes)"
        if not 0 <= entry.shard < len(shard_sizes):
            raise Damaged(f"{where} is in shard {entry.shard}, of {len(shard_sizes)}")
        if entry.offset < 0 or entry.size < 0:
            raise Damaged(f"{where} is at offset {entry.offset:,}")
        if entry.offset + entry.size > shard_sizes[entry.shard] or elements > total:
            raise Damaged(f"{where} lies past the end of its data shard")
        itemsize = _ITEMSIZES.get(entry.dtype)
        if itemsize is None and entry.dtype != _STRING_DTYPE:
            raise Damaged(f"{where} has data type {entry.dtype}, not a number type")
        if itemsize is not None and elements * itemsize != entry.size:
            raise Damaged(f"{where} does not hold the bytes of its shape")
