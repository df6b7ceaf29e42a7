"""A workload's dense matmuls on their own, for `t5tpu bench`: how long XLA takes for exactly
the weight matmuls a train step, a scoring pass or one decoding step does, at the same shapes,
with nothing else around them (no attention, norms, softmax, optimizer, cache updates).

The machine's limits (bench_limits) say what the hardware could do; this says what XLA's own
matmul kernels do at the model's shapes. The two differ most where it matters for decoding: a
few-row float32 matmul on CPU reads its weights well below the memory's rate and computes well
below the large matmul's peak (docs/PERFORMANCE.md, "Changes"). A step's time
is then its dense matmuls' time (`dense_matmul_ms`) plus what the rest of the step adds;
`dense_share` is the first over the step.

Each matmul gets its own weight matrix (so the chain reads as many weight bytes as the step),
and each one's input depends on the previous one's output (so XLA can neither hoist, drop nor
run any of them side by side, which the step's own dependencies do not allow either)."""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp

from t5tpu.bench.limits import Probe
from t5tpu.model import feature_major as feature_major_step
from t5tpu.model import precision


@dataclasses.dataclass(frozen=True)
class DenseMatmul:
    """[rows, fan_in] x [fan_in, fan_out]."""

    rows: int
    fan_in: int
    fan_out: int

    @property
    def flops(self) -> float:
        return 2.0 * self.rows * self.fan_in * self.fan_out


def _layer(config, rows: int, cross: bool) -> list[DenseMatmul]:
    """One layer's weight matmuls for `rows` tokens: attention's query, key, value and output
    projections, the cross-attention's query and output (`cross`: its keys and values come from
    the encoder, counted apart), and the feed-forward's input kernels and output."""
    d, inner, ff = config.emb_dim, config.num_heads * config.head_dim, config.mlp_dim
    attention = [DenseMatmul(rows, d, inner)] * 3 + [DenseMatmul(rows, inner, d)]
    if cross:
        attention += [DenseMatmul(rows, d, inner), DenseMatmul(rows, inner, d)]
    mlp = [DenseMatmul(rows, d, ff)] * len(config.mlp_activations) + [DenseMatmul(rows, ff, d)]
    return attention + mlp


def forward_dense(config, batch: int, input_length: int, target_length: int) -> list[DenseMatmul]:
    """The weight matmuls of one forward pass (train's forward, scoring)."""
    enc_rows, dec_rows = batch * input_length, batch * target_length
    d, inner = config.emb_dim, config.num_heads * config.head_dim
    encoder = _layer(config, enc_rows, cross=False) * config.num_encoder_layers
    cross_kv = [DenseMatmul(enc_rows, d, inner)] * 2 * config.num_decoder_layers
    decoder = _layer(config, dec_rows, cross=True) * config.num_decoder_layers
    return encoder + cross_kv + decoder + [DenseMatmul(dec_rows, d, config.vocab_size)]


def decode_step_dense(config, rows: int) -> list[DenseMatmul]:
    """The weight matmuls of one decoding step of `rows` hypotheses (the cross-attention's keys
    and values are in the cache by then)."""
    decoder = _layer(config, rows, cross=True) * config.num_decoder_layers
    return decoder + [DenseMatmul(rows, config.emb_dim, config.vocab_size)]


def dense_operands(
    matmuls: list[DenseMatmul], dtype, backward: bool, feature_major: bool = False
) -> tuple:
    """(weights, inputs, output gradients) for dense_chain: a weight matrix per matmul, so the
    chain reads as many weight bytes as the workload; inputs and output gradients (`backward`
    only) shared by shape, by (rows, width). `feature_major`: weights [out, in] and inputs
    [in, rows], as CPU's bf16 decoding step holds them (model/feature_major.py)."""
    seeds = itertools.count()
    normal = lambda shape: jax.random.normal(jax.random.PRNGKey(next(seeds)), shape, dtype)
    if feature_major:
        weights = [normal((m.fan_out, m.fan_in)) for m in matmuls]
        inputs = {(m.rows, m.fan_in): normal((m.fan_in, m.rows)) for m in matmuls}
        return weights, inputs, {}
    weights = [normal((m.fan_in, m.fan_out)) for m in matmuls]
    inputs = {(m.rows, m.fan_in): normal((m.rows, m.fan_in)) for m in matmuls}
    grads = {(m.rows, m.fan_out): normal((m.rows, m.fan_out)) for m in matmuls if backward}
    return weights, inputs, grads


def _products(x, w, dy, feature_major: bool):
    """x @ w, and with `dy` the two gradient matmuls, as the model computes them: float32, or
    bfloat16 inputs with float32 accumulation (precision.contract's fast forms, or the
    feature-major step's)."""
    if feature_major:
        return [feature_major_step.dense(w, x, jnp.float32)]
    if x.dtype == jnp.float32:
        return [x @ w] + ([] if dy is None else [dy @ w.T, x.T @ dy])
    products = [precision.contract("mk,kn->mn", x, w)]
    if dy is not None:
        products += [
            precision.contract("mn,kn->mk", dy, w),
            precision.contract("mn,mk->kn", dy, x),
        ]
    return products


def dense_chain(matmuls: list[DenseMatmul], backward: bool, feature_major: bool = False):
    """The jitted chain over dense_operands: each matmul in turn, with `backward` its two gradient
    matmuls too ([rows, out] x [out, in] and [in, rows] x [rows, out]), as a train step's
    backward pass does."""

    @jax.jit
    def chain(weights, inputs, grads):
        dtype = next(iter(inputs.values())).dtype
        carry = jnp.zeros((), dtype)
        for m, w in zip(matmuls, weights, strict=True):
            x = inputs[(m.rows, m.fan_in)] + carry
            dy = grads[(m.rows, m.fan_out)] if backward else None
            products = _products(x, w, dy, feature_major)
            # The next input depends on one element of each product; the barrier makes sure
            # no XLA version computes only that element (the tests check the compiled FLOPs).
            products = jax.lax.optimization_barrier(products)
            carry = (sum(p[0, 0] for p in products) * 1e-30).astype(dtype)
        return carry

    return chain


def dense_probe(
    matmuls: list[DenseMatmul], dtype, backward: bool = False, feature_major: bool = False
) -> Probe:
    """A Probe (rate in FLOP/s) that runs dense_chain once, compiled and run once here so that
    no probe times the compile or a first call's set-up, with or without --warmup."""
    operands = dense_operands(matmuls, dtype, backward, feature_major)
    chain = dense_chain(matmuls, backward, feature_major).lower(*operands).compile()
    jax.block_until_ready(chain(*operands))
    flops = sum(m.flops for m in matmuls) * (3 if backward else 1)
    shape = f"{len(matmuls)} dense matmuls{' and their gradients' if backward else ''}"
    return Probe("dense_matmuls", "FLOP/s", shape, lambda: chain(*operands), flops)
