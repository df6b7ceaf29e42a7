"""T5X checkpoints written as T5X's Checkpointer lays them out, for the tests of every format
that reads or converts them: a msgpack `checkpoint` index of {'version': 3, 'optimizer':
{'target', 'state'}}, leaves either inline arrays or tensorstore zarr specs with paths relative
to the checkpoint, some stored as bfloat16 or as version 2's uint16 bits. Also scalable_t5's
layout (umT5's checkpoints): 3-D attention kernels, and each stack scanned into one subtree
`encoder/encoder/...` whose leaves hold every layer along one axis."""

from __future__ import annotations

import os
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_dtypes
import msgpack
import numpy as np
import tensorstore as ts
from flax import traverse_util
from tiny import tiny_config

from t5tpu.model.network import T5Config, Transformer

STEP = 1_000_000
# Narrower than the tiny T5 and with 96 ids: T5 1.0, and T5 1.1 with one more decoder layer.
_NARROW = dict(vocab_size=96, emb_dim=32, num_heads=2, head_dim=16, mlp_dim=64)
CONFIGS = {
    "1.0": tiny_config(**_NARROW, mlp_activations=("relu",), logits_via_embedding=True),
    "1.1": tiny_config(**_NARROW, num_decoder_layers=3),
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


def scanned_layout(params: dict[str, np.ndarray], axis: int = 1) -> dict[str, np.ndarray]:
    """scalable_t5's names and shapes of unrolled parameters: each stack's layers_N leaves
    stacked along `axis` (T5X's param_scan_axis) under `encoder/encoder/...`."""
    out, layers = {}, {}
    for name, value in params.items():
        match = re.fullmatch(r"(encoder|decoder)/layers_(\d+)/(.+)", name)
        if not match:
            out[name] = value
            continue
        stack, index, rest = match.groups()
        layers.setdefault(f"{stack}/{stack}/{rest}", {})[int(index)] = value
    for name, by_index in layers.items():
        out[name] = np.stack([by_index[i] for i in range(len(by_index))], axis=axis)
    return out


def write_t5x_checkpoint(
    model_dir: str, params: dict[str, np.ndarray], step: int, layout=t5x_layout
) -> str:
    """Writes checkpoint_<step>/ as T5X does, each parameter as layout(name, array) gives it
    (T5X's flat attention kernels by default); returns its path. Parameters named by neither
    INLINE, BFLOAT16 nor UINT16_BITS are float32 zarr arrays."""
    directory = os.path.join(model_dir, f"checkpoint_{step}")
    os.makedirs(directory)
    target = {}
    for name, value in params.items():
        array = layout(name, value)
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
