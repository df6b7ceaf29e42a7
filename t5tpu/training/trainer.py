"""TrainState and the jit'd train step, with gradient accumulation over microbatches.

The step is pure: (state, batch) -> (state, metrics). Dropout randomness is derived from the
run's seed and the step number, so a resumed run draws exactly the masks it would have drawn.
"""

from __future__ import annotations

from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from t5tpu.model import param_shapes
from t5tpu.model.encoder_decoder import EncoderDecoderModel, loss_weights
from t5tpu.partitioning import Partitioner
from t5tpu.training import optim


@flax.struct.dataclass
class TrainState:
    step: jax.Array
    params: Any
    opt_state: Any


def split_microbatches(batch: dict, num_microbatches: int) -> dict:
    """[batch, ...] -> [num_microbatches, batch / num_microbatches, ...], row r going to
    microbatch r % num_microbatches. Strided, not in blocks: each device holds a contiguous run
    of rows, so every microbatch takes an equal part of every device's rows and stays spread
    over the whole 'data' axis without moving data."""

    def split(x):
        strided = x.reshape((x.shape[0] // num_microbatches, num_microbatches) + x.shape[1:])
        return nn.with_logical_constraint(jnp.swapaxes(strided, 0, 1), (None, "batch"))

    return jax.tree_util.tree_map(split, batch)


def _constrain(tree, shardings):
    return tree if shardings is None else jax.lax.with_sharding_constraint(tree, shardings)


def _sum_grads_over_microbatches(loss_fn, params, batch, rng, num_microbatches, grad_shardings):
    """Gradient of the summed loss, accumulated over microbatches with lax.scan; the gradients
    (and the accumulator) are sharded like the parameters."""
    grad_fn = jax.grad(loss_fn, has_aux=True)
    if num_microbatches <= 1:
        grads, metrics = grad_fn(params, batch, rng)
        return _constrain(grads, grad_shardings), metrics

    micro = split_microbatches(batch, num_microbatches)

    def accumulate(carry, indexed):
        index, microbatch = indexed
        grads, metrics = grad_fn(params, microbatch, jax.random.fold_in(rng, index))
        summed = jax.tree_util.tree_map(jnp.add, carry, (grads, metrics))
        return (_constrain(summed[0], grad_shardings), summed[1]), None

    zero_grads = _constrain(jax.tree_util.tree_map(jnp.zeros_like, params), grad_shardings)
    _, zero_metrics = jax.eval_shape(
        loss_fn, params, jax.tree_util.tree_map(lambda x: x[0], micro), rng
    )
    zero_metrics = jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), zero_metrics)
    (grads, metrics), _ = jax.lax.scan(
        accumulate, (zero_grads, zero_metrics), (jnp.arange(num_microbatches), micro)
    )
    return grads, metrics


def train_step(
    model: EncoderDecoderModel,
    optimizer: optax.GradientTransformation,
    state: TrainState,
    batch: dict,
    dropout_seed: jax.Array,
    num_microbatches: int = 1,
    grad_shardings=None,
) -> tuple[TrainState, dict]:
    """One optimizer step on `batch` (split into `num_microbatches` whose gradients are summed
    before the update, which equals the step on the whole batch). `grad_shardings` (the
    parameters' shardings) keeps gradients partitioned like the parameters inside jit."""
    rng = jax.random.fold_in(dropout_seed, state.step)
    use_dropout = model.config.dropout_rate > 0
    # The whole batch's normalizer divides each microbatch's loss before differentiation: the
    # gradients come out normalized, without another pass over them.
    normalizer = model.normalizer(jnp.sum(loss_weights(batch)))

    def loss_fn(params, microbatch, micro_rng):
        loss_sum, sums = model.loss(params, microbatch, micro_rng if use_dropout else None)
        return loss_sum / normalizer, sums

    grads, sums = _sum_grads_over_microbatches(
        loss_fn, state.params, batch, rng, num_microbatches, grad_shardings
    )
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    num_tokens = jnp.maximum(sums["num_tokens"], 1.0)
    metrics = {
        "loss": sums["loss_sum"] / normalizer,
        "z_loss": sums["z_loss_sum"] / normalizer,
        "token_accuracy": sums["correct_tokens"] / num_tokens,
        "nonpadding_tokens": sums["num_tokens"],
        "grad_norm": _global_norm(grads),
    }
    if isinstance(optimizer, optim.Optimizer):
        metrics["learning_rate"] = optimizer.learning_rate(state.opt_state)
    return TrainState(state.step + 1, params, opt_state), metrics


def _global_norm(tree) -> jax.Array:
    """optax.tree.norm's value, its squares taken as |g|·|g|: XLA merges a g·g here with the
    square of Adam's second moment and writes that array out for both (a third of AdamW's time
    on CPU, docs/PERFORMANCE.md); this one fuses into its own sum."""
    leaves = jax.tree_util.tree_leaves(tree)
    return jnp.sqrt(sum(jnp.sum(jnp.abs(g) * jnp.abs(g)) for g in leaves))


def initial_state(
    model: EncoderDecoderModel, optimizer, rng, input_length, target_length, params=None
) -> TrainState:
    """A fresh state; `params` (e.g. from a pretrained checkpoint) replace the random init."""
    if params is None:
        params = nn.unbox(model.init(rng, input_length, target_length))
    return TrainState(jnp.int32(0), params, optimizer.init(params))


def state_shardings(model: EncoderDecoderModel, optimizer, partitioner: Partitioner):
    """(abstract state, its shardings): parameters by the logical rules, optimizer state leaf by
    leaf like the parameter it belongs to (Adafactor's factored moments keep the sharding of the
    dimensions they keep; AdamW's moments are sharded exactly like their parameters)."""
    boxed = param_shapes.boxed_abstract_params(model.config)
    params = nn.unbox(boxed)
    abstract = jax.eval_shape(lambda p: TrainState(jnp.int32(0), p, optimizer.init(p)), params)
    shardings = TrainState(
        partitioner.replicated(),
        partitioner.param_shardings(boxed),
        partitioner.opt_state_shardings(abstract.opt_state, boxed),
    )
    return abstract, shardings


def compile_train_step(
    model, optimizer, shardings: TrainState, partitioner: Partitioner, num_microbatches: int = 1
):
    """train_step jit'd with explicit shardings (activations constrained by the logical rules,
    gradients sharded like the parameters) and the old state donated."""

    def step(state, batch, dropout_seed):
        return train_step(
            model, optimizer, state, batch, dropout_seed, num_microbatches, shardings.params
        )

    return partitioner.jit(
        step,
        in_shardings=(shardings, partitioner.batch_sharding(), partitioner.replicated()),
        out_shardings=(shardings, partitioner.replicated()),
        donate_argnums=(0,),
    )
