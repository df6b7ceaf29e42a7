"""T5Gemma's attention: grouped-query heads, rotary positions, tanh soft-capped logits.

Query heads come in `num_kv_heads` groups, each group reading one key/value head (query head h
reads key head h // (num_heads // num_kv_heads), as Gemma 2 lays them out). Kernels carry
T5X's names and logical axes: query (embed, heads, kv), key and value (embed, kv_heads, kv) —
kv_heads named apart from heads, so the partitioning rules may place them differently — and
out (heads, kv, embed). Self-attention rotates queries and keys by their positions (RoPE, the
two halves of each head's features as Gemma pairs them); cross-attention has no positions.
Logits are scaled by query_pre_attn_scalar ** -0.5 and soft-capped, cap * tanh(logits / cap),
before the mask bias is added; softmax is float32.

With `decode=True` the layer keeps a head-major key/value cache ([batch, kv_heads, length,
head_dim]) in the 'cache' collection under the names the decoding engine knows (cached_key,
cached_value): self-attention writes one rotated key per call at `decode_position` (a scalar,
or [batch] when rows stand at positions of their own), cross-attention projects the encoder
output once, when the cache is created.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from t5tpu.model import layers, precision
from t5tpu.model import lora as lora_adapters

Array = jax.Array


def rotary_frequencies(head_dim: int, theta: float) -> np.ndarray:
    """RoPE's inverse frequencies, float32 as Gemma computes them: theta ** -(2i / head_dim)."""
    exponents = np.arange(0, head_dim, 2).astype(np.float32) / np.float32(head_dim)
    return (np.float32(1.0) / np.power(np.float32(theta), exponents)).astype(np.float32)


def rotate(x: Array, positions: Array, theta: float) -> Array:
    """`x` ([batch, length, heads, head_dim]) rotated by `positions`: [length] shared by every
    row, or [batch, length]. Computed in float32, returned in x's dtype."""
    inverse = jnp.asarray(rotary_frequencies(x.shape[-1], theta))
    angles = positions.astype(jnp.float32)[..., None] * inverse  # [(batch,) length, head_dim/2]
    angles = jnp.concatenate([angles, angles], axis=-1)
    if angles.ndim == 2:
        angles = angles[None]
    cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
    x32 = x.astype(jnp.float32)
    first, second = jnp.split(x32, 2, axis=-1)
    rotated = jnp.concatenate([-second, first], axis=-1)
    return (x32 * cos + rotated * sin).astype(x.dtype)


def soft_cap(logits: Array, cap: float | None) -> Array:
    """cap * tanh(logits / cap); the logits themselves when `cap` is None."""
    if cap is None:
        return logits
    return jnp.tanh(logits / cap) * cap


def grouped_attend(
    query: Array,
    key: Array,
    value: Array,
    bias: Array | None,
    *,
    scale: float,
    cap: float | None,
    dtype,
    dropout=None,
) -> Array:
    """Attention of `query` ([rows, q, heads, head_dim]) over head-major `key`/`value`
    ([kv rows, kv_heads, k, head_dim]); bias [rows or 1, 1, q, k]. Query rows may outnumber
    key rows (beam search's shared cross-attention cache). [rows, q, heads, head_dim] out."""
    rows, _, heads, head_dim = query.shape
    kv_heads = key.shape[1]
    group = heads // kv_heads
    query, bias = layers._share_key_value_rows(query, bias, key.shape[0])
    batch, length = query.shape[:2]
    # Each kv head's query heads as more query positions: [batch, group * q, kv_heads, head_dim],
    # so the matmuls take T5's forms (layers.attend's), which XLA:CPU runs in bfloat16.
    grouped = query.reshape((batch, length, kv_heads, group, head_dim))
    grouped = jnp.swapaxes(jnp.swapaxes(grouped, 1, 3), 2, 3)  # [batch, group, q, kv_heads, d]
    grouped = grouped.reshape((batch, group * length, kv_heads, head_dim))
    logits = precision.einsum("bqhd,bhkd->bhqk", grouped, key, dtype, jnp.float32)
    logits = soft_cap(logits * scale, cap)
    if bias is not None:  # [rows, 1, q or 1, k]: the same for every query head of a group
        split = logits.reshape((batch, kv_heads, group, length, -1)) + bias[:, :, None]
        logits = split.reshape(logits.shape)
    weights = jax.nn.softmax(logits, axis=-1).astype(dtype)
    if dropout is not None:
        weights = dropout(weights)
    out = precision.einsum("bhqk,bhkd->bhqd", weights, value, dtype)  # [b, kv, group * q, d]
    out = out.reshape((batch, kv_heads, group, length, head_dim))
    out = jnp.transpose(out, (0, 3, 1, 2, 4))  # [batch, q, kv_heads, group, head_dim]
    return out.reshape((rows, -1, heads, head_dim))


class GroupedQueryAttention(nn.Module):
    """Gemma 2's attention (see the module docstring). `positions` (query positions, key
    positions) rotate self-attention; None (cross-attention) leaves queries and keys as
    projected."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    query_pre_attn_scalar: float
    logit_cap: float | None = None
    rope_theta: float = 10000.0
    dropout_rate: float = 0.0
    dtype: jnp.dtype = jnp.float32
    lora: lora_adapters.LoraSettings | None = None

    def _adapter(self, name: str) -> lora_adapters.LoraSettings | None:
        target = lora_adapters.ATTENTION_TARGETS[name]
        return self.lora if self.lora and self.lora.adapts(target) else None

    def _project(self, name: str, x: Array) -> Array:
        heads, axis = (
            (self.num_heads, "heads") if name == "query" else (self.num_kv_heads, "kv_heads")
        )
        dense = layers.DenseGeneral(
            (heads, self.head_dim),
            ("embed", axis, "kv"),
            dtype=self.dtype,
            lora=self._adapter(name),
            name=name,
        )
        if name != "query":  # placed as their kernel is (kv heads where they divide 'model')
            return dense(x)
        return layers.constrain(dense(x), ("batch", "length", "heads", "kv"))

    def _key_value(self, inputs_kv: Array, key_positions: Array | None):
        """Head-major keys (rotated where positions are given) and values."""
        key = self._project("key", inputs_kv)
        if key_positions is not None:
            key = rotate(key, key_positions, self.rope_theta)
        value = self._project("value", inputs_kv)
        return jnp.swapaxes(key, 1, 2), jnp.swapaxes(value, 1, 2)

    @nn.compact
    def __call__(
        self,
        inputs_q: Array,
        inputs_kv: Array,
        bias: Array | None,
        positions: tuple[Array, Array] | None,
        deterministic: bool,
        decode: bool = False,
        decode_position: Array | None = None,
    ) -> Array:
        query = self._project("query", inputs_q)
        if positions is not None:
            query = rotate(query, positions[0], self.rope_theta)
        if decode:
            key, value = self._cached_key_value(inputs_kv, positions, decode_position)
        else:
            key, value = self._key_value(inputs_kv, None if positions is None else positions[1])
        dropout = None
        if not deterministic and self.dropout_rate > 0:
            drop = nn.Dropout(self.dropout_rate, broadcast_dims=(-2,))
            dropout = lambda weights: drop(weights, False)
        out = grouped_attend(
            query,
            key,
            value,
            bias,
            scale=self.query_pre_attn_scalar**-0.5,
            cap=self.logit_cap,
            dtype=self.dtype,
            dropout=dropout,
        )
        dense = layers.DenseGeneral(
            (inputs_q.shape[-1],),
            ("heads", "kv", "embed"),
            num_in_dims=2,
            dtype=self.dtype,
            lora=self._adapter("out"),
            name="out",
        )
        return dense(out)

    def _cached_key_value(self, inputs_kv, positions, decode_position):
        """Cached keys and values, [batch, kv_heads, length, head_dim] (module docstring)."""
        creating = not self.has_variable("cache", "cached_key")
        if positions is None:  # cross-attention: the encoder output, projected once
            made = self._key_value(inputs_kv, None) if creating else (None, None)
            k = self.variable("cache", "cached_key", lambda: made[0])
            v = self.variable("cache", "cached_value", lambda: made[1])
            return k.value, v.value
        batch, length = inputs_kv.shape[:2]
        shape = (batch, self.num_kv_heads, length, self.head_dim)
        k = self.variable("cache", "cached_key", jnp.zeros, shape, self.dtype)
        v = self.variable("cache", "cached_value", jnp.zeros, shape, self.dtype)
        if not creating:  # the new key at the query's own position(s)
            key, value = self._key_value(inputs_kv, positions[0])
            for cached, new in ((k, key), (v, value)):
                new = new.astype(cached.value.dtype)
                cached.value = layers.write_position(cached.value, new, decode_position)
        return k.value, v.value
