"""The T5 encoder-decoder: T5Config, Encoder, Decoder and Transformer.

Parameter tree as T5X names it (token_embedder/embedding, encoder/layers_N/attention/query/kernel,
decoder/logits_dense/kernel, ...), layers unrolled as layers_N so checkpoint converters map one to
one. With `scan_layers` each stack is one `nn.scan` over a single "layers" subtree whose leaves
have a leading layer axis (logical name "layers"): XLA compiles one layer instead of N, and
layer_stacking.py converts to and from layers_N where checkpoints are read and written.

Packed sequences are supported through segment ids; positions inside a segment are contiguous,
so the relative position bias can be computed from plain offsets once per stack.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp

from t5tpu.errors import UserError
from t5tpu.model import layers, precision
from t5tpu.model.lora import LoraSettings

Array = jax.Array
# What each layer saves for the backward pass ('none': everything, no recomputation).
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}


@gin.configurable
@dataclasses.dataclass(frozen=True)
class T5Config:
    """Geometry and numerics of a T5 model (defaults: T5 1.1 small)."""

    vocab_size: int = 32128
    emb_dim: int = 512
    num_heads: int = 6
    head_dim: int = 64
    mlp_dim: int = 1024
    num_encoder_layers: int = 8
    num_decoder_layers: int = 8
    # ('relu',) is T5 1.0's feed-forward; ('gelu', 'linear') is T5 1.1's gated-GELU.
    mlp_activations: tuple[str, ...] = ("gelu", "linear")
    # True: T5 1.0's output layer is the input embedding; False: T5 1.1's decoder/logits_dense.
    logits_via_embedding: bool = False
    dropout_rate: float = 0.0
    # Activations and matmul inputs; 'bfloat16' accumulates every matmul in float32
    # (model/precision.py). Parameters are float32 masters; inference casts them once.
    dtype: str = "float32"
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    # False: one relative position bias per stack, shared by its layers (T5, mT5); True: one in
    # every layer (umT5, and T5X's scalable_t5), as encoder/layers_N/relpos_bias/rel_embedding.
    relative_bias_per_layer: bool = False
    # Activation checkpointing of each layer: 'none', 'full' (save nothing) or 'dots' (save
    # matmul outputs without batch dims).
    remat_policy: str = "none"
    # True: each layer stack is one nn.scan over stacked parameters (and decoding caches), so
    # compile time no longer grows with depth; checkpoints keep the layers_N layout. Dropout
    # masks differ from the unrolled stack's; everything else is computed alike.
    scan_layers: bool = False
    # Low-rank adapters beside the kernels they target (model/lora.py); set by a LoRA training
    # run (train.method = @lora()), not by model files: None everywhere else.
    lora: LoraSettings | None = None

    def __post_init__(self):
        # A misspelled value would otherwise fail deep inside tracing with a traceback.
        def check(name, value, allowed):
            if value not in allowed:
                raise UserError(
                    f"T5Config.{name} = {value!r} is not one of {', '.join(map(repr, allowed))}"
                )

        check("remat_policy", self.remat_policy, tuple(REMAT_POLICIES))
        check("dtype", self.dtype, ("float32", "bfloat16"))
        if isinstance(self.mlp_activations, str):
            raise UserError(
                f"T5Config.mlp_activations = {self.mlp_activations!r} must be a tuple, e.g. "
                "('relu',) or ('gelu', 'linear')"
            )
        for activation in self.mlp_activations:
            check("mlp_activations entry", activation, tuple(layers.ACTIVATIONS))

    @property
    def activation_dtype(self):
        return jnp.dtype(self.dtype)


def _remat(layer_cls, policy: str, static_argnums: tuple[int, ...], scanned: bool = False):
    """Wraps a layer in activation checkpointing; static_argnums count `self` as 0."""
    if policy == "none":
        return layer_cls
    # Inside a scan the loop already keeps XLA from merging the recomputation with the forward
    # pass, so the optimization barriers of prevent_cse would only cost speed.
    return nn.remat(
        layer_cls,
        policy=REMAT_POLICIES[policy],
        static_argnums=static_argnums,
        prevent_cse=not scanned,
    )


def _layer_stack(layer_cls, config: T5Config, policy: str, static_argnums, num_layers: int):
    """Calls `num_layers` layers in sequence, each taking the running activations first and
    the same other arguments: unrolled as layers_0..layers_{n-1}, or one nn.scan named "layers"
    whose parameters and 'cache' variables are stacked along a leading "layers" axis."""
    scanned = config.scan_layers
    layer_cls = _remat(layer_cls, policy, static_argnums, scanned)
    if not scanned:

        def unrolled(x, *args):
            for i in range(num_layers):
                x = layer_cls(config, name=f"layers_{i}")(x, *args)
            return x

        return unrolled
    stack = nn.scan(
        layer_cls,
        variable_axes={"params": 0, "cache": 0},
        split_rngs={"params": True, "dropout": True},
        in_axes=nn.broadcast,
        length=num_layers,
        metadata_params={nn.PARTITION_NAME: "layers"},
    )(config, name="layers")

    def scanned_stack(x, *args):
        return stack(x, *args)[0]

    return scanned_stack


def _attention_mask(
    query_ok: Array,
    key_ok: Array,
    causal: bool = False,
    query_segments: Array | None = None,
    key_segments: Array | None = None,
):
    """Boolean [batch, 1, q, k] mask: both positions real, same segment, and causal if asked."""
    mask = query_ok[:, :, None] & key_ok[:, None, :]
    if causal:
        q, k = query_ok.shape[1], key_ok.shape[1]
        mask &= jnp.tril(jnp.ones((q, k), jnp.bool_))[None]
    if query_segments is not None:
        mask &= query_segments[:, :, None] == key_segments[:, None, :]
    return mask[:, None]


def _relpos(cfg: T5Config, bidirectional: bool) -> layers.RelativePositionBias:
    return layers.RelativePositionBias(
        cfg.num_heads,
        bidirectional,
        cfg.relative_attention_num_buckets,
        cfg.relative_attention_max_distance,
        cfg.activation_dtype,
        name="relpos_bias",
    )


def _stack_position_bias(cfg: T5Config, bidirectional: bool, positions: tuple[Array, Array]):
    """What a stack hands its layers for the position bias, given (query positions, key
    positions): the stack's own bias, computed once; with relative_bias_per_layer the positions
    themselves, at which each layer reads its own table (_layer_position_bias)."""
    if cfg.relative_bias_per_layer:
        return positions
    return _relpos(cfg, bidirectional)(*positions)


def _layer_position_bias(cfg: T5Config, bidirectional: bool, given) -> Array:
    """A layer's position bias from what its stack handed it (_stack_position_bias)."""
    if not cfg.relative_bias_per_layer:
        return given
    return _relpos(cfg, bidirectional)(*given)


def _layer_bias(position_bias: Array, mask_bias: Array) -> Array:
    """A layer's attention bias. The stack passes the position bias ([1, heads, q, k], trained)
    and the mask bias ([batch, 1, q, k]) apart and each layer adds them: a sum made once per
    stack would be a [batch, heads, q, k] float32 input of every layer whose gradient each layer
    keeps until the backward pass ends (TPU's compiler kept them all: docs/memory_plan.md);
    added here, the add fuses into the attention logits and each layer's gradient of the
    position bias is reduced over the batch at once."""
    return position_bias + mask_bias


def _layer_bias_forward(position_bias, mask_bias):
    return position_bias + mask_bias, (position_bias, mask_bias)


def _layer_bias_backward(inputs, grad):
    """The position bias's gradient: the layer's summed over the batch by precision.sum_rows
    (XLA:CPU's own reduction of it was slow). The mask bias is made from token ids: no
    gradient."""
    position_bias, mask_bias = inputs
    if position_bias.shape[0] == 1:
        grad = precision.sum_rows(grad)
    return grad, jnp.zeros_like(mask_bias)


_layer_bias = jax.custom_vjp(_layer_bias)
_layer_bias.defvjp(_layer_bias_forward, _layer_bias_backward)


def _mlp(cfg: T5Config) -> layers.MlpBlock:
    dtype = cfg.activation_dtype
    return layers.MlpBlock(
        cfg.mlp_dim, cfg.mlp_activations, cfg.dropout_rate, dtype, cfg.lora, name="mlp"
    )


class EncoderLayer(nn.Module):
    config: T5Config

    @nn.compact
    def __call__(self, x, attention_bias, deterministic):
        cfg = self.config
        dtype = cfg.activation_dtype
        dropout = nn.Dropout(cfg.dropout_rate, broadcast_dims=(-2,))
        position_bias, mask_bias = attention_bias
        position_bias = _layer_position_bias(cfg, True, position_bias)
        h = layers.RMSNorm(dtype=dtype, name="pre_attention_layer_norm")(x)
        h = layers.MultiHeadAttention(
            cfg.num_heads, cfg.head_dim, cfg.dropout_rate, dtype, cfg.lora, name="attention"
        )(h, h, _layer_bias(position_bias, mask_bias), deterministic)
        x = x + dropout(h, deterministic)
        h = layers.RMSNorm(dtype=dtype, name="pre_mlp_layer_norm")(x)
        h = _mlp(cfg)(h, deterministic)
        x = x + dropout(h, deterministic)
        x = layers.constrain(x, ("batch", "length", "embed"))
        return (x, None) if cfg.scan_layers else x  # nn.scan's body returns (carry, output)


class DecoderLayer(nn.Module):
    config: T5Config

    @nn.compact
    def __call__(
        self, y, encoded, self_bias, cross_bias, deterministic, decode=False, decode_position=None
    ):
        cfg = self.config
        dtype = cfg.activation_dtype
        dropout = nn.Dropout(cfg.dropout_rate, broadcast_dims=(-2,))

        def attention(name):
            return layers.MultiHeadAttention(
                cfg.num_heads, cfg.head_dim, cfg.dropout_rate, dtype, cfg.lora, name=name
            )

        position_bias, mask_bias = self_bias
        position_bias = _layer_position_bias(cfg, False, position_bias)
        h = layers.RMSNorm(dtype=dtype, name="pre_self_attention_layer_norm")(y)
        h = attention("self_attention")(
            h, h, _layer_bias(position_bias, mask_bias), deterministic, decode, decode_position
        )
        y = y + dropout(h, deterministic)
        h = layers.RMSNorm(dtype=dtype, name="pre_cross_attention_layer_norm")(y)
        h = attention("encoder_decoder_attention")(
            h, encoded, cross_bias, deterministic, decode, cross=True
        )
        y = y + dropout(h, deterministic)
        h = layers.RMSNorm(dtype=dtype, name="pre_mlp_layer_norm")(y)
        h = _mlp(cfg)(h, deterministic)
        y = y + dropout(h, deterministic)
        y = layers.constrain(y, ("batch", "length", "embed"))
        return (y, None) if cfg.scan_layers else y  # nn.scan's body returns (carry, output)


class Encoder(nn.Module):
    config: T5Config
    shared_embedding: nn.Module

    @nn.compact
    def __call__(self, tokens, segment_ids=None, deterministic=True):
        cfg = self.config
        ok = tokens > 0
        mask = _attention_mask(ok, ok, query_segments=segment_ids, key_segments=segment_ids)
        length = tokens.shape[1]
        positions = jnp.arange(length)
        position_bias = _stack_position_bias(cfg, True, (positions, positions))
        bias = (position_bias, layers.bias_from_mask(mask))
        dropout = nn.Dropout(cfg.dropout_rate, broadcast_dims=(-2,))
        x = dropout(self.shared_embedding(tokens), deterministic)
        x = layers.constrain(x, ("batch", "length", "embed"))
        stack = _layer_stack(EncoderLayer, cfg, cfg.remat_policy, (3,), cfg.num_encoder_layers)
        x = stack(x, bias, deterministic)
        x = layers.RMSNorm(dtype=cfg.activation_dtype, name="encoder_norm")(x)
        return dropout(x, deterministic)


class Decoder(nn.Module):
    config: T5Config
    shared_embedding: nn.Module

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
        """Training/scoring: full target sequence. Decoding (decode=True): one token per call at
        `decode_position`; the first call with decode=True only creates the cache."""
        cfg = self.config
        length = decoder_input_tokens.shape[1]
        if decode and self.has_variable("cache", "max_length"):
            max_length = self.get_variable("cache", "max_length").shape[0]
            positions, self_mask = _one_step_self_attention(decode_position, max_length)
            decoder_ok = jnp.ones_like(decoder_input_tokens, jnp.bool_)
        else:
            if decode:  # cache creation: remember the length the cache was made for
                self.variable("cache", "max_length", jnp.zeros, (length,), jnp.int8)
            # Position 0 holds the start token (id 0), so "real" is judged by segment ids when
            # packed, and every position counts otherwise (the loss weights drop the padding).
            decoder_ok = (
                (decoder_segment_ids > 0)
                if decoder_segment_ids is not None
                else (jnp.ones_like(decoder_input_tokens, jnp.bool_))
            )
            positions, self_mask = _causal_self_attention(decoder_ok, decoder_segment_ids)
        self_bias = (_stack_position_bias(cfg, False, positions), self_mask)
        cross_mask = _attention_mask(
            decoder_ok,
            encoder_ok,
            query_segments=decoder_segment_ids,
            key_segments=encoder_segment_ids,
        )
        cross_bias = layers.bias_from_mask(cross_mask)

        dropout = nn.Dropout(cfg.dropout_rate, broadcast_dims=(-2,))
        y = dropout(self.shared_embedding(decoder_input_tokens), deterministic)
        y = layers.constrain(y, ("batch", "length", "embed"))
        # Decoding stores no activations for a backward pass, so it never needs remat.
        policy = "none" if decode else cfg.remat_policy
        stack = _layer_stack(DecoderLayer, cfg, policy, (5, 6), cfg.num_decoder_layers)
        y = stack(y, encoded, self_bias, cross_bias, deterministic, decode, decode_position)
        y = layers.RMSNorm(dtype=cfg.activation_dtype, name="decoder_norm")(y)
        y = dropout(y, deterministic)
        logits = _output_logits(cfg, self.shared_embedding, y)
        logits = layers.constrain(logits, ("batch", "length", "vocab"))
        return logits.astype(jnp.float32)


def _one_step_self_attention(decode_position, max_length: int):
    """Decoding one token: ((query positions, key positions), mask bias), the query at
    `decode_position` seeing every cached position up to it. A [batch] of positions gives each
    row its own (rows that joined the batch at other steps): query positions [batch, 1]."""
    key_positions = jnp.arange(max_length)
    if jnp.ndim(decode_position) == 0:
        visible = (key_positions <= decode_position)[None, None, None, :]
        return (decode_position[None], key_positions), layers.bias_from_mask(visible)
    visible = (key_positions[None, :] <= decode_position[:, None])[:, None, None, :]
    return (decode_position[:, None], key_positions), layers.bias_from_mask(visible)


def _causal_self_attention(decoder_ok, segment_ids):
    """The whole target at once: ((query positions, key positions), mask bias), each position
    seeing itself and the ones before, in its segment."""
    positions = jnp.arange(decoder_ok.shape[1])
    mask = _attention_mask(
        decoder_ok, decoder_ok, causal=True, query_segments=segment_ids, key_segments=segment_ids
    )
    return (positions, positions), layers.bias_from_mask(mask)


def _output_logits(cfg: T5Config, shared_embedding: nn.Module, y):
    """The output layer, made inside the calling Decoder (so its parameters are the Decoder's)."""
    if cfg.logits_via_embedding:
        # T5 1.0 ties the output layer to the embedding and rescales by 1/sqrt(d_model).
        return shared_embedding.attend(y) / jnp.sqrt(y.shape[-1]).astype(jnp.float32)
    return layers.DenseGeneral(
        (cfg.vocab_size,),
        ("embed", "vocab"),
        dtype=cfg.activation_dtype,
        output_dtype=jnp.float32,
        name="logits_dense",
    )(y)


class EncoderDecoderStacks(nn.Module):
    """What every network here offers EncoderDecoderModel, the engine and LoRA: `encode`,
    `decode` (the whole target, or one token per call with decode=True) and `__call__`
    (training logits), over the `encoder` and `decoder` a subclass sets up (T5's Transformer,
    T5Gemma's T5GemmaTransformer)."""

    def encode(self, encoder_input_tokens, encoder_segment_ids=None, deterministic=True):
        return self.encoder(encoder_input_tokens, encoder_segment_ids, deterministic)

    def decode(
        self,
        encoded,
        encoder_input_tokens,
        decoder_input_tokens,
        encoder_segment_ids=None,
        decoder_segment_ids=None,
        deterministic=True,
        decode=False,
        decode_position=None,
    ):
        return self.decoder(
            encoded,
            encoder_input_tokens > 0,
            decoder_input_tokens,
            encoder_segment_ids,
            decoder_segment_ids,
            deterministic,
            decode,
            decode_position,
        )

    def __call__(
        self,
        encoder_input_tokens,
        decoder_input_tokens,
        encoder_segment_ids=None,
        decoder_segment_ids=None,
        deterministic=True,
    ):
        encoded = self.encode(encoder_input_tokens, encoder_segment_ids, deterministic)
        return self.decode(
            encoded,
            encoder_input_tokens,
            decoder_input_tokens,
            encoder_segment_ids,
            decoder_segment_ids,
            deterministic,
        )


class Transformer(EncoderDecoderStacks):
    """T5 encoder-decoder. `__call__` gives training logits; `encode`/`decode` serve decoding."""

    config: T5Config

    def setup(self):
        cfg = self.config
        self.token_embedder = layers.Embed(cfg.vocab_size, cfg.emb_dim, cfg.activation_dtype)
        self.encoder = Encoder(cfg, self.token_embedder)
        self.decoder = Decoder(cfg, self.token_embedder)
