"""A decoding step with the decoder's activations held feature-major, for XLA:CPU.

XLA:CPU runs a bfloat16 dot fast in one orientation: the weight on the left, contracting its
last dim, the rows on the right, a [features, rows] result. Then YNNPACK streams the weight as
it lies in memory; in the network's own orientation ([rows, in] x [in, out]) it was measured
reading a decoding step's weights at a third of the memory's rate (docs/PERFORMANCE.md,
scripts/bench/dot_orientation.py). This step reads the same caches as the network's decode
(network.py) and returns the same logits, with each decoder kernel held transposed ([out, in],
`Weights`, made once by the engine), the hidden state flowing as [features, rows] from dot to
dot, and the attention over the caches done by the network's own function (layers.attend).

Where a step runs here is decided once, by `applies`: CPU programs of a bfloat16 model with its
layers unrolled and no LoRA adapters. The engine then holds the weights (`held`) and
`decoding.run_segment` takes this step; everything else runs the network's decode.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental.layout import Layout, with_layout_constraint

from t5tpu.model import layers
from t5tpu.model.network import T5Config

Array = jax.Array

_NORMS = ("pre_self_attention_layer_norm", "pre_cross_attention_layer_norm", "pre_mlp_layer_norm")
_SELF, _CROSS = "self_attention", "encoder_decoder_attention"


def applies(config, platform: str) -> bool:
    """Whether decoding steps of `config` on `platform` run here."""
    return (
        isinstance(config, T5Config)  # T5Gemma's decoder runs its network's own step
        and platform == "cpu"
        and config.dtype == "bfloat16"
        and not config.scan_layers
        and config.lora is None
    )


@dataclasses.dataclass(frozen=True)
class Weights:
    """The decoder's parameters as this step reads them: each layer's kernels as [out, in] (by
    "block/name") and norm scales, the final norm's scale, the self-attention position-bias
    table (None where each layer has its own, as its "relpos": umT5), the output layer as
    [vocab, embed] and the token table as the engine holds it."""

    layers: tuple
    final_norm: Array
    relpos: Array | None
    output: Array
    embedding: Array


jax.tree_util.register_dataclass(
    Weights, data_fields=["layers", "final_norm", "relpos", "output", "embedding"], meta_fields=[]
)


def held(config, params, partitioner) -> Weights | None:
    """The weights a decoding engine holds beside `params` (cast, embedding table as bits) for
    this step, replicated; None where the step does not apply. A copy of the decoder's
    kernels, made once."""
    if not applies(config, partitioner.mesh.devices.flat[0].platform):
        return None
    made = jax.jit(lambda p: weights(config, p), out_shardings=partitioner.replicated())
    return made(params)


def weights(config, params) -> Weights:
    """The decoder's kernels transposed, from the network's parameters."""
    decoder, table = params["decoder"], params["token_embedder"]["embedding"]
    per_layer = []
    for i in range(config.num_decoder_layers):
        layer = decoder[f"layers_{i}"]
        mine = {name: layer[name]["scale"] for name in _NORMS}
        for block, names in ((_SELF, ("query", "key", "value")), (_CROSS, ("query",))):
            for name in names:
                mine[f"{block}/{name}"] = _out_in(layer[block][name]["kernel"], in_dims=1)
            mine[f"{block}/out"] = _out_in(layer[block]["out"]["kernel"], in_dims=2)
        for name, dense in layer["mlp"].items():
            mine[f"mlp/{name}"] = _out_in(dense["kernel"], in_dims=1)
        if config.relative_bias_per_layer:
            mine["relpos"] = layer["relpos_bias"]["rel_embedding"]
        per_layer.append(mine)
    tied = config.logits_via_embedding
    shared = None if config.relative_bias_per_layer else decoder["relpos_bias"]["rel_embedding"]
    return Weights(
        layers=tuple(per_layer),
        final_norm=decoder["decoder_norm"]["scale"],
        relpos=shared,
        output=layers.from_bits(table) if tied else decoder["logits_dense"]["kernel"].T,
        embedding=table,
    )


def _out_in(kernel: Array, *, in_dims: int) -> Array:
    """A kernel whose first `in_dims` dims are its inputs as one [out, in] matrix."""
    fan_in = 1
    for size in kernel.shape[:in_dims]:
        fan_in *= size
    return kernel.reshape(fan_in, -1).T


def transposed(x: Array) -> Array:
    """A 2-D x.T written out row-major: a plain transpose beside a dot is folded into the dot,
    in a form XLA:CPU runs only in float32, its weight converted at every call."""
    return with_layout_constraint(x.T, Layout(major_to_minor=(0, 1)))


def step(config, w: Weights, cache, encoder_tokens: Array, token: Array, position: Array):
    """Feeds each row its `token` at its own `position` ([rows] each): (float32 logits as
    [vocab, rows], the updated cache). Call it inside a jitted program."""
    dtype = config.activation_dtype
    with jax.named_scope("token_embedder"):
        y = transposed(layers.embedded(w.embedding, token).astype(dtype))  # [embed, rows]
    max_length = cache["decoder"]["max_length"].shape[0]
    self_bias = lambda table: _self_bias(config, table, position, max_length)  # noqa: E731
    biases = {_CROSS: layers.bias_from_mask((encoder_tokens > 0)[:, None, None, :])}
    if w.relpos is not None:  # one table for every layer: its bias made once
        biases[_SELF] = self_bias(w.relpos)
    caches = dict(cache["decoder"])
    for i, weights_i in enumerate(w.layers):
        with jax.named_scope(f"layers_{i}"):
            if w.relpos is None:
                biases = {**biases, _SELF: self_bias(weights_i["relpos"])}
            y, caches[f"layers_{i}"] = _layer(
                config, weights_i, caches[f"layers_{i}"], y, biases, position
            )
    with jax.named_scope("decoder_norm"):
        y = _norm(y, w.final_norm, dtype)
    with jax.named_scope("logits_dense"):
        logits = dense(w.output, y, jnp.float32)
    if config.logits_via_embedding:  # T5 1.0 rescales its tied output layer
        logits = logits / jnp.sqrt(jnp.float32(config.emb_dim))
    return logits, {**cache, "decoder": caches}


def _layer(config, w: dict, cache: dict, y: Array, biases: dict, position: Array):
    """layers.DecoderLayer's decoding step, feature-major: (y, the layer's updated cache)."""
    dtype = config.activation_dtype
    cache = dict(cache)
    own = dict(cache[_SELF])
    with jax.named_scope("pre_self_attention_layer_norm"):
        h = _norm(y, w["pre_self_attention_layer_norm"], dtype)
    with jax.named_scope(_SELF):
        for name in ("key", "value"):
            with jax.named_scope(name):
                new = _heads(config, dense(w[f"{_SELF}/{name}"], h, dtype))
            head_major = jnp.swapaxes(new, 1, 2)  # [rows, heads, 1, head_dim]
            own[f"cached_{name}"] = layers.write_position(
                own[f"cached_{name}"], head_major, position
            )
        y = y + _attention(config, w, _SELF, h, biases[_SELF], own)
    cache[_SELF] = own
    with jax.named_scope("pre_cross_attention_layer_norm"):
        h = _norm(y, w["pre_cross_attention_layer_norm"], dtype)
    with jax.named_scope(_CROSS):
        y = y + _attention(config, w, _CROSS, h, biases[_CROSS], cache[_CROSS])
    with jax.named_scope("pre_mlp_layer_norm"):
        h = _norm(y, w["pre_mlp_layer_norm"], dtype)
    with jax.named_scope("mlp"):
        y = y + _mlp(config, w, h)
    return y, cache


def _attention(config, w: dict, block: str, h: Array, bias: Array, cache: dict) -> Array:
    """One attention block over its cached keys and values: [embed, rows]."""
    dtype = config.activation_dtype
    with jax.named_scope("query"):
        query = _heads(config, dense(w[f"{block}/query"], h, dtype))
    out = layers.attend(query, cache["cached_key"], cache["cached_value"], bias, dtype)
    with jax.named_scope("out"):
        return dense(w[f"{block}/out"], transposed(out.reshape(out.shape[0], -1)), dtype)


def _heads(config, x: Array) -> Array:
    """[heads * head_dim, rows] -> [rows, 1, heads, head_dim], as the attention reads it."""
    return transposed(x).reshape(x.shape[1], 1, config.num_heads, config.head_dim)


def _mlp(config, w: dict, h: Array) -> Array:
    """layers.MlpBlock, feature-major: the activations read float32 sums, rounded once."""
    dtype, activations = config.activation_dtype, config.mlp_activations
    hidden = None
    for i, name in enumerate(activations):
        with jax.named_scope("wi" if len(activations) == 1 else f"wi_{i}"):
            kernel = w["mlp/wi" if len(activations) == 1 else f"mlp/wi_{i}"]
            part = layers.ACTIVATIONS[name](dense(kernel, h, jnp.float32))
        hidden = part if hidden is None else hidden * part
    with jax.named_scope("wo"):
        return dense(w["mlp/wo"], hidden.astype(dtype), dtype)


def dense(weight: Array, x: Array, out_dtype) -> Array:
    """[out, in] x [in, rows] -> [out, rows]: bfloat16 products summed in float32. One row is
    fed twice: XLA:CPU runs a one-column right operand only in float32."""
    if x.shape[1] == 1:
        return dense(weight, jnp.broadcast_to(x, (x.shape[0], 2)), out_dtype)[:, :1]
    out = jnp.einsum("nk,km->nm", weight, x, preferred_element_type=jnp.float32)
    return out.astype(out_dtype)


def _norm(x: Array, scale: Array, dtype) -> Array:
    """layers.RMSNorm over the feature axis (0)."""
    return layers.rms_normalized(x, scale, dtype, axis=0)


def _self_bias(config, table: Array, position: Array, max_length: int) -> Array:
    """Each row's self-attention bias over the cache ([rows, heads, 1, max_length]): the
    relative position bias from its own position plus the mask of positions it has not
    written (network._one_step_self_attention, read as a gather of the bias table)."""
    keys = jnp.arange(max_length)
    buckets = layers.relative_position_bucket(
        keys[None, :] - position[:, None],
        False,
        config.relative_attention_num_buckets,
        config.relative_attention_max_distance,
    )
    position_bias = jnp.take(table.astype(jnp.float32), buckets, axis=1)  # [heads, rows, keys]
    visible = (keys[None, :] <= position[:, None])[:, None, None, :]
    return jnp.swapaxes(position_bias, 0, 1)[:, :, None, :] + layers.bias_from_mask(visible)
