"""Optimizers and learning-rate schedules, built from optax and configured in gin.

Both optimizers work on scanned layer stacks (T5Config.scan_layers) as on unrolled ones: AdamW
is elementwise (and its clipping global), and Adafactor's per-parameter blocks are per layer
(see `adafactor`), so a scanned run makes the same updates and keeps the same state, stacked.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import gin
import jax
import jax.numpy as jnp
import numpy as np
import optax

from t5tpu.model import lora
from t5tpu.model.layer_stacking import LAYERS

# T5X's and optax's Adafactor: a side under 128 is not factored; epsilon added to g².
_MIN_DIM_TO_FACTOR = 128
_EPSILON = 1e-30


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
    return tuple(range(1, x.ndim)) if _in_stack(path) else None


def _in_stack(path) -> bool:
    """Whether the leaf at `path` is a scanned stack's, with a leading layer axis."""
    return any(getattr(key, "key", None) == LAYERS for key in path)


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


class Factoring(NamedTuple):
    """How Adafactor factors one leaf's second moment: the row moment averages g² over `large`
    (optax's d0, the larger side), the column moment over `small`."""

    large: tuple[int, ...]
    small: tuple[int, ...]


def factoring(path, shape: tuple[int, ...], join_heads: bool = True) -> Factoring | None:
    """The factoring of the leaf at `path`, None for a full moment. optax's rule (the two
    largest dimensions, both at least 128), but for attention kernels with `join_heads`: T5X
    stores them as matrices, [embed, heads·head_dim] (query, key, value) and [heads·head_dim,
    embed] (output), and factors those; ours keep heads and head_dim apart, so here the moments
    average over both at once."""
    lead = 1 if _in_stack(path) else 0
    dims = shape[lead:]
    if join_heads and getattr(path[-1], "key", None) == "kernel" and len(dims) == 3:
        split = lead + (1 if dims[0] >= dims[2] else 2)  # embed leads, or ends
        sides = (tuple(range(lead, split)), tuple(range(split, len(shape))))
        # The larger side as optax's argsort picks it: of two equal ones, the later.
        small, large = sorted(sides, key=lambda side: math.prod(shape[d] for d in side))
    elif len(shape) >= 2:
        small, large = ((int(d),) for d in np.argsort(shape)[-2:])
    else:
        return None
    if math.prod(shape[d] for d in small) < _MIN_DIM_TO_FACTOR:
        return None
    return Factoring(large=large, small=small)


class _Moments(NamedTuple):
    v_row: jax.Array
    v_col: jax.Array
    v: jax.Array


class _Stepped(NamedTuple):
    update: jax.Array
    moments: _Moments


def _is_stepped(x) -> bool:
    return isinstance(x, _Stepped)


def _factored_state(count, moments) -> optax.FactoredState:
    """optax's state (its names and order) from a tree of _Moments."""

    def pick(name):
        return jax.tree.map(
            lambda m: getattr(m, name), moments, is_leaf=lambda x: isinstance(x, _Moments)
        )

    return optax.FactoredState(count, pick("v_row"), pick("v_col"), pick("v"))


def _without(x, axes: tuple[int, ...]) -> jax.Array:
    """Zeros shaped like `x` with `axes` gone."""
    return jnp.zeros([n for d, n in enumerate(x.shape) if d not in axes], x.dtype)


def _factored_step(grad, moments: _Moments, factors: Factoring, decay) -> _Stepped:
    """optax.scale_by_factored_rms's step for one factored leaf, over groups of dimensions."""
    grad_sqr = jnp.square(grad) + _EPSILON
    v_row = decay * moments.v_row + (1 - decay) * jnp.mean(grad_sqr, axis=factors.large)
    v_col = decay * moments.v_col + (1 - decay) * jnp.mean(grad_sqr, axis=factors.small)
    row = jnp.expand_dims(v_row, factors.large)
    row_factor = (row / jnp.mean(row, axis=factors.small, keepdims=True)) ** -0.5
    update = grad * row_factor * jnp.expand_dims(v_col, factors.small) ** -0.5
    return _Stepped(update, _Moments(v_row, v_col, moments.v))


def scale_by_factored_rms(decay_rate: float, factored: bool = True, join_heads: bool = True):
    """optax.scale_by_factored_rms (its state, its numbers) with T5X's factoring of attention
    kernels (`factoring`). optax reduces over single dimensions only, hence this rewrite."""

    def factors_of(path, leaf) -> Factoring | None:
        return factoring(path, leaf.shape, join_heads) if factored else None

    def init(params):
        def moments(path, p):
            f = factors_of(path, p)
            unused = functools.partial(jnp.zeros, (1,), p.dtype)  # a buffer each: donated apart
            if f is None:
                return _Moments(unused(), unused(), jnp.zeros_like(p))
            return _Moments(_without(p, f.large), _without(p, f.small), unused())

        return _factored_state(
            jnp.zeros([], jnp.int32), jax.tree_util.tree_map_with_path(moments, params)
        )

    def update(updates, state, params=None):
        del params
        decay = 1.0 - jnp.asarray(state.count + 1, jnp.float32) ** -decay_rate

        def step(path, g, v_row, v_col, v):
            f = factors_of(path, g)
            if f is not None:
                return _factored_step(g, _Moments(v_row, v_col, v), f, decay)
            v = decay * v + (1 - decay) * (jnp.square(g) + _EPSILON)
            return _Stepped(g * v**-0.5, _Moments(v_row, v_col, v))

        out = jax.tree_util.tree_map_with_path(step, updates, state.v_row, state.v_col, state.v)
        stepped = jax.tree.map(lambda o: o.update, out, is_leaf=_is_stepped)
        moments = jax.tree.map(lambda o: o.moments, out, is_leaf=_is_stepped)
        return stepped, _factored_state(optax.safe_increment(state.count), moments)

    return optax.GradientTransformation(init, update)


@gin.configurable
def adafactor(
    learning_rate: optax.Schedule | float = 1e-3,
    decay_rate: float = 0.8,
    clipping_threshold: float | None = 1.0,
    multiply_by_parameter_scale: bool = True,
    factored: bool = True,
    momentum: float | None = None,
    weight_decay_rate: float | None = None,
    join_heads: bool = True,
) -> Optimizer:
    """T5's Adafactor: factored second moments, decay 0.8, update clipping 1.0, updates scaled by
    the parameter's RMS (`multiply_by_parameter_scale`; never a LoRA adapter's, which starts at
    zero: see scale_by_param_block_rms, so LoRA needs no binding of its own).

    optax.adafactor's transformations in its order (so its state has the same structure), with
    attention kernels factored as T5X does (`join_heads`, see scale_by_factored_rms; False: the
    full moments t5tpu kept for them before 2026-11-29, to resume a run saved then), and update
    clipping and parameter scale per layer in a scanned stack. The factored moments are per
    layer already: a stack has fewer layers than the 128 a dimension needs to be factored, so
    the layer axis is never one of the two factored dimensions."""
    chain = [scale_by_factored_rms(decay_rate, factored=factored, join_heads=join_heads)]
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
