"""T5Gemma (Gemma 2 adapted to an encoder-decoder): T5GemmaConfig and its network.

What it shares with T5 (network.py): the Transformer's interface (`encode`, `decode` with the
one-step decode and its 'cache' collection, `__call__`), which EncoderDecoderModel, the decoding
engine, LoRA and precision handling call alike; layers.py's dense layers, gated feed-forward
(wi_0 gelu-tanh, wi_1 linear, wo) and embedding; REMAT_POLICIES. Its own: the attention
(gemma_attention.py), a norm before and after each block, an embedding per stack scaled by
sqrt(emb_dim), local (sliding-window) and global layers, and soft-capped output logits from
the decoder's embedding (tied). The encoder and decoder may differ in geometry (9B-2B): each is
a T5GemmaStack; cross-attention projects the encoder's width.

Parameter tree, T5X-style: {encoder,decoder}/token_embedder/embedding,
encoder/layers_N/{pre,post}_attention_layer_norm, encoder/layers_N/attention/{query,key,value,
out}/kernel, encoder/layers_N/{pre,post}_mlp_layer_norm, encoder/layers_N/mlp/wi_0/kernel,
encoder/encoder_norm; decoder/layers_N/{self_attention,encoder_decoder_attention} with their
pre_/post_ norms, decoder/decoder_norm. A norm's `scale` is Gemma's: an offset from 1 (zeros at
initialization), so checkpoints map one to one.

The decoder's start token is T5's id 0 (what the feature converters and the engine feed) read
as `decoder_start_id` (Gemma's BOS, 2) where it starts a target; other 0s stay pad ids.
"""

from __future__ import annotations

import dataclasses
import math

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp

from t5tpu.errors import UserError
from t5tpu.model import gemma_attention, layers
from t5tpu.model.lora import LoraSettings
from t5tpu.model.network import REMAT_POLICIES, EncoderDecoderStacks

Array = jax.Array
LOCAL, GLOBAL = "local", "global"


@gin.configurable
@dataclasses.dataclass(frozen=True)
class T5GemmaStack:
    """The geometry of one stack (defaults: Gemma 2 2B's)."""

    emb_dim: int = 2304
    num_heads: int = 8
    num_kv_heads: int = 4
    head_dim: int = 256
    mlp_dim: int = 9216
    num_layers: int = 26
    query_pre_attn_scalar: float = 256.0
    # Local layers see keys fewer than this many positions away.
    sliding_window: int = 4096
    # None: local and global alternate, layer 0 local (Gemma 2); else each layer's.
    layer_types: tuple[str, ...] | None = None
    attn_logit_softcapping: float | None = 50.0
    rope_theta: float = 10000.0

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise UserError(
                f"T5GemmaStack.num_heads = {self.num_heads} is not a multiple of "
                f"num_kv_heads = {self.num_kv_heads}"
            )
        if self.layer_types is not None:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
            if len(self.layer_types) != self.num_layers or not set(self.layer_types) <= {
                LOCAL,
                GLOBAL,
            }:
                raise UserError(
                    f"T5GemmaStack.layer_types = {self.layer_types!r}: give one of 'local', "
                    f"'global' for each of the {self.num_layers} layers"
                )

    def layer_type(self, index: int) -> str:
        if self.layer_types is not None:
            return self.layer_types[index]
        return LOCAL if index % 2 == 0 else GLOBAL


@gin.configurable
@dataclasses.dataclass(frozen=True)
class T5GemmaConfig:
    """A T5Gemma model: vocabulary, the two stacks (decoder None: the encoder's geometry) and
    the numerics every T5Config has (dtype, dropout, remat, LoRA)."""

    vocab_size: int = 256000
    encoder: T5GemmaStack = T5GemmaStack()
    decoder: T5GemmaStack | None = None
    final_logit_softcapping: float | None = 30.0
    decoder_start_id: int = 2
    dropout_rate: float = 0.0
    dtype: str = "float32"
    remat_policy: str = "none"
    # Layers alternate local and global attention, so they are always unrolled (layers_N).
    scan_layers: bool = False
    lora: LoraSettings | None = None

    def __post_init__(self):
        if self.decoder is None:
            object.__setattr__(self, "decoder", self.encoder)
        if self.remat_policy not in REMAT_POLICIES:
            raise UserError(f"T5GemmaConfig.remat_policy = {self.remat_policy!r} is unknown")
        if self.dtype not in ("float32", "bfloat16"):
            raise UserError(f"T5GemmaConfig.dtype = {self.dtype!r}: 'float32' or 'bfloat16'")
        if self.scan_layers:
            raise UserError("T5GemmaConfig.scan_layers: T5Gemma's layers are always unrolled")

    @property
    def activation_dtype(self):
        return jnp.dtype(self.dtype)

    @property
    def emb_dim(self) -> int:
        """The encoder output's width (what cross-attention caches are made from)."""
        return self.encoder.emb_dim

    @property
    def num_encoder_layers(self) -> int:
        return self.encoder.num_layers

    @property
    def num_decoder_layers(self) -> int:
        return self.decoder.num_layers


class GemmaNorm(nn.Module):
    """Gemma's RMSNorm: x / rms(x) * (1 + scale), float32 inside; `scale` starts at zero."""

    epsilon: float = 1e-6
    dtype: jnp.dtype = jnp.float32

    @nn.compact
    def __call__(self, x: Array) -> Array:
        shape = (x.shape[-1],)
        scale = layers.param_with_axes(self, "scale", nn.initializers.zeros, shape, ("embed",))
        return layers.rms_normalized(x, 1.0 + scale, self.dtype, epsilon=self.epsilon)


def _attention(cfg: T5GemmaConfig, stack: T5GemmaStack, name: str):
    return gemma_attention.GroupedQueryAttention(
        stack.num_heads,
        stack.num_kv_heads,
        stack.head_dim,
        stack.query_pre_attn_scalar,
        stack.attn_logit_softcapping,
        stack.rope_theta,
        cfg.dropout_rate,
        cfg.activation_dtype,
        cfg.lora,
        name=name,
    )


def _mlp(cfg: T5GemmaConfig, stack: T5GemmaStack) -> layers.MlpBlock:
    return layers.MlpBlock(
        stack.mlp_dim,
        ("gelu", "linear"),
        cfg.dropout_rate,
        cfg.activation_dtype,
        cfg.lora,
        name="mlp",
    )


def _sandwiched(module, block, x, name: str, *args, deterministic: bool):
    """x + dropout(post_norm(block(pre_norm(x), *args))): Gemma 2's residual block."""
    cfg = module.config
    dtype = cfg.activation_dtype
    h = GemmaNorm(dtype=dtype, name=f"pre_{name}_layer_norm")(x)
    h = block(h, *args)
    h = GemmaNorm(dtype=dtype, name=f"post_{name}_layer_norm")(h)
    return x + nn.Dropout(cfg.dropout_rate, broadcast_dims=(-2,))(h, deterministic)


class EncoderLayer(nn.Module):
    config: T5GemmaConfig
    index: int

    @nn.compact
    def __call__(self, x, biases, positions, deterministic):
        cfg, stack = self.config, self.config.encoder
        bias = biases[stack.layer_type(self.index)]
        attention = _attention(cfg, stack, "attention")

        def attend(h):
            return attention(h, h, bias, positions, deterministic)

        x = _sandwiched(self, attend, x, "attention", deterministic=deterministic)
        mlp = _mlp(cfg, stack)
        x = _sandwiched(self, mlp, x, "mlp", deterministic, deterministic=deterministic)
        return layers.constrain(x, ("batch", "length", "embed"))


class DecoderLayer(nn.Module):
    config: T5GemmaConfig
    index: int

    @nn.compact
    def __call__(
        self, y, encoded, biases, cross_bias, positions, deterministic, decode, decode_position
    ):
        cfg, stack = self.config, self.config.decoder
        bias = biases[stack.layer_type(self.index)]
        self_attention = _attention(cfg, stack, "self_attention")
        cross_attention = _attention(cfg, stack, "encoder_decoder_attention")

        def attend_self(h):
            return self_attention(h, h, bias, positions, deterministic, decode, decode_position)

        def attend_encoder(h):
            return cross_attention(h, encoded, cross_bias, None, deterministic, decode)

        run = dict(deterministic=deterministic)
        y = _sandwiched(self, attend_self, y, "self_attention", **run)
        y = _sandwiched(self, attend_encoder, y, "cross_attention", **run)
        y = _sandwiched(self, _mlp(cfg, stack), y, "mlp", deterministic, **run)
        return layers.constrain(y, ("batch", "length", "embed"))


def _layer_class(layer_cls, cfg: T5GemmaConfig, static_argnums, decode: bool):
    if decode or cfg.remat_policy == "none":
        return layer_cls
    return nn.remat(
        layer_cls, policy=REMAT_POLICIES[cfg.remat_policy], static_argnums=static_argnums
    )


def _window_biases(ok: Array, query_positions, key_positions, window: int, causal: bool):
    """{'global': bias, 'local': bias}, float32 [rows, 1, q, k], from `ok` ([rows or 1, q, k]:
    real, same-segment pairs): causal where asked, local ones also within `window`."""
    offset = query_positions[..., :, None] - key_positions[..., None, :]
    if offset.ndim == 2:
        offset = offset[None]
    if causal:
        ok = ok & (offset >= 0)
        near = offset < window
    else:
        near = jnp.abs(offset) < window
    return {
        GLOBAL: layers.bias_from_mask(ok[:, None]),
        LOCAL: layers.bias_from_mask((ok & near)[:, None]),
    }


def _pairs(query_ok, key_ok, query_segments=None, key_segments=None):
    ok = query_ok[:, :, None] & key_ok[:, None, :]
    if query_segments is not None:
        ok &= query_segments[:, :, None] == key_segments[:, None, :]
    return ok


def _embedded(cfg: T5GemmaConfig, embedder, tokens, emb_dim: int):
    dtype = cfg.activation_dtype
    return embedder(tokens) * jnp.asarray(math.sqrt(emb_dim), dtype)


class Encoder(nn.Module):
    config: T5GemmaConfig

    @nn.compact
    def __call__(self, tokens, segment_ids=None, deterministic=True):
        cfg, stack = self.config, self.config.encoder
        dtype = cfg.activation_dtype
        ok = tokens > 0
        positions = jnp.arange(tokens.shape[1])
        pairs = _pairs(ok, ok, segment_ids, segment_ids)
        biases = _window_biases(pairs, positions, positions, stack.sliding_window, False)
        embedder = layers.Embed(cfg.vocab_size, stack.emb_dim, dtype, name="token_embedder")
        dropout = nn.Dropout(cfg.dropout_rate, broadcast_dims=(-2,))
        x = dropout(_embedded(cfg, embedder, tokens, stack.emb_dim), deterministic)
        x = layers.constrain(x, ("batch", "length", "embed"))
        layer_cls = _layer_class(EncoderLayer, cfg, (4,), decode=False)
        rotary = (positions, positions)
        for i in range(stack.num_layers):
            x = layer_cls(cfg, i, name=f"layers_{i}")(x, biases, rotary, deterministic)
        x = GemmaNorm(dtype=dtype, name="encoder_norm")(x)
        return dropout(x, deterministic)


class Decoder(nn.Module):
    config: T5GemmaConfig

    @nn.compact
    def __call__(
        self,
        encoded,
        encoder_ok,
        decoder_input_tokens,
        encoder_segment_ids=None,
        decoder_segment_ids=None,
        deterministic=True,
        decode=False,
        decode_position=None,
    ):
        """As network.Decoder: the whole target, or (decode=True) one token per call at
        `decode_position`, the first such call only creating the cache."""
        cfg, stack = self.config, self.config.decoder
        dtype = cfg.activation_dtype
        length = decoder_input_tokens.shape[1]
        if decode and self.has_variable("cache", "max_length"):
            max_length = self.get_variable("cache", "max_length").shape[0]
            positions = _step_positions(decode_position)
            key_positions = jnp.arange(max_length)
            decoder_ok = jnp.ones_like(decoder_input_tokens, jnp.bool_)
            pairs = jnp.ones((1, 1, max_length), jnp.bool_)
        else:
            if decode:  # cache creation: remember the length the cache was made for
                self.variable("cache", "max_length", jnp.zeros, (length,), jnp.int8)
            positions = key_positions = jnp.arange(length)
            decoder_ok = (
                decoder_segment_ids > 0
                if decoder_segment_ids is not None
                else jnp.ones_like(decoder_input_tokens, jnp.bool_)
            )
            pairs = _pairs(decoder_ok, decoder_ok, decoder_segment_ids, decoder_segment_ids)
        biases = _window_biases(pairs, positions, key_positions, stack.sliding_window, True)
        cross = _pairs(decoder_ok, encoder_ok, decoder_segment_ids, encoder_segment_ids)
        cross_bias = layers.bias_from_mask(cross[:, None])

        embedder = layers.Embed(cfg.vocab_size, stack.emb_dim, dtype, name="token_embedder")
        tokens = _started(cfg, decoder_input_tokens, decoder_segment_ids, decode, decode_position)
        dropout = nn.Dropout(cfg.dropout_rate, broadcast_dims=(-2,))
        y = dropout(_embedded(cfg, embedder, tokens, stack.emb_dim), deterministic)
        y = layers.constrain(y, ("batch", "length", "embed"))
        layer_cls = _layer_class(DecoderLayer, cfg, (6, 7), decode)
        step = (decode, decode_position)
        for i in range(stack.num_layers):
            layer = layer_cls(cfg, i, name=f"layers_{i}")
            y = layer(y, encoded, biases, cross_bias, (positions, positions), deterministic, *step)
        y = GemmaNorm(dtype=dtype, name="decoder_norm")(y)
        y = dropout(y, deterministic)
        logits = gemma_attention.soft_cap(embedder.attend(y), cfg.final_logit_softcapping)
        return layers.constrain(logits, ("batch", "length", "vocab")).astype(jnp.float32)


def _started(cfg: T5GemmaConfig, tokens, segment_ids, decode: bool, decode_position):
    """`tokens` with the id 0 that starts each target (position 0, each packed segment's
    first) read as cfg.decoder_start_id; a 0 elsewhere (a decoded pad id) stays 0."""
    if decode and decode_position is not None:
        start = jnp.reshape(decode_position == 0, (-1, 1))
    else:
        start = (jnp.arange(tokens.shape[1]) == 0)[None]
        if segment_ids is not None:
            before = jnp.pad(segment_ids[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
            start = start | (segment_ids != before)
    return jnp.where(start & (tokens == 0), cfg.decoder_start_id, tokens)


def _step_positions(decode_position) -> Array:
    """The query positions of a one-token step: [1], or [batch, 1] for rows of their own."""
    if jnp.ndim(decode_position) == 0:
        return jnp.reshape(decode_position, (1,))
    return decode_position[:, None]


class T5GemmaTransformer(EncoderDecoderStacks):
    """The T5Gemma encoder-decoder (its methods: network.EncoderDecoderStacks)."""

    config: T5GemmaConfig

    def setup(self):
        self.encoder = Encoder(self.config)
        self.decoder = Decoder(self.config)
