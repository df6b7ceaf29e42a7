"""Beam search: one beam is greedy, a wide beam finds what exhaustive search finds under the same
length-penalized score, alpha moves the choice toward longer hypotheses, and the scores it
returns are what re-scoring its output with a full forward pass gives (so the KV cache follows
its beams correctly)."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference_decoding
from tiny import tiny_config

from t5tpu.model import decoding
from t5tpu.model.network import Transformer

EOS = 1


def _random_model(vocab_size: int, seed: int, scale: float):
    cfg = tiny_config(vocab_size=vocab_size, emb_dim=32, num_heads=2, head_dim=16, mlp_dim=64)
    module = Transformer(cfg)
    ones = jnp.ones((1, 8), jnp.int32)
    params = module.init(jax.random.PRNGKey(seed), ones, ones)["params"]
    return cfg, module, jax.tree_util.tree_map(lambda x: x * scale, params)


def _token_log_probs(module, params, inputs: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """log p(targets[i, t] | inputs[i], targets[i, :t]) by one teacher-forced forward pass."""
    decoder_inputs = np.zeros_like(targets)
    decoder_inputs[:, 1:] = targets[:, :-1]
    logits = jax.jit(module.apply)({"params": params}, inputs, decoder_inputs)
    log_p = np.asarray(jax.nn.log_softmax(logits))
    return np.take_along_axis(log_p, targets[..., None], axis=-1)[..., 0]


def _hypothesis(sequence: np.ndarray) -> tuple[int, ...]:
    """A decoded row up to and including its first EOS (the whole row if it has none)."""
    hits = np.flatnonzero(sequence == EOS)
    return tuple(sequence[: hits[0] + 1] if len(hits) else sequence)


def _penalized(token_log_probs: np.ndarray, length: int, alpha: float) -> float:
    return float(token_log_probs[:length].sum() / ((5 + length) / 6) ** alpha)


def test_one_beam_with_alpha_zero_is_greedy():
    _, module, params = _random_model(96, seed=0, scale=1.5)
    inputs = jnp.asarray(np.random.default_rng(0).integers(2, 96, size=(6, 12)), jnp.int32)
    greedy = jax.jit(lambda p, x: reference_decoding.decode(module, p, x, 10, EOS))(params, inputs)
    beam, _ = jax.jit(lambda p, x: decoding.beam_search(module, p, x, 10, EOS, 1, alpha=0.0))(
        params, inputs
    )
    greedy = np.asarray(greedy)
    np.testing.assert_array_equal(np.asarray(beam), greedy)
    ended = [(row == EOS).any() for row in greedy]
    assert any(ended) and not all(ended)  # rows that stop at EOS and rows that run to the end


VOCAB, LENGTH = 5, 3
ALPHAS = (0.0, 0.6, 3.0)


@pytest.fixture(scope="module")
def exhaustive_case():
    """A 5-token model decoding 3 tokens: every hypothesis can be enumerated (125 sequences)."""
    _, module, params = _random_model(VOCAB, seed=3, scale=1.0)
    inputs = np.random.default_rng(3).integers(2, VOCAB, size=(8, 7)).astype(np.int32)
    sequences = np.array(list(itertools.product(range(VOCAB), repeat=LENGTH)), np.int32)
    log_probs = _token_log_probs(
        module,
        params,
        np.repeat(inputs, len(sequences), axis=0),
        np.tile(sequences, (len(inputs), 1)),
    ).reshape(len(inputs), len(sequences), LENGTH)
    beam = jax.jit(
        lambda p, x, alpha, beams: decoding.beam_search(module, p, x, LENGTH, EOS, beams, alpha),
        static_argnums=3,
    )
    # VOCAB ** (LENGTH - 1) beams keep every prefix and every extension before the last step.
    wide = {alpha: beam(params, inputs, alpha, VOCAB ** (LENGTH - 1)) for alpha in ALPHAS}
    narrow = {alpha: beam(params, inputs, alpha, 2) for alpha in ALPHAS}
    return sequences, log_probs, wide, narrow


def _exhaustive_best(sequences, log_probs, alpha):
    """Per example: (best hypothesis, its score) over every sequence EOS may end early."""
    best = []
    for example_log_probs in log_probs:
        scored = {}
        for sequence, token_log_probs in zip(sequences, example_log_probs, strict=True):
            hypothesis = _hypothesis(sequence)
            scored[hypothesis] = _penalized(token_log_probs, len(hypothesis), alpha)
        winner = max(scored, key=scored.get)
        best.append((winner, scored[winner]))
    return best


@pytest.mark.parametrize("alpha", ALPHAS)
def test_wide_beam_finds_the_exhaustive_best(exhaustive_case, alpha):
    sequences, log_probs, wide, _ = exhaustive_case
    tokens, scores = (np.asarray(a) for a in wide[alpha])
    for row, score, (best, best_score) in zip(
        tokens, scores, _exhaustive_best(sequences, log_probs, alpha), strict=True
    ):
        assert _hypothesis(row) == best
        assert (row[len(best) :] == 0).all()
        np.testing.assert_allclose(score, best_score, rtol=1e-5)


def test_search_is_not_trivial_and_alpha_favors_longer_hypotheses(exhaustive_case):
    sequences, log_probs, wide, narrow = exhaustive_case
    lengths = {
        alpha: [len(_hypothesis(row)) for row in np.asarray(wide[alpha][0])] for alpha in ALPHAS
    }
    assert len(set(lengths[0.0])) == 3  # EOS first, after one token, or none at all
    # Dividing by a penalty that grows with length (more with larger alpha) can only move the
    # choice toward longer hypotheses; here it moves some.
    for shorter, longer in itertools.pairwise(ALPHAS):
        assert all(a <= b for a, b in zip(lengths[shorter], lengths[longer], strict=True))
    assert sum(lengths[3.0]) > sum(lengths[0.0])
    # Two beams miss the best hypothesis somewhere, so the wide beam's agreement means something.
    best = _exhaustive_best(sequences, log_probs, 0.0)
    narrow_rows = [_hypothesis(row) for row in np.asarray(narrow[0.0][0])]
    assert any(row != b for row, (b, _) in zip(narrow_rows, best, strict=True))


def test_scores_are_rescored_log_likelihoods():
    _, module, params = _random_model(96, seed=0, scale=1.5)
    inputs = np.random.default_rng(3).integers(2, 96, size=(4, 10)).astype(np.int32)
    inputs[2, 6:] = 0  # a padded row
    alpha, length = 0.6, 8
    tokens, scores = jax.jit(
        lambda p, x: decoding.beam_search(module, p, x, length, EOS, 4, alpha)
    )(params, inputs)
    tokens, scores = np.asarray(tokens), np.asarray(scores)
    rescored = _token_log_probs(module, params, inputs, tokens)
    lengths = [len(_hypothesis(row)) for row in tokens]
    assert max(lengths) == length > min(lengths) > 1  # some rows end at EOS, some run out
    for row, score, row_log_probs, n in zip(tokens, scores, rescored, lengths, strict=True):
        np.testing.assert_allclose(score, _penalized(row_log_probs, n, alpha), rtol=1e-4)
        assert (row[n:] == 0).all()


def test_rows_of_other_alphas_and_limits_decode_as_alone_in_one_program():
    """alpha and the length limit are each row's values (a server's beam requests of any share
    its programs): a batch of mixed ones gives each row what a program of its own gives."""
    _, module, params = _random_model(VOCAB, seed=3, scale=1.0)  # EOS is often likely
    inputs = np.random.default_rng(5).integers(2, VOCAB, size=(6, 10)).astype(np.int32)
    alphas = np.array([0.0, 3.0, 3.0, 0.6, 0.0, 3.0], np.float32)
    limits = np.array([8, 3, 2, 1, 8, 4], np.int32)

    def hypotheses(x, length, alpha, limit):
        tokens, scores = decoding.beam_hypotheses(module, params, x, length, EOS, 3, alpha, limit)
        per_row = (alpha, limit) if limit is None else (alpha[:, None], limit[:, None])
        return tokens, decoding.log_likelihoods(tokens, scores, EOS, *per_row)

    mixed = jax.jit(lambda x, a, n: hypotheses(x, 8, a, n))
    tokens, scores = (np.asarray(a) for a in mixed(inputs, alphas, limits))
    ran_out = 0
    for i, (alpha, limit) in enumerate(zip(alphas.tolist(), limits.tolist(), strict=True)):
        alone = jax.jit(lambda x, n=limit, a=alpha: hypotheses(x, n, a, None))(inputs[i : i + 1])
        alone_tokens, alone_scores = (np.asarray(a)[0] for a in alone)
        np.testing.assert_array_equal(tokens[i, :, :limit], alone_tokens)
        assert (tokens[i, :, limit:] == 0).all()
        np.testing.assert_allclose(scores[i], alone_scores, rtol=1e-5)
        ran_out += sum(EOS not in row for row in alone_tokens)
    assert ran_out  # some hypotheses end by their limit, not by EOS
