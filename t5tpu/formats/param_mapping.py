"""Mapping another checkpoint's named tensors onto t5tpu's parameter tree.

The importers (hf_format, t5x_format, mesh_tf_format) each say, for every t5tpu parameter, which
tensor of the source holds it and how to bring it into t5tpu's layout; this module checks the
source against the model (names and shapes, all listed in one error) before reading anything,
then reads and converts tensor by tensor.

Layouts: t5tpu keeps attention kernels 3-D ([embed, heads, kv] and [heads, kv, embed]); T5X and
Mesh TensorFlow store them 2-D ([embed, heads*kv], [heads*kv, embed], heads major), the "flat
layout" below. Every other parameter has the same shape in all three.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from t5tpu.errors import UserError
from t5tpu.model.network import T5Config, Transformer
from t5tpu.storage.checkpoints import flat_shapes, geometry_differences

# Sublayers of a T5 block as the `t5` library and Hugging Face number and name them:
# t5tpu module name -> (sublayer index, T5 module name).
T5_SUBLAYERS = {
    "encoder": {
        "pre_attention_layer_norm": (0, "layer_norm"),
        "attention": (0, "SelfAttention"),
        "pre_mlp_layer_norm": (1, "layer_norm"),
        "mlp": (1, "DenseReluDense"),
    },
    "decoder": {
        "pre_self_attention_layer_norm": (0, "layer_norm"),
        "self_attention": (0, "SelfAttention"),
        "pre_cross_attention_layer_norm": (1, "layer_norm"),
        "encoder_decoder_attention": (1, "EncDecAttention"),
        "pre_mlp_layer_norm": (2, "layer_norm"),
        "mlp": (2, "DenseReluDense"),
    },
}
T5_PROJECTIONS = {"query": "q", "key": "k", "value": "v", "out": "o"}

_LAYER_PARAM = re.compile(r"(encoder|decoder)/layers_(\d+)/(\w+)/(\w+)(?:/(\w+))?$")


@dataclasses.dataclass(frozen=True)
class LayerParam:
    """A parameter inside one encoder/decoder layer, e.g. encoder/layers_3/mlp/wi_0/kernel."""

    stack: str
    index: int
    module: str  # 'attention', 'mlp', 'pre_mlp_layer_norm', ...
    part: str  # 'query', 'wi_0', 'scale', ...

    @property
    def t5_sublayer(self) -> tuple[int, str]:
        return T5_SUBLAYERS[self.stack][self.module]


def parse_layer_param(name: str) -> LayerParam | None:
    match = _LAYER_PARAM.match(name)
    if not match:
        return None
    stack, index, module, part, _ = match.groups()
    return LayerParam(stack, int(index), module, part)


def _is_attention(name: str, projections: tuple[str, ...]) -> bool:
    parts = name.split("/")
    return (
        len(parts) >= 3
        and parts[-1] == "kernel"
        and parts[-2] in projections
        and parts[-3] in ("attention", "self_attention", "encoder_decoder_attention")
    )


def flat_layout_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape T5X and Mesh TF store a t5tpu parameter in (attention kernels 2-D)."""
    if _is_attention(name, ("query", "key", "value")):
        return (shape[0], shape[1] * shape[2])
    if _is_attention(name, ("out",)):
        return (shape[0] * shape[1], shape[2])
    return tuple(shape)


def to_flat_layout(name: str, array: np.ndarray) -> np.ndarray:
    return np.asarray(array).reshape(flat_layout_shape(name, array.shape))


def as_float32(array) -> np.ndarray:
    """float32 numpy from any float array (bfloat16 and float16 included)."""
    return np.asarray(array).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class Source:
    """One stored tensor that holds a t5tpu parameter: its name and shape in the source, and
    how to turn it into t5tpu's layout (given the array read as float32)."""

    name: str
    shape: tuple[int, ...]
    to_model: Callable[[np.ndarray], np.ndarray]


def load_mapped(
    description: str,
    found: Mapping[str, tuple[int, ...]],
    read: Callable[[str], np.ndarray],
    plan: Mapping[str, Source],
    shardings=None,
):
    """Reads every parameter of `plan` (t5tpu name -> Source) from a checkpoint whose tensors
    are `found` (source name -> shape; optimizer state and aliases already left out).

    Refuses, before reading anything, a checkpoint whose names or shapes differ from the plan.
    Returns the nested parameter tree: float32 numpy arrays, or jax arrays placed with
    `shardings` (a tree like the parameters) so that only one host copy exists at a time.
    """
    expected = {source.name: source.shape for source in plan.values()}
    differences = geometry_differences(dict(found), expected)
    if differences:
        raise UserError(
            f"{description} has another geometry than the model ({differences}); use the model "
            "gin file that matches it (`t5tpu convert` writes one)"
        )
    flat_shardings = traverse_util.flatten_dict(shardings, sep="/") if shardings is not None else {}
    params = {}
    for name, source in plan.items():
        array = source.to_model(as_float32(read(source.name)))
        if name in flat_shardings:
            # Every host holds the whole array and hands each of its devices its slice, which
            # works whether or not the sharding spans other hosts' devices.
            array = jax.make_array_from_callback(
                array.shape, flat_shardings[name], lambda index, array=array: array[index]
            )
        params[name] = array
    return traverse_util.unflatten_dict(params, sep="/")


def model_shapes(abstract_params) -> dict[str, tuple[int, ...]]:
    """{'encoder/layers_0/attention/query/kernel': shape, ...} of a parameter tree."""
    return flat_shapes(abstract_params)


def config_from_flat_shapes(shapes: Mapping[str, tuple[int, ...]]) -> T5Config:
    """The T5Config of a checkpoint in t5tpu names and the flat layout (T5X, Mesh TF).

    What shapes cannot tell is taken as T5 does: a gated feed-forward (wi_0/wi_1) is T5 1.1's
    gated-GELU, and relative positions saturate at distance 128.
    """

    def need(name):
        if name not in shapes:
            raise UserError(f"checkpoint has no {name}; is it a T5 encoder-decoder checkpoint?")
        return shapes[name]

    vocab_size, emb_dim = need("token_embedder/embedding")
    num_heads, num_buckets = need("encoder/relpos_bias/rel_embedding")
    joined_kv = need("encoder/layers_0/attention/query/kernel")[1]
    mlp_dim = need("encoder/layers_0/mlp/wo/kernel")[0]
    gated = "encoder/layers_0/mlp/wi_0/kernel" in shapes

    def count(stack):
        return len({n.split("/")[1] for n in shapes if n.startswith(f"{stack}/layers_")})

    return T5Config(
        vocab_size=vocab_size,
        emb_dim=emb_dim,
        num_heads=num_heads,
        head_dim=joined_kv // num_heads,
        mlp_dim=mlp_dim,
        num_encoder_layers=count("encoder"),
        num_decoder_layers=count("decoder"),
        mlp_activations=("gelu", "linear") if gated else ("relu",),
        logits_via_embedding="decoder/logits_dense/kernel" not in shapes,
        relative_attention_num_buckets=num_buckets,
    )


def abstract_params(config: T5Config):
    """Parameter shapes of a model with this geometry, without allocating it, in the layers_N
    layout that every checkpoint format uses (whatever config.scan_layers says)."""
    tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    unrolled = Transformer(dataclasses.replace(config, scan_layers=False))
    variables = jax.eval_shape(unrolled.init, jax.random.PRNGKey(0), tokens, tokens)
    return nn.unbox(variables["params"])
