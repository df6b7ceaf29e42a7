"""The whole-batch greedy/sampling decoder the engine replaced, kept as a reference only: the
tests decode with it and check that the engine's continuous batches (t5tpu/model/engine.py)
give every row the same ids. Nothing in t5tpu calls it."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from t5tpu.model.decoding import (
    Picking,
    Prefix,
    _decoder_step,
    _encode_and_make_cache,
    _pick_next,
    _split,
    row_settings,
)
from t5tpu.model.decoding_settings import DecodingSettings

Array = jax.Array


def decode(
    module: nn.Module,
    params,
    encoder_input_tokens: Array,
    max_decode_length: int,
    eos_id: int,
    rng: Array | None = None,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
) -> Array:
    """Returns [batch, max_decode_length] token ids: each row ends at its first EOS (included),
    zeros after it. Decoding stops early once every row has produced EOS. Sampling draws from
    `rng`: a key per row ([batch, 2]), or one key split into a key per row."""
    batch = encoder_input_tokens.shape[0]
    settings = DecodingSettings(temperature=temperature, top_k=top_k, top_p=top_p)
    values = jax.tree_util.tree_map(jnp.asarray, row_settings(settings, batch, max_decode_length))
    picking = Picking(eos_id)
    encoded, cache = _encode_and_make_cache(module, params, encoder_input_tokens, max_decode_length)
    dummy_targets = jnp.zeros((batch, max_decode_length), jnp.int32)
    rng = jax.random.PRNGKey(0) if rng is None else rng
    rng = jax.random.split(rng, batch) if rng.ndim == 1 else rng

    def step(state):
        position, cache, token, out, done, rng = state
        logits, cache = _decoder_step(
            module, params, cache, encoded, encoder_input_tokens, token, position
        )
        rng, step_rng = _split(rng)
        prefix = Prefix(out, jnp.full((batch,), position), ~done)
        next_token = _pick_next(logits, step_rng, picking, values, prefix)
        next_token = jnp.where(done, 0, next_token)
        out = out.at[:, position].set(next_token)
        done = done | (next_token == eos_id)
        return position + 1, cache, next_token, out, done, rng

    def not_finished(state):
        position, *_, done, _ = state
        return (position < max_decode_length) & ~jnp.all(done)

    start = (
        jnp.int32(0),
        cache,
        jnp.zeros((batch,), jnp.int32),
        dummy_targets,
        jnp.zeros((batch,), jnp.bool_),
        rng,
    )
    return jax.lax.while_loop(not_finished, step, start)[3]


def predict(model, params, tokens, max_length: int, rng=None, settings=None):
    """`decode` (or beam search) of a batch with a model's settings, as
    EncoderDecoderModel.predict once did."""
    from t5tpu.model import decoding, decoding_settings

    settings = settings or decoding_settings.DecodingSettings()
    eos = model.vocabulary.eos_id
    if settings.num_beams > 1:
        return decoding.beam_search(
            model.module, params, tokens, max_length, eos, settings.num_beams, settings.beam_alpha
        )[0]
    return decode(
        model.module,
        params,
        tokens,
        max_length,
        eos,
        rng,
        settings.temperature,
        settings.top_k,
        settings.top_p,
    )
