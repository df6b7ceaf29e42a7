"""EncoderDecoderModel: the network plus what training and evaluation need from it.

Losses are returned as a sum together with the number of weighted target tokens, so the train
step can normalize once over the whole batch; that keeps microbatched (gradient-accumulation)
steps exactly equal to the full-batch step.
"""

from __future__ import annotations

import copy
import dataclasses

import gin
import jax
import jax.numpy as jnp

from t5tpu.errors import UserError
from t5tpu.model.lora import LoraSettings
from t5tpu.model.model_family import network_module
from t5tpu.model.network import T5Config
from t5tpu.model.t5gemma_network import T5GemmaConfig
from t5tpu.runtime.lazy_imports import seqio

Array = jax.Array


def cross_entropy(
    logits: Array, targets: Array, label_smoothing: float = 0.0, z_loss: float = 0.0
) -> tuple[Array, Array]:
    """Per-token (loss, z_loss term). With label smoothing the constant entropy of the smoothed
    target is subtracted, so a perfect prediction has loss 0 as without smoothing."""
    vocab = logits.shape[-1]
    log_z = jax.nn.logsumexp(logits, axis=-1)
    target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    nll = log_z - target_logit
    if label_smoothing > 0:
        confidence = 1.0 - label_smoothing
        low = label_smoothing / (vocab - 1)
        mean_nll = log_z - jnp.mean(logits, axis=-1)  # -mean over vocab of log p
        entropy = -(confidence * jnp.log(confidence) + (vocab - 1) * low * jnp.log(low))
        nll = (confidence - low) * nll + low * vocab * mean_nll - entropy
    z_term = z_loss * jnp.square(log_z)
    return nll + z_term, z_term


def loss_weights(batch: dict) -> Array:
    """Each target token's weight in the loss: the batch's own, or 1 for every real token."""
    targets = batch["decoder_target_tokens"]
    return batch.get("decoder_loss_weights", (targets > 0).astype(jnp.float32))


@gin.configurable
class EncoderDecoderModel:
    """A T5 network with its vocabulary, loss settings and decoding."""

    def __init__(
        self,
        config: T5Config | T5GemmaConfig,
        vocabulary: seqio.Vocabulary,
        z_loss: float = 1e-4,
        label_smoothing: float = 0.0,
        loss_normalizing_factor: float | str | None = None,
    ):
        if vocabulary.vocab_size > config.vocab_size:
            raise UserError(
                f"vocabulary has {vocabulary.vocab_size} ids but T5Config.vocab_size is "
                f"{config.vocab_size}; bind T5Config.vocab_size >= the vocabulary size"
            )
        if loss_normalizing_factor not in (None, "NUM_REAL_TARGET_TOKENS") and not isinstance(
            loss_normalizing_factor, (int, float)
        ):
            raise UserError(
                f"loss_normalizing_factor={loss_normalizing_factor!r}; use None, "
                "'NUM_REAL_TARGET_TOKENS' or a number"
            )
        self.config = config
        self.vocabulary = vocabulary
        self.module = network_module(config)
        self.z_loss = z_loss
        self.label_smoothing = label_smoothing
        self.loss_normalizing_factor = loss_normalizing_factor

    def init(self, rng: Array, input_length: int, target_length: int):
        """Boxed (logically annotated) float32 parameters."""
        encoder = jnp.ones((1, input_length), jnp.int32)
        decoder = jnp.ones((1, target_length), jnp.int32)
        return self.module.init(rng, encoder, decoder)["params"]

    def logits(self, params, batch, dropout_rng=None):
        """[batch, target length, vocab] logits of the decoder inputs given the encoder inputs;
        with `dropout_rng`, in training mode (dropout on)."""
        deterministic = dropout_rng is None
        return self.module.apply(
            {"params": params},
            batch["encoder_input_tokens"],
            batch["decoder_input_tokens"],
            batch.get("encoder_segment_ids"),
            batch.get("decoder_segment_ids"),
            deterministic=deterministic,
            rngs=None if deterministic else {"dropout": dropout_rng},
        )

    def loss(self, params, batch, dropout_rng=None) -> tuple[Array, dict[str, Array]]:
        """Summed weighted loss and its parts (sums: microbatches add them up before the
        trainer divides by `normalizer`)."""
        logits = self.logits(params, batch, dropout_rng)
        targets = batch["decoder_target_tokens"]
        weights = loss_weights(batch)
        token_loss, z_term = cross_entropy(logits, targets, self.label_smoothing, self.z_loss)
        num_tokens = jnp.sum(weights)
        # A target tied for the highest logit counts as predicted. Compared with the maximum
        # the loss computes anyway; an argmax is another pass over [batch, length, vocab].
        target_logit = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
        correct = (target_logit >= jnp.max(logits, axis=-1)) * weights
        metrics = {
            "loss_sum": jnp.sum(token_loss * weights),
            "z_loss_sum": jnp.sum(z_term * weights),
            "correct_tokens": jnp.sum(correct),
            "num_tokens": num_tokens,
        }
        return metrics["loss_sum"], metrics

    def normalizer(self, num_tokens: Array) -> Array:
        """What summed losses and gradients are divided by: a fixed loss_normalizing_factor, or
        the number of target tokens in the whole batch."""
        if isinstance(self.loss_normalizing_factor, (int, float)):
            return jnp.float32(self.loss_normalizing_factor)
        return jnp.maximum(num_tokens, 1.0)

    def score(self, params, batch) -> Array:
        """Log-likelihood of each example's targets, summed over its tokens."""
        logits = self.logits(params, batch)
        targets = batch["decoder_target_tokens"]
        log_p = jax.nn.log_softmax(logits)
        token_ll = jnp.take_along_axis(log_p, targets[..., None], axis=-1)[..., 0]
        return jnp.sum(token_ll * (targets > 0), axis=-1)


def adapted_model(model: EncoderDecoderModel, settings: LoraSettings) -> EncoderDecoderModel:
    """`model` with LoRA adapters beside the kernels `settings` target (model/lora.py): same
    vocabulary, loss and decoding; its parameters are the base's joined with the adapters."""
    adapted = copy.copy(model)
    adapted.config = dataclasses.replace(model.config, lora=settings)
    adapted.module = network_module(adapted.config)
    return adapted
