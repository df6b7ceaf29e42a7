"""The train step's gradient and metrics against a direct computation of T5's loss."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tiny import tiny_config

from t5tpu.model.encoder_decoder import EncoderDecoderModel
from t5tpu.training import trainer

CONFIG = dict(vocab_size=64, emb_dim=32, num_heads=2, head_dim=16, mlp_dim=64, dtype="float32")
Z_LOSS = 1e-4


def _setup():
    model = EncoderDecoderModel(tiny_config(**CONFIG), types.SimpleNamespace(vocab_size=64))
    rng = np.random.default_rng(0)
    targets = rng.integers(2, 64, size=(3, 6)).astype(np.int32)
    targets[0, 4:] = 0  # padding: no weight in the loss, not counted as a token
    targets[2, 1:] = 0
    batch = {
        "encoder_input_tokens": rng.integers(2, 64, size=(3, 7)).astype(np.int32),
        "decoder_input_tokens": np.pad(targets[:, :-1], ((0, 0), (1, 0))),
        "decoder_target_tokens": targets,
    }
    params = jax.jit(lambda: trainer.initial_state(model, optax.sgd(1.0), jax.random.key(0), 7, 6))
    params = params().params
    # Every other real target is the model's top prediction, so the accuracy has hits to count
    # (a position's logits depend only on the targets before it).
    for t in range(targets.shape[1]):
        batch["decoder_input_tokens"] = np.pad(targets[:, :-1], ((0, 0), (1, 0)))
        top = np.argmax(model.logits(params, batch)[:, t], axis=-1)
        hit = (np.arange(3) + t) % 2 == 0
        targets[:, t] = np.where(hit & (targets[:, t] > 0), top, targets[:, t])
    batch["decoder_input_tokens"] = np.pad(targets[:, :-1], ((0, 0), (1, 0)))
    return model, params, batch


def _mean_loss(model, params, batch):
    """Cross-entropy plus z-loss, averaged over the real target tokens."""
    logits = model.logits(params, batch)
    targets = batch["decoder_target_tokens"]
    log_z = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    weights = (targets > 0).astype(jnp.float32)
    token_loss = log_z - target_logit + Z_LOSS * log_z**2
    return jnp.sum(token_loss * weights) / jnp.sum(weights)


def test_step_follows_the_gradient_of_the_mean_token_loss():
    model, params, batch = _setup()
    state = trainer.TrainState(jnp.int32(0), params, optax.sgd(1.0).init(params))
    step = jax.jit(lambda s, b: trainer.train_step(model, optax.sgd(1.0), s, b, jax.random.key(1)))
    new_state, metrics = step(state, batch)

    want_loss, want_grads = jax.value_and_grad(_mean_loss, argnums=1)(model, params, batch)
    got_grads = jax.tree_util.tree_map(lambda old, new: old - new, params, new_state.params)
    for got, want in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(metrics["loss"], want_loss, rtol=1e-5)
    np.testing.assert_allclose(metrics["grad_norm"], optax.tree.norm(want_grads), rtol=1e-4)
    assert float(metrics["nonpadding_tokens"]) == 11

    logits = model.logits(params, batch)
    targets = batch["decoder_target_tokens"]
    hits = (np.argmax(logits, axis=-1) == targets) & (targets > 0)
    assert hits.sum() >= 6
    np.testing.assert_allclose(metrics["token_accuracy"], hits.sum() / 11, rtol=1e-6)
