"""Optimizers and learning-rate schedules, built from optax and configured in gin.

Both optimizers work on scanned layer stacks (T5Config.scan_layers) as on unrolled ones: AdamW
is elementwise (and its clipping global), and Adafactor's per-parameter blocks are per layer
(see `adafactor`), so a scanned run makes the same updates and keeps the same state, stacked.
"""

from __future__ import annotations

from typing import NamedTuple

import gin
import jax
import jax.numpy as jnp
import optax

from t5tpu.model import lora
from t5tpu.model.layer_stacking import LAYERS


class Optimizer(NamedTuple):
    """An optax transformation (`init`, `update`) with the learning-rate schedule it applies,
    so that training can log the rate of every step."""

    init: optax.TransformInitFn
    update: optax.TransformUpdateFn
    schedule: optax.Schedule

    def learning_rate(self, opt_state) -> jax.Array:
        """The rate the next update of `opt_state` applies: the schedule at the update count
        that optax's stateful transformations keep (they all count alike, from the fresh
        state, so fine-tuning from a pretrained step starts its schedule at 0)."""
        counts = [
            leaf
            for path, leaf in jax.tree_util.tree_leaves_with_path(opt_state)
            if getattr(path[-1], "name", None) == "count"
        ]
        return jnp.asarray(self.schedule(counts[0] if counts else 0), jnp.float32)


def _with_schedule(transformation, learning_rate) -> Optimizer:
    if not callable(learning_rate):
        learning_rate = optax.constant_schedule(learning_rate)
    return Optimizer(transformation.init, transformation.update, learning_rate)


@gin.configurable
def constant_schedule(learning_rate: float = 1e-3) -> optax.Schedule:
    return optax.constant_schedule(learning_rate)


@gin.configurable
def rsqrt_schedule(peak_learning_rate: float = 1e-2, warmup_steps: int = 10_000) -> optax.Schedule:
    """Linear warm-up to the peak, then decay as peak * sqrt(warmup / step) (T5's pretraining
    schedule is this with peak 0.01 and 10k warm-up steps)."""
    warmup = optax.linear_schedule(0.0, peak_learning_rate, max(warmup_steps, 1))

    def decay(count):
        return peak_learning_rate * jnp.sqrt(max(warmup_steps, 1) / (count + max(warmup_steps, 1)))

    return optax.join_schedules([warmup, decay], [warmup_steps])


@gin.configurable
def linear_decay_schedule(
    learning_rate: float = 1e-3,
    decay_steps: int = gin.REQUIRED,
    warmup_steps: int = 0,
    end_value: float = 0.0,
) -> optax.Schedule:
    """Linear warm-up to `learning_rate`, then linear decay to `end_value` at `decay_steps`."""
    return optax.join_schedules(
        [
            optax.linear_schedule(0.0, learning_rate, max(warmup_steps, 1)),
            optax.linear_schedule(learning_rate, end_value, max(decay_steps - warmup_steps, 1)),
        ],
        [warmup_steps],
    )


def _block_axes(path, x) -> tuple[int, ...] | None:
    """The axes of one of Adafactor's parameter blocks in leaf `x`: all of them, or all but the
    leading one for a leaf of a scanned stack (under "layers"), whose layers are blocks each."""
    if any(getattr(key, "key", None) == LAYERS for key in path):
        return tuple(range(1, x.ndim))
    return None


def _block_rms(path, x):
    axes = _block_axes(path, x)
    return jnp.sqrt(jnp.mean(jnp.square(x), axis=axes, keepdims=axes is not None))


def clip_by_block_rms(threshold: float) -> optax.GradientTransformation:
    """optax.clip_by_block_rms with a scanned stack's layers as blocks of their own."""

    def update(updates, state, params=None):
        del params

        def clip(path, u):
            return u / jnp.maximum(1.0, _block_rms(path, u) / threshold)

        return jax.tree_util.tree_map_with_path(clip, updates), state

    return optax.GradientTransformation(optax.init_empty_state, update)


def scale_by_param_block_rms(min_scale: float = 1e-3) -> optax.GradientTransformation:
    """optax.scale_by_param_block_rms with a scanned stack's layers as blocks of their own, and
    LoRA adapters left unscaled: `lora_b` starts at zero, so its step scaled by its own RMS
    would stay at the `min_scale` floor (a thousandth of the rate) and the adapters would
    barely move; `lora_a`, random and small, would move a few percent as fast."""

    def update(updates, state, params):
        def scale(path, u, p):
            if getattr(path[-1], "key", None) in lora.ADAPTER_NAMES:
                return u
            return u * jnp.maximum(_block_rms(path, p), min_scale)

        return jax.tree_util.tree_map_with_path(scale, updates, params), state

    return optax.GradientTransformation(optax.init_empty_state, update)


@gin.configurable
def adafactor(
    learning_rate: optax.Schedule | float = 1e-3,
    decay_rate: float = 0.8,
    clipping_threshold: float | None = 1.0,
    multiply_by_parameter_scale: bool = True,
    factored: bool = True,
    momentum: float | None = None,
    weight_decay_rate: float | None = None,
) -> Optimizer:
    """T5's Adafactor: factored second moments, decay 0.8, update clipping 1.0, updates scaled by
    the parameter's RMS (`multiply_by_parameter_scale`; never a LoRA adapter's, which starts at
    zero: see scale_by_param_block_rms, so LoRA needs no binding of its own).

    optax.adafactor's transformations in its order (so its state, and checkpoints of it, are
    the same), with update clipping and parameter scale per layer in a scanned stack. The
    factored moments are per layer already: a stack has fewer layers than the 128 a dimension
    needs to be factored, so the layer axis is never one of the two factored dimensions."""
    chain = [optax.scale_by_factored_rms(factored, decay_rate, min_dim_size_to_factor=128)]
    if clipping_threshold is not None:
        chain.append(clip_by_block_rms(clipping_threshold))
    chain.append(optax.scale_by_learning_rate(learning_rate, flip_sign=False))
    if multiply_by_parameter_scale:
        chain.append(scale_by_param_block_rms())
    if momentum is not None:
        chain.append(optax.ema(momentum, debias=False, accumulator_dtype=jnp.float32))
    if weight_decay_rate is not None:
        chain.append(optax.add_decayed_weights(weight_decay_rate))
    chain.append(optax.scale(-1))
    return _with_schedule(optax.chain(*chain), learning_rate)


@gin.configurable
def adamw(
    learning_rate: optax.Schedule | float = 1e-4,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    max_grad_norm: float | None = None,
) -> Optimizer:
    opt = optax.adamw(learning_rate, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)
    if max_grad_norm:
        opt = optax.chain(optax.clip_by_global_norm(max_grad_norm), opt)
    return _with_schedule(opt, learning_rate)
