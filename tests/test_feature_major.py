"""The feature-major decoding step (model/feature_major.py): the network's logits and caches
from transposed weights, the engine's greedy ids unchanged, and where it applies."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import seqio
from hf_fixtures import VARIANTS, _batch, saved  # noqa: F401 (saved: the fixture)
from tiny import tiny_config

from t5tpu.model import decoding, decoding_settings, feature_major, lora, precision
from t5tpu.model.encoder_decoder import EncoderDecoderModel
from t5tpu.model.engine import Engine, Request
from t5tpu.model.network import Transformer
from t5tpu.partitioning import Partitioner

BF16 = jnp.bfloat16
# bfloat16's unit roundoff: a logit's error is measured in these, relative to the logits' range.
UNIT_ROUNDOFF = 2.0**-8
T5_1_0 = {"mlp_activations": ("relu",), "logits_via_embedding": True}
UMT5 = {"relative_bias_per_layer": True}  # a position-bias table in every layer


def _network(**overrides):
    """A tiny bf16 network, its bf16 parameters (embedding table as the engine holds it) and
    three inputs of different lengths."""
    config = tiny_config(dtype="bfloat16", **overrides)
    module = Transformer(config)
    tokens = np.random.default_rng(0).integers(2, config.vocab_size, (3, 16)).astype(np.int32)
    tokens[1, 9:], tokens[2, 4:] = 0, 0
    init = module.init(jax.random.PRNGKey(0), jnp.asarray(tokens), jnp.asarray(tokens[:, :8]))
    params = precision.cast_params(nn.unbox(init)["params"], BF16)
    return module, params, jnp.asarray(tokens)


@pytest.mark.parametrize("overrides", [{}, T5_1_0, UMT5], ids=["t5_1_1", "t5_1_0", "umt5"])
@pytest.mark.parametrize("rows", [1, 3])
def test_a_step_gives_the_networks_logits_and_cache(overrides, rows):
    """From one cache, each row at its own position: the same logits within two bfloat16
    rounding units of their range (the sums run in another order), the same new keys and
    values, every other cache entry untouched."""
    module, params, tokens = _network(**overrides)
    tokens = tokens[:rows]
    encoded, cache = decoding._encode_and_make_cache(module, params, tokens, 8)
    token = jnp.asarray([5, 7, 9][:rows], jnp.int32)
    position = jnp.asarray([0, 3, 6][:rows], jnp.int32)

    @jax.jit
    def both(params, cache):
        want = decoding._decoder_step(module, params, cache, encoded, tokens, token, position)
        w = feature_major.weights(module.config, params)
        got = feature_major.step(module.config, w, cache, tokens, token, position)
        return want, got

    (want, want_cache), (got, got_cache) = both(params, cache)
    assert got.shape == (module.config.vocab_size, rows)
    error = float(jnp.max(jnp.abs(got.T - want)) / jnp.max(jnp.abs(want)))
    assert error < 2 * UNIT_ROUNDOFF, error
    np.testing.assert_array_equal(decoding.first_max_index(got, 0), jnp.argmax(want, -1))
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(want_cache),
        jax.tree_util.tree_leaves(got_cache),
        strict=True,
    ):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_allclose(b, a, atol=4 * UNIT_ROUNDOFF, err_msg=str(path))


def _engine(config, params, batch_size: int) -> Engine:
    model = EncoderDecoderModel(config, seqio.PassThroughVocabulary(config.vocab_size, eos_id=1))
    partitioner = Partitioner()
    shardings = jax.tree_util.tree_map(lambda _: partitioner.replicated(), params)
    return Engine(
        model=model,
        params=jax.device_put(params, shardings),
        param_shardings=shardings,
        partitioner=partitioner,
        batch_size=batch_size,
        max_input_length=16,
        max_target_length=10,
    )


PENALIZED = decoding_settings.DecodingSettings(repetition_penalty=1.8, no_repeat_ngram_size=2)


@pytest.mark.parity
@pytest.mark.parametrize("variant", VARIANTS)
def test_the_engine_decodes_the_hf_fixtures_in_bf16_as_in_float32(saved, variant):  # noqa: F811
    """The imported models' greedy ids through the engine: bfloat16 (the feature-major step)
    equal float32 (the network's decode), in one batch and a row at a time; with penalties
    (which read the step's [vocab, rows] logits through a transpose) for T5 1.1."""
    _, _, config, params = saved[variant]
    inputs, _ = _batch()
    rows = [[int(i) for i in row if i] for row in inputs]
    request = Request(PENALIZED if variant == "1.1" else decoding_settings.DecodingSettings(), 10)
    bf16 = dataclasses.replace(config, dtype="bfloat16")
    for batch_size in (4, 1):
        reference = _engine(config, params, batch_size)
        engine = _engine(bf16, params, batch_size)
        assert reference.step_weights is None and engine.step_weights is not None
        want = reference.generate(rows, request)
        np.testing.assert_array_equal(engine.generate(rows, request), want)
    assert len({tuple(row) for row in want}) == 3  # the rows decode differently


@pytest.mark.parametrize("batch_size", [4, 1])
def test_sampling_draws_what_the_networks_decode_draws(batch_size):
    """Top-k sampling reads the step's [vocab, rows] logits through a transpose: the same
    draws as the network's decode from the same keys."""
    module, params, tokens = _network()
    rows = [[int(i) for i in row if i] for row in np.asarray(tokens)]
    request = Request(decoding_settings.DecodingSettings(temperature=1.0, top_k=8, seed=3), 10)
    engine = _engine(module.config, params, batch_size)
    assert engine.step_weights is not None
    got = engine.generate(rows, request)
    engine.step_weights = None  # the network's decode, same parameters
    np.testing.assert_array_equal(got, engine.generate(rows, request))
    assert len({tuple(row) for row in got}) == 3


def test_it_applies_to_bf16_cpu_programs_of_unrolled_layers_without_adapters():
    config = tiny_config(dtype="bfloat16")
    assert feature_major.applies(config, "cpu")
    assert not feature_major.applies(config, "tpu")
    assert not feature_major.applies(config, "cuda")
    assert not feature_major.applies(dataclasses.replace(config, dtype="float32"), "cpu")
    assert not feature_major.applies(dataclasses.replace(config, scan_layers=True), "cpu")
    adapted = dataclasses.replace(config, lora=lora.LoraSettings(rank=2))
    assert not feature_major.applies(adapted, "cpu")
