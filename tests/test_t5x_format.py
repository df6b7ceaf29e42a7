"""T5X native checkpoints: a fixture writer produces checkpoint_N/ exactly as T5X's Checkpointer
lays it out (a msgpack `checkpoint` index of {'version': 3, 'optimizer': {'target', 'state'}},
leaves either inline arrays or tensorstore zarr specs with paths relative to the checkpoint),
and the importer must give back the parameters it was written from."""

from __future__ import annotations

import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import msgpack
import numpy as np
import pytest
import tensorstore as ts
from flax import traverse_util

from t5tpu.errors import UserError
from t5tpu.formats import conversion, param_mapping, t5x_format
from t5tpu.model.network import T5Config, Transformer

STEP = 1_000_000
CONFIGS = {
    "1.0": T5Config(
        vocab_size=96,
        emb_dim=32,
        num_heads=2,
        head_dim=16,
        mlp_dim=64,
        num_encoder_layers=2,
        num_decoder_layers=2,
        mlp_activations=("relu",),
        logits_via_embedding=True,
    ),
    "1.1": T5Config(
        vocab_size=96,
        emb_dim=32,
        num_heads=2,
        head_dim=16,
        mlp_dim=64,
        num_encoder_layers=2,
        num_decoder_layers=3,
        mlp_activations=("gelu", "linear"),
        logits_via_embedding=False,
    ),
}
# Written inline in the msgpack (as T5X does for arrays it does not partition).
INLINE = {"encoder/encoder_norm/scale", "decoder/decoder_norm/scale"}
# Stored as bfloat16 (T5X's save_dtype), and as version 2 did: bfloat16 bits in uint16.
BFLOAT16 = "encoder/layers_1/mlp/wo/kernel"
UINT16_BITS = "decoder/layers_0/encoder_decoder_attention/value/kernel"
# Spec in the pre-0.1.14 tensorstore form T5X wrote on GCS: 'path' beside 'kvstore'.
OLD_SPEC = "encoder/relpos_bias/rel_embedding"


def random_params(config: T5Config, seed: int = 0) -> dict[str, np.ndarray]:
    tokens = jnp.ones((1, 4), jnp.int32)
    params = Transformer(config).init(jax.random.PRNGKey(seed), tokens, tokens)["params"]
    flat = traverse_util.flatten_dict(jax.device_get(nn.unbox(params)), sep="/")
    return {name: np.asarray(value, np.float32) for name, value in flat.items()}


def t5x_layout(name: str, array: np.ndarray) -> np.ndarray:
    """T5X's DenseGeneral keeps attention kernels 2-D: [embed, heads*kv] and [heads*kv, embed]."""
    if name.endswith(("query/kernel", "key/kernel", "value/kernel")):
        return array.reshape(array.shape[0], -1)
    if name.endswith("out/kernel"):
        return array.reshape(-1, array.shape[-1])
    return array


def _pack_ndarray(obj):
    """flax.serialization's msgpack extension 1: (shape, dtype name, C-order bytes)."""
    if isinstance(obj, np.ndarray):
        payload = msgpack.packb((obj.shape, obj.dtype.name, obj.tobytes("C")), use_bin_type=True)
        return msgpack.ExtType(1, payload)
    raise TypeError(type(obj))


def _write_zarr(directory: str, relative: str, array: np.ndarray, dtype: str) -> dict:
    chunks = [max(1, d // 2) for d in array.shape]  # several chunks per array, as on a mesh
    zarr_dtype = {"float32": "<f4", "bfloat16": "bfloat16", "uint16": "<u2"}[dtype]
    spec = {
        "driver": "zarr",
        "kvstore": {"driver": "file", "path": os.path.join(directory, relative)},
        "metadata": {
            "shape": list(array.shape),
            "chunks": chunks,
            "dtype": zarr_dtype,
            "compressor": {"id": "gzip"},
        },
    }
    store = ts.open(spec, create=True).result()
    store.write(array).result()
    return {
        "driver": "zarr",
        "dtype": dtype,
        "kvstore": {"driver": "file", "path": relative},
        "metadata": {
            "compressor": {"id": "gzip"},
            "shape": array.shape,
            "chunks": np.array(chunks),
        },
    }


def write_t5x_checkpoint(model_dir: str, params: dict[str, np.ndarray], step: int) -> str:
    """Writes checkpoint_<step>/ as T5X does; returns its path."""
    directory = os.path.join(model_dir, f"checkpoint_{step}")
    os.makedirs(directory)
    target = {}
    for name, value in params.items():
        array = t5x_layout(name, value)
        relative = "target." + name.replace("/", ".")
        if name in INLINE:
            leaf = array
        elif name == BFLOAT16:
            leaf = _write_zarr(directory, relative, array.astype(ml_dtypes.bfloat16), "bfloat16")
        elif name == UINT16_BITS:
            bits = array.astype(ml_dtypes.bfloat16).view(np.uint16)
            leaf = _write_zarr(directory, relative, bits, "uint16")
        else:
            leaf = _write_zarr(directory, relative, array, "float32")
        if name == OLD_SPEC:
            leaf["path"] = leaf["kvstore"].pop("path")
            leaf["kvstore"] = {"driver": "gcs", "bucket": "t5x-dummy-bucket"}
        target[name] = leaf
    # Adafactor slots point at zarr arrays that were never written: reading them would fail.
    slot = {
        "driver": "zarr",
        "dtype": "float32",
        "kvstore": {"driver": "file", "path": "state.param_states.missing.v_row"},
        "metadata": {"shape": [4], "chunks": np.array([4]), "compressor": {"id": "gzip"}},
    }
    state = {
        "step": np.array(step, np.int32),
        "param_states": {"token_embedder": {"embedding": {"v_row": slot, "m": np.zeros(1)}}},
    }
    index = {
        "version": 3,
        "optimizer": {
            "target": traverse_util.unflatten_dict(target, sep="/"),
            "state": state,
        },
    }
    with open(os.path.join(directory, "checkpoint"), "wb") as f:
        f.write(msgpack.packb(index, default=_pack_ndarray, use_bin_type=True))
    return directory


def expected_values(params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    rounded = {BFLOAT16, UINT16_BITS}
    return {
        name: value.astype(ml_dtypes.bfloat16).astype(np.float32) if name in rounded else value
        for name, value in params.items()
    }


@pytest.fixture(scope="module", params=list(CONFIGS))
def checkpoint(request, tmp_path_factory):
    config = CONFIGS[request.param]
    params = random_params(config)
    path = write_t5x_checkpoint(str(tmp_path_factory.mktemp("t5x")), params, STEP)
    return config, params, path


def test_imports_every_parameter_exactly(checkpoint):
    config, params, path = checkpoint
    imported = t5x_format.load_params(path, param_mapping.abstract_params(config))
    flat = traverse_util.flatten_dict(imported, sep="/")
    expected = expected_values(params)
    assert sorted(flat) == sorted(expected)
    for name, value in expected.items():
        assert flat[name].dtype == np.float32 and flat[name].shape == value.shape, name
        np.testing.assert_array_equal(flat[name], value, err_msg=name)
    # bfloat16 leaves really went through bfloat16 (and differ from the float32 originals)
    assert not np.array_equal(flat[BFLOAT16], params[BFLOAT16])


def test_geometry_and_step_come_from_the_checkpoint(checkpoint):
    config, _, path = checkpoint
    assert t5x_format.load_config(path) == config
    assert t5x_format.load_step(path) == STEP
    assert conversion.pretrained_step(path) == STEP


def test_load_pretrained_detects_the_directory_and_the_index_file(checkpoint):
    config, params, path = checkpoint
    abstract = param_mapping.abstract_params(config)
    assert conversion.detect_format(path) == "t5x"
    assert conversion.detect_format(os.path.join(path, "checkpoint")) == "t5x"
    for given in (path, os.path.join(path, "checkpoint")):
        imported = conversion.load_pretrained(given, abstract)
        np.testing.assert_array_equal(
            imported["token_embedder"]["embedding"], params["token_embedder/embedding"]
        )


def test_shardings_place_each_parameter(checkpoint):
    config, _, path = checkpoint
    abstract = param_mapping.abstract_params(config)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shardings = jax.tree_util.tree_map(lambda _: device, abstract)
    imported = conversion.load_pretrained(path, abstract, shardings)
    leaves = jax.tree_util.tree_leaves(imported)
    assert all(isinstance(x, jax.Array) and x.sharding == device for x in leaves)


def test_refuses_another_geometry_listing_names_and_shapes(checkpoint):
    config, _, path = checkpoint
    wider = T5Config(**{**config.__dict__, "num_heads": 4})
    with pytest.raises(UserError) as error:
        t5x_format.load_params(path, param_mapping.abstract_params(wider))
    message = str(error.value)
    assert f"T5X checkpoint {path} has another geometry" in message
    key = "decoder/layers_0/encoder_decoder_attention/key/kernel"
    assert f"{key}: found (32, 32) vs model (32, 64)" in message


def test_a_directory_without_a_msgpack_index_is_refused(tmp_path):
    (tmp_path / "checkpoint").write_text("model_checkpoint_path: 'model.ckpt-5'\n")
    assert not t5x_format.is_t5x_checkpoint(str(tmp_path))
    with pytest.raises(UserError, match="not a T5X checkpoint"):
        t5x_format.load_params(str(tmp_path), {})
    (tmp_path / "checkpoint").write_bytes(b"\xc1 not msgpack")
    with pytest.raises(UserError, match="not a readable T5X msgpack index"):
        t5x_format.load_config(str(tmp_path))
