"""Decoding with the KV cache must pick exactly the tokens a full re-run of the decoder picks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference_decoding
from tiny import tiny_config

from t5tpu.model.network import Transformer

EOS = 1


def _random_model(variant: str):
    cfg = tiny_config(
        vocab_size=96,
        emb_dim=32,
        num_heads=2,
        head_dim=16,
        mlp_dim=64,
        mlp_activations=("relu",) if variant == "1.0" else ("gelu", "linear"),
        logits_via_embedding=variant == "1.0",
    )
    module = Transformer(cfg)
    params = module.init(
        jax.random.PRNGKey(0), jnp.ones((1, 8), jnp.int32), jnp.ones((1, 8), jnp.int32)
    )["params"]
    # Scale up the output layer so greedy paths are varied rather than one repeated token.
    params = jax.tree_util.tree_map(lambda x: x * 1.5, params)
    return module, params


def _greedy_without_cache(module, params, inputs, length):
    """Reference: re-run the whole decoder on the growing prefix for every new token."""
    batch = inputs.shape[0]
    out = np.zeros((batch, length), np.int32)
    done = np.zeros(batch, bool)
    for i in range(length):
        decoder_inputs = np.zeros((batch, length), np.int32)
        decoder_inputs[:, 1 : i + 1] = out[:, :i]
        logits = module.apply({"params": params}, inputs, jnp.asarray(decoder_inputs))
        token = np.where(done, 0, np.asarray(jnp.argmax(logits[:, i], -1)))
        out[:, i] = token
        done |= token == EOS
        if done.all():
            break
    return out


@pytest.mark.parametrize("variant", ["1.0", "1.1"])
def test_cached_greedy_equals_full_recompute(variant):
    module, params = _random_model(variant)
    rng = np.random.default_rng(0)
    inputs = rng.integers(2, 96, size=(4, 12)).astype(np.int32)
    inputs[1, 7:] = 0  # one padded row
    inputs[3, 4:] = 0
    fast = jax.jit(
        lambda p, x: reference_decoding.decode(module, p, x, max_decode_length=10, eos_id=EOS)
    )(params, jnp.asarray(inputs))
    reference = _greedy_without_cache(module, params, jnp.asarray(inputs), 10)
    np.testing.assert_array_equal(np.asarray(fast), reference)
    assert len(np.unique(reference)) > 3  # the check is meaningful: varied tokens were decoded


def test_eos_stops_each_row_and_zeros_follow():
    module, params = _random_model("1.1")
    inputs = jnp.asarray(np.random.default_rng(1).integers(2, 96, size=(6, 6)), jnp.int32)
    unbounded = np.asarray(reference_decoding.decode(module, params, inputs, 8, eos_id=-1))
    eos = int(unbounded[0, 2])  # a token that really occurs, so row 0 must stop at or before 2
    out = np.asarray(reference_decoding.decode(module, params, inputs, 8, eos_id=eos))
    for row, full in zip(out, unbounded, strict=True):
        hits = np.flatnonzero(full == eos)
        stop = hits[0] + 1 if len(hits) else len(full)
        np.testing.assert_array_equal(row[:stop], full[:stop])
        assert (row[stop:] == 0).all()
    assert (out[0, 3:] == 0).all()


def test_sampling_depends_on_rng_and_top1_is_greedy():
    module, params = _random_model("1.1")
    inputs = jnp.asarray(np.random.default_rng(2).integers(2, 96, size=(4, 10)), jnp.int32)
    greedy = reference_decoding.decode(module, params, inputs, 8, EOS)
    top1 = reference_decoding.decode(
        module, params, inputs, 8, EOS, jax.random.PRNGKey(5), temperature=1.0, top_k=1
    )
    np.testing.assert_array_equal(np.asarray(greedy), np.asarray(top1))
    a = reference_decoding.decode(
        module, params, inputs, 8, EOS, jax.random.PRNGKey(1), temperature=2.0
    )
    b = reference_decoding.decode(
        module, params, inputs, 8, EOS, jax.random.PRNGKey(2), temperature=2.0
    )
    assert not np.array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parity
def test_sampling_filters_each_row_as_hugging_faces_warpers_do():
    """temperature, then top-k, then top-p, each row with its own values (one program), equal
    to transformers' TemperatureLogitsWarper, TopKLogitsWarper and TopPLogitsWarper on the
    same logits: the same tokens kept, the same values."""
    import torch
    from transformers import generation

    from t5tpu.model import decoding

    rows = [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.9), (0.5, 40, 0.6), (2.0, 3, 0.05)]
    logits = np.random.default_rng(0).normal(0, 3, size=(len(rows), 257)).astype(np.float32)
    sampling = decoding.RowSettings(
        temperature=jnp.asarray([t for t, _, _ in rows], jnp.float32),
        top_k=jnp.asarray([k for _, k, _ in rows], jnp.int32),
        top_p=jnp.asarray([p for _, _, p in rows], jnp.float32),
        repetition_penalty=jnp.ones((len(rows),), jnp.float32),
        no_repeat_ngram_size=jnp.zeros((len(rows),), jnp.int32),
        min_new_tokens=jnp.zeros((len(rows),), jnp.int32),
        max_new_tokens=jnp.full((len(rows),), 8, jnp.int32),
    )
    ours = np.asarray(jax.jit(decoding.sampled_logits)(jnp.asarray(logits), sampling))
    for row, (temperature, top_k, top_p) in enumerate(rows):
        warpers = generation.LogitsProcessorList([generation.TemperatureLogitsWarper(temperature)])
        if top_k:
            warpers.append(generation.TopKLogitsWarper(top_k))
        if top_p < 1:
            warpers.append(generation.TopPLogitsWarper(top_p))
        theirs = warpers(None, torch.tensor(logits[row : row + 1])).numpy()[0]
        kept = np.isfinite(theirs)
        np.testing.assert_array_equal(np.isfinite(ours[row]), kept, err_msg=str(rows[row]))
        np.testing.assert_allclose(ours[row][kept], theirs[kept], rtol=1e-6)
    # The limits do something: rows keep k tokens, or fewer under top-p.
    assert [int(np.isfinite(r).sum()) for r in ours][:2] == [257, 5]
    assert 1 <= np.isfinite(ours[4]).sum() <= 3


@pytest.mark.parity
def test_penalties_then_sampling_filter_each_row_as_hugging_faces_processors_do():
    """Repetition penalty, no-repeat n-grams and min_new_tokens, then temperature, top-k and
    top-p, each row with its own values and tokens so far: the same logits kept, the same
    values, as transformers' logits processors in generate's order on the same inputs."""
    import torch
    from transformers import generation

    from t5tpu.model import decoding

    # (repetition_penalty, no_repeat_ngram_size, min_new_tokens, temperature, top_k, top_p)
    rows = [
        (1.0, 0, 0, 1.0, 0, 1.0),
        (1.5, 0, 0, 0.7, 0, 1.0),
        (0.7, 2, 0, 1.0, 9, 1.0),
        (1.2, 1, 9, 1.3, 0, 0.9),
        (2.0, 3, 3, 0.5, 20, 0.8),
        (1.0, 4, 0, 1.0, 0, 1.0),
    ]
    vocab, max_length, eos = 37, 12, 1
    rng = np.random.default_rng(3)
    logits = rng.normal(0, 3, size=(len(rows), vocab)).astype(np.float32)
    positions = np.asarray([0, 3, 8, 6, 10, 9])
    out = np.zeros((len(rows), max_length), np.int32)
    for row, position in enumerate(positions):  # few distinct tokens: n-grams recur
        out[row, :position] = rng.integers(2, 6, size=position)
    out[5, :9] = [2, 3, 4] * 3  # its last three tokens came before, followed by 2
    columns = list(zip(*rows, strict=True))
    values = decoding.RowSettings(
        temperature=jnp.asarray(columns[3], jnp.float32),
        top_k=jnp.asarray(columns[4], jnp.int32),
        top_p=jnp.asarray(columns[5], jnp.float32),
        repetition_penalty=jnp.asarray(columns[0], jnp.float32),
        no_repeat_ngram_size=jnp.asarray(columns[1], jnp.int32),
        min_new_tokens=jnp.asarray(columns[2], jnp.int32),
        max_new_tokens=jnp.full((len(rows),), max_length, jnp.int32),
    )
    prefix = decoding.Prefix(jnp.asarray(out), jnp.asarray(positions), jnp.ones(len(rows), bool))

    def ours(logits):
        return decoding.sampled_logits(
            decoding.penalized_logits(logits, values, prefix, eos), values
        )

    got = np.asarray(jax.jit(ours)(jnp.asarray(logits)))
    for row, (penalty, ngrams, least, temperature, top_k, top_p) in enumerate(rows):
        processors = generation.LogitsProcessorList()
        if penalty != 1:
            processors.append(generation.RepetitionPenaltyLogitsProcessor(penalty))
        if ngrams:
            processors.append(generation.NoRepeatNGramLogitsProcessor(ngrams))
        if least:
            processors.append(generation.MinNewTokensLengthLogitsProcessor(1, least, eos))
        processors.append(generation.TemperatureLogitsWarper(temperature))
        if top_k:
            processors.append(generation.TopKLogitsWarper(top_k))
        if top_p < 1:
            processors.append(generation.TopPLogitsWarper(top_p))
        decoder_inputs = torch.tensor([[0, *out[row, : positions[row]]]])  # the start token 0
        theirs = processors(decoder_inputs, torch.tensor(logits[row : row + 1])).numpy()[0]
        kept = np.isfinite(theirs)
        np.testing.assert_array_equal(np.isfinite(got[row]), kept, err_msg=str(rows[row]))
        np.testing.assert_allclose(got[row][kept], theirs[kept], rtol=1e-6, err_msg=str(rows[row]))
    # Each processor does something here: n-grams banned, EOS held off, penalties applied.
    assert np.flatnonzero(~np.isfinite(got[5])).tolist() == [2]
    assert not np.isfinite(got[3][eos])
    assert np.isfinite(got[0]).all() and not np.allclose(got[1], logits[1] / 0.7)
