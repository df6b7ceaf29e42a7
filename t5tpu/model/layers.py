"""T5 building blocks in flax linen, with T5X's parameter names and logical axis names.

Parameters are float32 masters annotated with logical axes (see partitioning.py for the rules
that map them onto the ('data', 'model') mesh); inference may hand in bfloat16 copies
(precision.cast_params). Activations run in the configured dtype, and every matmul goes through
precision.einsum (bfloat16 inputs, float32 accumulation in bfloat16 mode); softmax, layer-norm
statistics, the relative position bias and the logits are float32.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from t5tpu.model import lora as lora_adapters
from t5tpu.model import precision

Array = jax.Array
Initializer = Callable

# T5X initializers: fan-in scaled truncated normal for dense kernels, unit normal embeddings.
default_kernel_init = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")
embedding_init = nn.initializers.normal(stddev=1.0)

ACTIVATIONS = {
    "relu": nn.relu,
    "gelu": lambda x: nn.gelu(x, approximate=True),  # T5 1.1's "gelu_new"
    "silu": nn.silu,
    "linear": lambda x: x,
}


def param_with_axes(module, name, init, shape, axes):
    """A float32 parameter annotated with logical axis names."""
    return module.param(name, nn.with_logical_partitioning(init, axes), shape, jnp.float32)


def constrain(x: Array, axes: Sequence[str | None]) -> Array:
    """Sharding hint for an activation, by logical axis names (a no-op outside a mesh)."""
    return nn.with_logical_constraint(x, axes)


class DenseGeneral(nn.Module):
    """A bias-free dense layer over the last `len(in_axes)` input dims (T5 has no biases)."""

    features: tuple[int, ...]
    kernel_axes: tuple[str, ...]
    num_in_dims: int = 1
    dtype: jnp.dtype = jnp.float32
    kernel_init: Initializer = default_kernel_init
    output_dtype: jnp.dtype | None = None  # None: `dtype` (the logits ask for float32)
    # Settings of a low-rank adapter beside the kernel (model/lora.py); None: no adapter.
    lora: lora_adapters.LoraSettings | None = None

    @nn.compact
    def __call__(self, x: Array) -> Array:
        in_shape = x.shape[-self.num_in_dims :]
        fan_in = math.prod(in_shape)
        # Initialize as a 2-D (fan_in, fan_out) matrix so fan-in scaling is right for
        # multi-dimensional kernels such as (heads, head_dim, embed).
        flat_shape = (fan_in, math.prod(self.features))

        def init(key, shape, dtype):
            return self.kernel_init(key, flat_shape, dtype).reshape(shape)

        kernel = param_with_axes(self, "kernel", init, in_shape + self.features, self.kernel_axes)
        # One 2-D matmul [tokens, fan_in] x [fan_in, fan_out]: the same products as contracting
        # the original dims, but its gradient w.r.t. the kernel is a plain 2-D matmul too. With
        # the batch and length dims left separate, XLA on CPU transposes the incoming gradient
        # (fused into the elementwise backward, e.g. of gated-GELU) before that matmul, which
        # slowed the MLP backward markedly (docs/PERFORMANCE.md, "Changes").
        rows = x.reshape((-1, fan_in))
        flat_kernel = kernel.reshape(flat_shape)
        out = precision.einsum("mk,kn->mn", rows, flat_kernel, self.dtype, self.output_dtype)
        if self.lora is not None:
            out = out + self._adapter_output(rows, in_shape).astype(out.dtype)
        return out.reshape(x.shape[: x.ndim - self.num_in_dims] + self.features)

    def _adapter_output(self, rows: Array, in_shape: tuple[int, ...]) -> Array:
        return lora_adapters.adapter_output(
            self,
            rows,
            in_shape=in_shape,
            features=self.features,
            kernel_axes=self.kernel_axes,
            settings=self.lora,
            dtype=self.dtype,
            einsum=precision.einsum,
        )


class RMSNorm(nn.Module):
    """T5's layer norm: scale only, no bias, no mean subtraction."""

    epsilon: float = 1e-6
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: Array) -> Array:
        scale = param_with_axes(self, "scale", nn.initializers.ones, (x.shape[-1],), ("embed",))
        return rms_normalized(x, scale, self.dtype, epsilon=self.epsilon)


def rms_normalized(x: Array, scale: Array, dtype, *, axis: int = -1, epsilon: float = 1e-6):
    """RMSNorm's arithmetic over the feature `axis` of `x` (float32 inside, `dtype` out)."""
    x32 = x.astype(jnp.float32)
    variance = jnp.mean(jnp.square(x32), axis=axis, keepdims=True)
    shape = [1] * x.ndim
    shape[axis] = -1
    return (x32 * jax.lax.rsqrt(variance + epsilon) * scale.reshape(shape)).astype(dtype)


class Embed(nn.Module):
    """Token embedding; `attend` reuses it as the output layer when logits are tied."""

    num_embeddings: int
    features: int
    dtype: jnp.dtype = jnp.float32

    def setup(self):
        self.embedding = param_with_axes(
            self,
            "embedding",
            embedding_init,
            (self.num_embeddings, self.features),
            ("vocab", "embed"),
        )

    def __call__(self, ids: Array) -> Array:
        return embedded(self.embedding, ids).astype(self.dtype)

    def attend(self, x: Array) -> Array:
        """float32 logits of `x` against every embedding row."""
        rows = x.reshape((-1, x.shape[-1]))
        table = from_bits(self.embedding)
        logits = precision.einsum("md,vd->mv", rows, table, self.dtype, jnp.float32)
        return logits.reshape(x.shape[:-1] + (self.num_embeddings,))


def embedded(table: Array, ids: Array) -> Array:
    """The rows of an embedding table (held in bfloat16 or as its bits) for `ids`."""
    return from_bits(precision.on_bits(lambda t: jnp.take(t, ids, axis=0), table))


def embeddings_as_bits(params):
    """`params` with each bfloat16 embedding table held as its bits (uint16), as the decoding
    engine keeps them (Embed reads either). Inside a decoding loop XLA:CPU hoists the table's
    conversion to bits out of the loop and so copies the whole table at every call of the
    program; a table that comes in as bits costs nothing. `params` itself when it holds no
    bfloat16 table."""

    def bf16_table(path, x) -> bool:
        return _is_embedding(path) and x.dtype == jnp.bfloat16

    if not any(bf16_table(*leaf) for leaf in jax.tree_util.tree_leaves_with_path(params)):
        return params

    def held(path, x):
        if not bf16_table(path, x):
            return x
        to_bits = lambda table: jax.lax.bitcast_convert_type(table, jnp.uint16)
        return jax.jit(to_bits, out_shardings=x.sharding)(x)

    return jax.tree_util.tree_map_with_path(held, params)


def embeddings_from_bits(params):
    """`params` with embedding tables held as bits (embeddings_as_bits) back in bfloat16."""
    back = lambda path, x: from_bits(x) if _is_embedding(path) else x
    return jax.tree_util.tree_map_with_path(back, params)


def _is_embedding(path) -> bool:
    return getattr(path[-1], "key", None) == "embedding"


def from_bits(x: Array) -> Array:
    """A bfloat16 array held as its bits (uint16) back in bfloat16; any other as it is."""
    return jax.lax.bitcast_convert_type(x, jnp.bfloat16) if x.dtype == jnp.uint16 else x


def relative_position_bucket(
    relative_position: Array, bidirectional: bool, num_buckets: int, max_distance: int
) -> Array:
    """T5's bucketing of key-minus-query distances: exact when close, logarithmic when far."""
    n = -relative_position
    if bidirectional:
        num_buckets //= 2
        offset = (n < 0).astype(jnp.int32) * num_buckets
        n = jnp.abs(n)
    else:
        offset = 0
        n = jnp.maximum(n, 0)
    max_exact = num_buckets // 2
    is_small = n < max_exact
    # log-spaced buckets between max_exact and max_distance; float32 so it matches T5 exactly.
    log_ratio = jnp.log(jnp.maximum(n, 1).astype(jnp.float32) / max_exact) / math.log(
        max_distance / max_exact
    )
    large = max_exact + (log_ratio * (num_buckets - max_exact)).astype(jnp.int32)
    large = jnp.minimum(large, num_buckets - 1)
    return offset + jnp.where(is_small, n, large)


class RelativePositionBias(nn.Module):
    """Per-head bias added to attention logits: one per stack, computed once and shared by its
    layers (T5, mT5), or one in every layer (umT5: T5Config.relative_bias_per_layer)."""

    num_heads: int
    bidirectional: bool
    num_buckets: int = 32
    max_distance: int = 128
    dtype: jnp.dtype = jnp.float32  # of the matmul's inputs; the bias is float32

    @nn.compact
    def __call__(self, query_positions: Array, key_positions: Array) -> Array:
        """A float32 bias [1, heads, q, k] for query positions [q], or [rows, heads, q, k] for
        [rows, q] (decoding rows that stand at different positions), over key positions [k]."""
        rel_embedding = param_with_axes(
            self,
            "rel_embedding",
            default_kernel_init,
            (self.num_heads, self.num_buckets),
            ("heads", "relpos_buckets"),
        )
        queries = query_positions.reshape(-1)  # the rows' queries one after another
        relative = key_positions[None, :] - queries[:, None]
        buckets = relative_position_bucket(
            relative, self.bidirectional, self.num_buckets, self.max_distance
        )
        # A one-hot contraction instead of a gather: it partitions cleanly along heads.
        one_hot = jax.nn.one_hot(buckets, self.num_buckets, dtype=self.dtype)
        bias = precision.einsum("hb,qkb->hqk", rel_embedding, one_hot, self.dtype, jnp.float32)
        if query_positions.ndim == 1:
            return bias[None]
        rows, length = query_positions.shape
        return jnp.swapaxes(bias.reshape(self.num_heads, rows, length, -1), 0, 1)


CACHE_AXES = ("batch", "heads", "length", "kv")


def _share_key_value_rows(query: Array, bias: Array | None, kv_rows: int):
    """Lets consecutive query rows share one row of keys/values.

    Beam search keeps one copy of each example's cross-attention cache for all its beams: with
    `kv_rows` key rows and `group` times as many query rows, each group of consecutive query rows
    becomes one row with `group` times as many query positions. Those rows share their bias too
    (it depends only on the example's encoder tokens), so the group's first row's bias is used.
    The caller reshapes the output back to the query's rows.
    """
    rows = query.shape[0]
    if rows == kv_rows:
        return query, bias
    if query.shape[1] != 1 or rows % kv_rows:
        raise ValueError(f"{rows} rows of one query position cannot share {kv_rows} key rows")
    group = rows // kv_rows
    query = query.reshape((kv_rows, group * query.shape[1]) + query.shape[2:])
    if bias is not None and bias.shape[0] == rows:
        bias = bias.reshape((kv_rows, group) + bias.shape[1:])[:, 0]
    return query, bias


class MultiHeadAttention(nn.Module):
    """Dot-product attention with T5's unscaled logits (the scale is folded into the query init).

    With `decode=True` the layer keeps a key/value cache in the 'cache' collection:
    self-attention writes one new position per call at `decode_position`; cross-attention projects
    the encoder output once, when the cache is created, and reads it afterwards.
    """

    num_heads: int
    head_dim: int
    dropout_rate: float = 0.0
    dtype: jnp.dtype = jnp.float32
    lora: lora_adapters.LoraSettings | None = None  # adapters of the targets it names

    def _adapter(self, name: str) -> lora_adapters.LoraSettings | None:
        target = lora_adapters.ATTENTION_TARGETS[name]
        return self.lora if self.lora and self.lora.adapts(target) else None

    def _project(self, name, x, scale=1.0):
        init = nn.initializers.variance_scaling(scale, "fan_in", "truncated_normal")
        dense = DenseGeneral(
            (self.num_heads, self.head_dim),
            ("embed", "heads", "kv"),
            dtype=self.dtype,
            kernel_init=init,
            lora=self._adapter(name),
            name=name,
        )
        return constrain(dense(x), ("batch", "length", "heads", "kv"))

    @nn.compact
    def __call__(
        self,
        inputs_q: Array,
        inputs_kv: Array | None,
        bias: Array | None,
        deterministic: bool,
        decode: bool = False,
        decode_position: Array | None = None,
        cross: bool = False,
    ) -> Array:
        query = self._project("query", inputs_q, scale=1.0 / self.head_dim)
        if decode:
            # The cache is head-major ([batch, heads, length, head_dim]), the layout the
            # attention matmuls read, so no decoding step transposes the whole cache.
            key, value = self._cached_key_value(inputs_kv, decode_position, cross)
        else:
            key = self._project("key", inputs_kv)
            value = self._project("value", inputs_kv)
        if decode:
            out = attend(query, key, value, bias, self.dtype)
        else:
            logits = precision.einsum("bqhd,bkhd->bhqk", query, key, self.dtype, jnp.float32)
            if bias is not None:
                logits = logits + bias
            weights = jax.nn.softmax(logits, axis=-1).astype(self.dtype)
            if not deterministic and self.dropout_rate > 0:
                weights = nn.Dropout(self.dropout_rate, broadcast_dims=(-2,))(weights, False)
            out = precision.einsum("bhqk,bkhd->bqhd", weights, value, self.dtype)
        dense = DenseGeneral(
            (inputs_q.shape[-1],),
            ("heads", "kv", "embed"),
            num_in_dims=2,
            dtype=self.dtype,
            lora=self._adapter("out"),
            name="out",
        )
        return dense(out)

    def _project_head_major(self, name, x):
        return constrain(jnp.swapaxes(self._project(name, x), 1, 2), CACHE_AXES)

    def _cached_key_value(self, inputs_kv, decode_position, cross):
        """Cached keys and values, [batch, heads, length, head_dim]."""
        creating = not self.has_variable("cache", "cached_key")
        if cross:
            # inputs_kv (the encoder output) is only needed when the cache is created.
            k = self.variable("cache", "cached_key", self._project_head_major, "key", inputs_kv)
            v = self.variable("cache", "cached_value", self._project_head_major, "value", inputs_kv)
            return k.value, v.value
        # Self-attention: the cache is created from a full-length dummy target, then filled one
        # position per step. Creation must not write anything.
        batch, length = inputs_kv.shape[:2]
        shape = (batch, self.num_heads, length, self.head_dim)
        k = self.variable("cache", "cached_key", jnp.zeros, shape, self.dtype)
        v = self.variable("cache", "cached_value", jnp.zeros, shape, self.dtype)
        if not creating:
            for cached, name in ((k, "key"), (v, "value")):
                new = self._project_head_major(name, inputs_kv).astype(cached.value.dtype)
                cached.value = write_position(cached.value, new, decode_position)
        return k.value, v.value


def attend(query: Array, key: Array, value: Array, bias: Array | None, dtype) -> Array:
    """Decoding's attention of `query` ([rows, q, heads, head_dim]) over head-major cached
    `key`/`value` ([kv rows, heads, length, head_dim]): [rows, q, heads, head_dim]."""
    rows = query.shape[0]
    query, bias = _share_key_value_rows(query, bias, key.shape[0])
    logits = precision.einsum("bqhd,bhkd->bhqk", query, key, dtype, jnp.float32)
    if bias is not None:
        logits = logits + bias
    weights = jax.nn.softmax(logits, axis=-1).astype(dtype)
    # Head-major out, then one small transpose: XLA:CPU ran the "bqhd" form as per-head
    # [head_dim, keys] x [keys, queries] products, slow when beam search's query rows share a
    # cache row; greedy steps are unaffected (docs/PERFORMANCE.md, "Changes").
    out = jnp.swapaxes(precision.einsum("bhqk,bhkd->bhqd", weights, value, dtype), 1, 2)
    return out.reshape((rows, -1) + out.shape[2:])


def bias_from_mask(mask: Array) -> Array:
    """An additive float32 attention bias: 0 where `mask` holds, -1e10 where not."""
    return jnp.where(mask, 0.0, -1e10).astype(jnp.float32)


def write_position(cache: Array, new: Array, position: Array) -> Array:
    """Writes `new` ([batch, heads, 1, kv]) into the cache at `position`: one position for every
    row (a scalar), or each row's own ([batch]) when rows decode at different positions."""
    if cache.dtype == jnp.bfloat16:
        return precision.on_bits(lambda c, n: write_position(c, n, position), cache, new)
    if jnp.ndim(position) == 0:
        return jax.lax.dynamic_update_slice(cache, new, (0, 0, position, 0))
    at = jnp.arange(cache.shape[2])[None, None, :, None] == position[:, None, None, None]
    return jnp.where(at, new, cache)


class MlpBlock(nn.Module):
    """T5 feed-forward: ReLU (T5 1.0, kernel `wi`) or gated (T5 1.1's gated-GELU, `wi_0/wi_1`)."""

    mlp_dim: int
    activations: tuple[str, ...]
    dropout_rate: float = 0.0
    dtype: jnp.dtype = jnp.float32
    lora: lora_adapters.LoraSettings | None = None  # adapters of the targets it names

    def _adapter(self, name: str) -> lora_adapters.LoraSettings | None:
        target = lora_adapters.mlp_target(name)
        return self.lora if self.lora and self.lora.adapts(target) else None

    @nn.compact
    def __call__(self, x: Array, deterministic: bool) -> Array:
        hidden = None
        for i, name in enumerate(self.activations):
            dense_name = "wi" if len(self.activations) == 1 else f"wi_{i}"
            # The activation reads the matmul's float32 sums and is rounded once: on CPU a
            # bfloat16 GELU rounds after every elementwise op, slower than the matmul before it.
            h = DenseGeneral(
                (self.mlp_dim,),
                ("embed", "mlp"),
                dtype=self.dtype,
                output_dtype=jnp.float32,
                lora=self._adapter(dense_name),
                name=dense_name,
            )(x)
            h = ACTIVATIONS[name](h)
            hidden = h if hidden is None else hidden * h
        hidden = constrain(hidden.astype(self.dtype), ("batch", "length", "mlp"))
        hidden = nn.Dropout(self.dropout_rate, broadcast_dims=(-2,))(hidden, deterministic)
        wo = DenseGeneral(
            (x.shape[-1],), ("mlp", "embed"), dtype=self.dtype, lora=self._adapter("wo"), name="wo"
        )
        return wo(hidden)
