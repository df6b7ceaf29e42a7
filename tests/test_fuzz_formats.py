"""Fuzzing of the checkpoint readers (tests/fuzzing.py): each format's files, damaged, read the
way `t5tpu convert` reads them, must import or end in one line (UserError) within bounded time
and memory; never a traceback, a MemoryError or an abort. Valid tiny inputs are built here."""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import os
import re
import shutil
import struct
import tempfile

import numpy as np
import pytest
import safetensors.numpy
import torch
from cli_runs import t5tpu
from flax import serialization, traverse_util
from fuzzing import FUZZ, assert_refused, damaged
from hypothesis import given
from hypothesis import strategies as st
from t5x_checkpoints import write_t5x_checkpoint
from tiny import tiny_config

from t5tpu.data import vocab
from t5tpu.formats import (
    checkpoint_reader,
    conversion,
    hf_format,
    hf_tokenizer,
    loader,
    mesh_tf_format,
    tf_bundle_index,
)
from t5tpu.model import param_shapes
from t5tpu.runtime.lazy_imports import import_tensorflow_quietly, tf
from t5tpu.storage import checkpoint_damage, checkpoints

# Tiny enough that a case reads a few kilobytes: T5 1.1 (untied, gated), one layer per stack.
CONFIG = tiny_config(
    vocab_size=32,
    emb_dim=8,
    num_heads=2,
    head_dim=4,
    mlp_dim=16,
    num_encoder_layers=1,
    num_decoder_layers=1,
)


@functools.cache
def _abstract(config):
    return param_shapes.abstract_params(config, unrolled=True)


def _params(config) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    shapes = checkpoints.flat_shapes(_abstract(config))
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def _import(path: str):
    """What `t5tpu convert` reads of a checkpoint, in its order, without writing anything."""
    source = loader.detect_format(path, "--input")
    reader = loader.IMPORTERS[source](path)
    config = reader.config()
    step = reader.step
    params = reader.load(_abstract(config))
    return reader.vocabulary(), step, params


# Every valid input is written once under here; a case replaces one file and puts it back.
_FOLDER = tempfile.TemporaryDirectory(prefix="t5tpu-fuzz-formats-")  # removed at the worker's exit
_ROOT = _FOLDER.name


@pytest.fixture(scope="module", autouse=True)
def _remove_inputs():
    yield
    shutil.rmtree(_ROOT, ignore_errors=True)


def _folder(name: str) -> str:
    path = os.path.join(_ROOT, name)
    os.makedirs(path)
    return path


def _write(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


@contextlib.contextmanager
def _replaced(path: str, data: bytes):
    """`path` holding `data` for one case, then its valid bytes again."""
    valid = _read(path)
    _write(path, data)
    try:
        yield
    finally:
        _write(path, valid)


def _assert_imports_or_refused(path: str, file: str, data: bytes):
    with _replaced(file, data):
        assert_refused(lambda: _import(path))


def _json_offsets(text: bytes) -> list[int]:
    """Where a JSON document's structure changes: around each bracket, comma and colon."""
    return [i for i, byte in enumerate(text) if byte in b",:{}[]"]


# JSON values of every type, for fields that should hold another.
_JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text(max_size=8),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=4), children, max_size=3)
    ),
    max_leaves=6,
)


def _json_paths(tree, prefix=()):
    """The path of every node of a JSON document, objects and arrays included."""
    yield prefix
    children = (
        tree.items()
        if isinstance(tree, dict)
        else enumerate(tree)
        if isinstance(tree, list)
        else ()
    )
    for key, value in children:
        yield from _json_paths(value, (*prefix, key))


def _json_with(document, path, value):
    if not path:
        return value
    document = copy.deepcopy(document)
    node = document
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return document


# ---------------------------------------------------------------------------------------------
# Hugging Face: config.json, model.safetensors, tokenizer_config.json (+ spiece.model)

HF_TENSORS = {
    hf_format.NAMES(name): hf_format.to_hf(name, array) for name, array in _params(CONFIG).items()
}
HF_DIR = _folder("hf")
HF_CONFIG = os.path.join(HF_DIR, hf_format.CONFIG_FILE)
CONFIG_JSON = json.dumps(hf_format.hf_config(CONFIG), indent=2).encode()
_write(HF_CONFIG, CONFIG_JSON)
HF_WEIGHTS = os.path.join(HF_DIR, hf_format.SAFETENSORS_FILE)
safetensors.numpy.save_file(HF_TENSORS, HF_WEIGHTS)
SAFETENSORS = _read(HF_WEIGHTS)
_HEADER_END = 8 + struct.unpack("<Q", SAFETENSORS[:8])[0]
SAFETENSORS_HEADER = json.loads(SAFETENSORS[8:_HEADER_END])
SAFETENSORS_BOUNDARIES = [8, _HEADER_END] + [
    _HEADER_END + offset
    for name, entry in SAFETENSORS_HEADER.items()
    if name != "__metadata__"
    for offset in entry["data_offsets"]
]
HF_TOKENIZER = os.path.join(HF_DIR, hf_tokenizer.TOKENIZER_CONFIG_FILE)
TOKENIZER_CONFIG = json.dumps(
    {"tokenizer_class": "T5Tokenizer", "extra_ids": 100, "model_max_length": 512}
).encode()
_write(HF_TOKENIZER, TOKENIZER_CONFIG)
shutil.copy(vocab.bundled_vocabulary_file(), os.path.join(HF_DIR, hf_tokenizer.VOCABULARY_FILE))


def test_the_valid_hugging_face_directory_imports():
    vocabulary, step, params = _import(HF_DIR)
    assert step == 0 and (vocabulary.kind, vocabulary.extra_ids) == ("sentencepiece", 100)
    np.testing.assert_array_equal(
        params["encoder"]["layers_0"]["mlp"]["wo"]["kernel"],
        HF_TENSORS["encoder.block.0.layer.1.DenseReluDense.wo.weight"].T,
    )


@FUZZ
@given(damaged(CONFIG_JSON, _json_offsets(CONFIG_JSON)))
def test_damaged_config_json(data):
    _assert_imports_or_refused(HF_DIR, HF_CONFIG, data)


@FUZZ
@given(st.sampled_from(sorted(hf_format.hf_config(CONFIG))), st.none() | _JSON_VALUES)
def test_config_json_of_wrong_types(key, value):
    config = hf_format.hf_config(CONFIG)
    if value is None:
        del config[key]
    else:
        config[key] = value
    _assert_imports_or_refused(HF_DIR, HF_CONFIG, json.dumps(config).encode())


@FUZZ
@given(damaged(SAFETENSORS, SAFETENSORS_BOUNDARIES))
def test_damaged_safetensors(data):
    _assert_imports_or_refused(HF_DIR, HF_WEIGHTS, data)


@FUZZ
@given(
    st.sampled_from(sorted(HF_TENSORS)),
    st.sampled_from(["dtype", "shape", "data_offsets", None]),
    st.none() | _JSON_VALUES,
)
def test_safetensors_header_of_wrong_types(name, key, value):
    header = json.loads(json.dumps(SAFETENSORS_HEADER))
    if key is None:
        header[name] = value
    elif value is None:
        del header[name][key]
    else:
        header[name][key] = value
    encoded = json.dumps(header).encode()
    data = struct.pack("<Q", len(encoded)) + encoded + SAFETENSORS[_HEADER_END:]
    _assert_imports_or_refused(HF_DIR, HF_WEIGHTS, data)


@FUZZ
@given(damaged(TOKENIZER_CONFIG, _json_offsets(TOKENIZER_CONFIG)))
def test_damaged_tokenizer_config(data):
    _assert_imports_or_refused(HF_DIR, HF_TOKENIZER, data)


@FUZZ
@given(st.sampled_from(["tokenizer_class", "extra_ids"]), _JSON_VALUES)
def test_tokenizer_config_of_wrong_types(key, value):
    data = json.dumps({**json.loads(TOKENIZER_CONFIG), key: value}).encode()
    _assert_imports_or_refused(HF_DIR, HF_TOKENIZER, data)


# A sharded directory: the weights in two files, which model.safetensors.index.json names.
SHARDED_DIR = _folder("hf_sharded")
shutil.copy(HF_CONFIG, SHARDED_DIR)
_SHARDS = {
    f"model-0000{n}-of-00002.safetensors": dict(list(HF_TENSORS.items())[n - 1 :: 2])
    for n in (1, 2)
}
for _name, _tensors in _SHARDS.items():
    safetensors.numpy.save_file(_tensors, os.path.join(SHARDED_DIR, _name))
SHARDED_INDEX = os.path.join(SHARDED_DIR, hf_format.SAFETENSORS_FILE + hf_format.INDEX_SUFFIX)
SHARDED_INDEX_JSON = json.dumps(
    {"weight_map": {name: file for file, tensors in _SHARDS.items() for name in tensors}}
).encode()
_write(SHARDED_INDEX, SHARDED_INDEX_JSON)


def test_the_valid_sharded_directory_imports():
    _, _, params = _import(SHARDED_DIR)
    np.testing.assert_array_equal(
        params["token_embedder"]["embedding"], HF_TENSORS["shared.weight"]
    )


@FUZZ
@given(damaged(SHARDED_INDEX_JSON, _json_offsets(SHARDED_INDEX_JSON)))
def test_damaged_safetensors_index(data):
    _assert_imports_or_refused(SHARDED_DIR, SHARDED_INDEX, data)


# ---------------------------------------------------------------------------------------------
# Hugging Face's other weight file: pytorch_model.bin (a zip of pickled tensors), which torch
# writes (the `parity` extra: scripts/test_latest.sh leaves this file out)

TORCH_DIR = _folder("hf_torch")
shutil.copy(HF_CONFIG, TORCH_DIR)
TORCH_WEIGHTS = os.path.join(TORCH_DIR, hf_format.TORCH_FILE)
torch.save({name: torch.from_numpy(array) for name, array in HF_TENSORS.items()}, TORCH_WEIGHTS)
TORCH_BYTES = _read(TORCH_WEIGHTS)
# The zip's local headers and its central directory.
TORCH_BOUNDARIES = [
    m.start() for m in re.finditer(rb"PK\x03\x04|PK\x01\x02|PK\x05\x06", TORCH_BYTES)
]


@pytest.mark.parity
def test_the_valid_torch_file_imports():
    _, _, params = _import(TORCH_DIR)
    np.testing.assert_array_equal(
        params["token_embedder"]["embedding"], HF_TENSORS["shared.weight"]
    )


@pytest.mark.parity
@FUZZ
@given(damaged(TORCH_BYTES, TORCH_BOUNDARIES))
def test_damaged_torch_file(data):
    _assert_imports_or_refused(TORCH_DIR, TORCH_WEIGHTS, data)


# ---------------------------------------------------------------------------------------------
# T5X: the msgpack `checkpoint` index and the tensorstore (zarr) arrays it names

T5X_DIR = write_t5x_checkpoint(_folder("t5x"), _params(CONFIG), 7)
T5X_INDEX = os.path.join(T5X_DIR, "checkpoint")
MSGPACK = _read(T5X_INDEX)
# Each spec's map starts at its 'driver' key; inline arrays are msgpack ext records (0xc7/0xc8).
MSGPACK_BOUNDARIES = [m.start() for m in re.finditer(rb"driver|\xc7|\xc8", MSGPACK)]
_EMBEDDING_ARRAY = os.path.join(T5X_DIR, "target.token_embedder.embedding")
ZARRAY = _read(os.path.join(_EMBEDDING_ARRAY, ".zarray"))
ZARR_CHUNK = _read(os.path.join(_EMBEDDING_ARRAY, "0.0"))


T5X_TREE = serialization.msgpack_restore(MSGPACK)
T5X_NODES = sorted(_json_paths(T5X_TREE), key=str)
# Leaves of any type msgpack holds (integers within its 64 bits): arrays of other shapes and
# dtypes among them.
_MSGPACK_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=8)
    | st.builds(
        lambda shape, dtype: np.zeros(shape, dtype),
        st.lists(st.integers(0, 3), max_size=3),
        st.sampled_from(["float32", "int8", "bool", "complex64", "uint16", "S2"]),
    ),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=4), children, max_size=3)
    ),
    max_leaves=6,
)


def test_the_valid_t5x_checkpoint_imports():
    _, step, params = _import(T5X_DIR)
    assert step == 7
    np.testing.assert_array_equal(
        params["encoder"]["encoder_norm"]["scale"], _params(CONFIG)["encoder/encoder_norm/scale"]
    )


@FUZZ
@given(damaged(MSGPACK, MSGPACK_BOUNDARIES))
def test_damaged_t5x_index(data):
    _assert_imports_or_refused(T5X_DIR, T5X_INDEX, data)


@FUZZ
@given(st.sampled_from(T5X_NODES), _MSGPACK_VALUES)
def test_t5x_index_of_wrong_structure(path, value):
    tree = _json_with(T5X_TREE, path, value)
    _assert_imports_or_refused(T5X_DIR, T5X_INDEX, serialization.msgpack_serialize(tree))


_T5X_SPECS = sorted(
    path[:-1] for path in T5X_NODES if path[-1:] == ("metadata",) and path[1:2] == ("target",)
)


@FUZZ
@given(
    st.sampled_from(_T5X_SPECS),
    st.lists(st.integers(-1, 40) | st.integers(-(2**63), 2**64 - 1), max_size=4),
)
def test_t5x_declared_shapes(spec, shape):
    """Shapes the index declares for arrays it has not read: the model is built from them."""
    tree = _json_with(T5X_TREE, (*spec, "metadata", "shape"), shape)
    _assert_imports_or_refused(T5X_DIR, T5X_INDEX, serialization.msgpack_serialize(tree))


@FUZZ
@given(damaged(ZARRAY, _json_offsets(ZARRAY)))
def test_damaged_zarr_metadata(data):
    _assert_imports_or_refused(T5X_DIR, os.path.join(_EMBEDDING_ARRAY, ".zarray"), data)


@FUZZ
@given(damaged(ZARR_CHUNK))
def test_damaged_zarr_chunk(data):
    _assert_imports_or_refused(T5X_DIR, os.path.join(_EMBEDDING_ARRAY, "0.0"), data)


# ---------------------------------------------------------------------------------------------
# Mesh TF: the `checkpoint` state file, the .index (a TensorFlow table) and the data shard

MESH_DIR = _folder("mesh_tf")
MESH_PREFIX = os.path.join(MESH_DIR, "model.ckpt-7")
MESH_INDEX = MESH_PREFIX + ".index"
MESH_DATA = mesh_tf_format.shard_path(MESH_PREFIX, 0, 1)
MESH_STATE = os.path.join(MESH_DIR, "checkpoint")


def _write_mesh_tf_checkpoint() -> None:
    """model.ckpt-7 as the `t5` library saves it (one Adafactor slot kept as a sample), with
    the state file naming it relatively, as the published ones do."""
    variables = {
        mesh_tf_format.NAMES(name): checkpoint_reader.to_flat_layout(name, array)
        for name, array in _params(CONFIG).items()
    }
    names = [*variables, "shared/embedding_slot_vr", "global_step"]
    tensors = [*map(tf.constant, variables.values()), tf.zeros([32]), tf.constant(7, tf.int64)]
    tf.raw_ops.SaveV2(
        prefix=MESH_PREFIX, tensor_names=names, shape_and_slices=[""] * len(names), tensors=tensors
    )
    _write(MESH_STATE, b'model_checkpoint_path: "model.ckpt-7"\n')


def _bundle_protos():
    """TensorFlow's tensor_bundle.proto messages, to write index records with other values."""
    import_tensorflow_quietly()
    from tensorflow.core.protobuf import tensor_bundle_pb2

    return tensor_bundle_pb2


tensor_bundle_pb2 = _bundle_protos()
_write_mesh_tf_checkpoint()
MESH_INDEX_BYTES = _read(MESH_INDEX)
MESH_RECORDS = tf_bundle_index.index_records(MESH_INDEX_BYTES)


def _varint(n: int) -> bytes:
    out = b""
    while n > 0x7F:
        out, n = out + bytes([n & 0x7F | 0x80]), n >> 7
    return out + bytes([n])


def _crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), bit by bit: the checksum of TensorFlow's table blocks."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 & -(crc & 1))
    return crc ^ 0xFFFFFFFF


def _block(records: list[tuple[bytes, bytes]]) -> bytes:
    """One table block without shared key prefixes, with its trailer: type 0 and the masked
    CRC32C that TensorFlow checks."""
    body = b"".join(_varint(0) + _varint(len(k)) + _varint(len(v)) + k + v for k, v in records)
    body += struct.pack("<II", 0, 1)  # one restart point, at 0
    crc = _crc32c(body + b"\0")
    masked = ((crc >> 15 | crc << 17) + 0xA282EAD8) & 0xFFFFFFFF
    return body + b"\0" + struct.pack("<I", masked)


def _index_bytes(records: dict[bytes, bytes]) -> bytes:
    """A .index holding `records` that TensorFlow's table reader accepts (checksums right)."""
    ordered = sorted(records.items())
    data, meta = _block(ordered), _block([])
    index = _block([(ordered[-1][0], _varint(0) + _varint(len(data) - 5))])
    handles = _varint(len(data)) + _varint(len(meta) - 5)
    handles += _varint(len(data) + len(meta)) + _varint(len(index) - 5)
    return data + meta + index + handles.ljust(40, b"\0") + struct.pack("<Q", 0xDB4775248B80FB57)


# Where the table's structure changes: between blocks, and the footer.
MESH_INDEX_BOUNDARIES = [len(MESH_INDEX_BYTES) - 48, len(MESH_INDEX_BYTES) - 8] + [
    i for i in range(len(MESH_INDEX_BYTES)) if MESH_INDEX_BYTES[i : i + 5] == b"\0" * 5
]


def test_the_valid_mesh_tf_checkpoint_imports():
    assert _index_bytes(MESH_RECORDS) != MESH_INDEX_BYTES  # TensorFlow shares key prefixes
    _write(MESH_INDEX, _index_bytes(MESH_RECORDS))
    try:
        for path in (MESH_DIR, MESH_PREFIX):
            _, step, params = _import(path)
            assert step == 7
            np.testing.assert_array_equal(
                params["decoder"]["logits_dense"]["kernel"],
                _params(CONFIG)["decoder/logits_dense/kernel"],
            )
    finally:
        _write(MESH_INDEX, MESH_INDEX_BYTES)


@FUZZ
@given(damaged(MESH_INDEX_BYTES, MESH_INDEX_BOUNDARIES))
def test_damaged_mesh_tf_index(data):
    _assert_imports_or_refused(MESH_DIR, MESH_INDEX, data)


@FUZZ
@given(
    st.sampled_from(sorted(MESH_RECORDS)),
    st.sampled_from(range(1, 8)),
    st.integers(-(2**63), 2**63 - 1) | st.integers(-2, 70),
)
def test_mesh_tf_index_entries_with_wrong_values(key, field, value):
    """Records whose checksums are right but whose numbers are not (shape, sizes, shard):
    TensorFlow's reader aborts the process on a negative dimension and allocates the shape it
    reads, so these must be refused before it opens the file."""
    if key == b"":
        message = tensor_bundle_pb2.BundleHeaderProto.FromString(MESH_RECORDS[key])
        message.num_shards = value % 2**31
    else:
        message = tensor_bundle_pb2.BundleEntryProto.FromString(MESH_RECORDS[key])
        if field == 2:
            message.shape.dim.add(size=value)
        elif field == 7:  # a partitioned variable's slice
            message.slices.add().extent.add(start=value, length=value)
        else:
            name = message.DESCRIPTOR.fields_by_number[field].name
            int32 = name in ("dtype", "shard_id", "crc32c")
            setattr(message, name, value % 2**31 if int32 else value)
    records = {**MESH_RECORDS, key: message.SerializeToString()}
    _assert_imports_or_refused(MESH_DIR, MESH_INDEX, _index_bytes(records))


@FUZZ
@given(damaged(_read(MESH_STATE), [21, 24]))
def test_damaged_mesh_tf_state_file(data):
    _assert_imports_or_refused(MESH_DIR, MESH_STATE, data)


@FUZZ
@given(damaged(_read(MESH_DATA)))
def test_damaged_mesh_tf_data(data):
    _assert_imports_or_refused(MESH_DIR, MESH_DATA, data)


def test_a_missing_data_shard_is_named(tmp_path):
    for file in (MESH_INDEX, MESH_STATE):
        shutil.copy(file, tmp_path)
    error = assert_refused(lambda: _import(str(tmp_path)))
    assert f"no file {tmp_path}/model.ckpt-7.data-00000-of-00001" in str(error)


# ---------------------------------------------------------------------------------------------
# t5tpu's own checkpoints (orbax): the metadata checkpoint_damage.py reads before orbax does

ORBAX_STEP_DIR = conversion.save_params(
    _folder("orbax"), 0, traverse_util.unflatten_dict(_params(CONFIG), sep="/")
)
ORBAX_FILES = {
    name: os.path.join(ORBAX_STEP_DIR, name)
    for name in (
        checkpoint_damage.CHECKPOINT_METADATA,
        f"params/{checkpoint_damage.ITEM_METADATA}",
        f"params/{checkpoint_damage.OCDBT_MANIFEST}",
        f"params/ocdbt.process_0/{checkpoint_damage.OCDBT_MANIFEST}",
    )
}
ORBAX_VALID = {name: _read(path) for name, path in ORBAX_FILES.items()}
_ORBAX_JSON = {
    name: json.loads(ORBAX_VALID[name])
    for name in (checkpoint_damage.CHECKPOINT_METADATA, f"params/{checkpoint_damage.ITEM_METADATA}")
}
_ORBAX_JSON_NODES = [
    (name, path) for name, document in _ORBAX_JSON.items() for path in _json_paths(document)
]


def _restore_orbax():
    return loader.open_checkpoint(ORBAX_STEP_DIR).load(_abstract(CONFIG))


def _assert_orbax_refused():
    assert_refused(_restore_orbax, threaded=True)


def test_the_valid_orbax_checkpoint_restores():
    params = _restore_orbax()
    np.testing.assert_array_equal(
        params["encoder"]["encoder_norm"]["scale"], _params(CONFIG)["encoder/encoder_norm/scale"]
    )


def _orbax_case(name: str):
    valid = ORBAX_VALID[name]
    boundaries = _json_offsets(valid) if name in _ORBAX_JSON else []  # manifests are binary
    return st.tuples(st.just(name), damaged(valid, boundaries))


@FUZZ
@given(st.sampled_from(sorted(ORBAX_FILES)).flatmap(_orbax_case))
def test_damaged_orbax_metadata(case):
    name, data = case
    with _replaced(ORBAX_FILES[name], data):
        _assert_orbax_refused()


@FUZZ
@given(st.sampled_from(_ORBAX_JSON_NODES), _JSON_VALUES)
def test_orbax_metadata_of_wrong_types(node, value):
    name, path = node
    data = json.dumps(_json_with(_ORBAX_JSON[name], path, value)).encode()
    with _replaced(ORBAX_FILES[name], data):
        _assert_orbax_refused()


# ---------------------------------------------------------------------------------------------
# The command line on damaged inputs: exit 2 and one line, where the process used to die of a
# MemoryError (a safetensors header length), a traceback (a msgpack index of the wrong
# structure) or TensorFlow's abort (a negative dimension in a checksummed .index).


def _damaged_safetensors(directory: str) -> str:
    shutil.copytree(HF_DIR, directory)
    _write(os.path.join(directory, hf_format.SAFETENSORS_FILE), b"\xff" * 8 + SAFETENSORS[8:])
    return directory


def _damaged_msgpack(directory: str) -> str:
    shutil.copytree(T5X_DIR, directory)
    tree = _json_with(T5X_TREE, ("optimizer", "target", "encoder"), [1, 2])
    _write(os.path.join(directory, "checkpoint"), serialization.msgpack_serialize(tree))
    return directory


def _negative_dimension(directory: str) -> str:
    shutil.copytree(MESH_DIR, directory)
    entry = tensor_bundle_pb2.BundleEntryProto.FromString(MESH_RECORDS[b"shared/embedding"])
    entry.shape.dim.add(size=-5)
    records = {**MESH_RECORDS, b"shared/embedding": entry.SerializeToString()}
    _write(os.path.join(directory, "model.ckpt-7.index"), _index_bytes(records))
    return directory


@pytest.mark.parametrize(
    "make, message",
    [
        (_damaged_safetensors, "model.safetensors is damaged (it declares"),
        (_damaged_msgpack, "T5X checkpoint: "),
        (_negative_dimension, "model.ckpt-7.index is damaged ('shared/embedding' has shape"),
    ],
    ids=["safetensors", "msgpack", "mesh_tf"],
)
def test_convert_refuses_a_damaged_checkpoint_in_one_line(make, message, tmp_path):
    source = make(str(tmp_path / "input"))
    run = t5tpu("convert", f"--input={source}", f"--output_dir={tmp_path / 'output'}")
    assert run.returncode == 2, run.stderr[-3000:]
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert lines[0].startswith("t5tpu: error: ") and message in lines[0], lines[0]
    assert not (tmp_path / "output").exists()
