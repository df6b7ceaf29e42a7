"""Mixed precision as T5X runs T5 on TPU: bfloat16 matmul inputs, float32 accumulation.

`einsum` is the one matmul of the network (dense layers, attention, relative position bias,
logits). With T5Config.dtype 'float32' it is plain jnp.einsum. With 'bfloat16' both operands are
rounded to bfloat16 (a no-op for parameters already cast by `cast_params`), products are
accumulated in float32 and the result is cast to the activation dtype (the logits stay float32);
the backward pass does the same with a bfloat16 cotangent, and hands float32 master parameters
float32 gradients.

XLA:CPU (jax 0.10) runs a bf16 dot with float32 accumulation on its fast kernels (YNNPACK, an
`__ynn_fusion` in the compiled HLO) only in some forms; for the others it converts both operands
to float32 first (a kernel several times slower, plus the copies). A dot it takes as canonical
(batch dims first, one contracting and at most one free dim per operand) stays bf16 only when
the lhs contracts its last dim and has two or more rows (its producer does not matter). A dot it
must canonicalize itself (several contracting or free dims) gets its transposes after that
judgement and stays bf16. Dots with a dim under four run in float32 whatever is done; at that
size it costs nothing. `contract` shapes every dot accordingly: the operand contracting its
trailing dims goes left, a unit contracted dim is added when neither does (so XLA
canonicalizes), and a single-row lhs is duplicated to two rows in place (a new leading dim
instead can be canonicalized into a transposed bf16 dot that XLA:CPU cannot run at all).

Those shapes are for XLA:CPU only: TPU and GPU get the plain dot (bf16 operands, float32
accumulation, the result in the dtype asked for), which their compilers lay out themselves; the
duplicated row would double a decoding step's matmul work there. `cpu_shapes` decides, once per
traced dot, from the platform the program is traced for (Partitioner.jit sets it from its mesh's
devices: libtpu's compile-only devices of a slice count as TPU), else from jax's default
backend. `sum_rows` makes the same choice for a sum over a leading axis, which XLA:CPU
reduces slowly.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from t5tpu import partitioning

Array = jax.Array
COMPUTE_DTYPE = jnp.bfloat16
# The einsum letter of the unit contracted dim `contract` may add.
_UNIT = "Z"


def cpu_shapes() -> bool:
    """Whether dots traced now take XLA:CPU's shapes: the one place that chooses, by the
    platform the program is traced for (partitioning.traced_platform)."""
    return partitioning.traced_platform() == "cpu"


def cast_params(params, dtype, shardings=None):
    """The floating leaves of `params` in `dtype`, cast once (inference and scoring read
    bfloat16 weights: half the memory traffic, and no cast at every step); `params` itself when
    they are all in `dtype` already. With `shardings`, the cast arrays are placed on them."""
    dtype = jnp.dtype(dtype)
    leaves = jax.tree_util.tree_leaves(params)
    if all(x.dtype == dtype for x in leaves if jnp.issubdtype(x.dtype, jnp.floating)):
        return params

    def cast(tree):
        floating = lambda x: jnp.issubdtype(x.dtype, jnp.floating)
        return jax.tree_util.tree_map(lambda x: x.astype(dtype) if floating(x) else x, tree)

    return jax.jit(cast, out_shardings=shardings)(params)


def on_bits(fn: Callable, *arrays: Array) -> Array:
    """fn (a gather, slice or scatter, which only moves elements) applied to bfloat16 arrays as
    their bits: XLA:CPU converts a whole bfloat16 operand of such an op to float32 and back
    around it, a copy as large as the array (a vocabulary's embedding table, a cache)."""
    if arrays[0].dtype != jnp.bfloat16:
        return fn(*arrays)
    bits = [jax.lax.bitcast_convert_type(x, jnp.uint16) for x in arrays]
    return jax.lax.bitcast_convert_type(fn(*bits), jnp.bfloat16)


def einsum(spec: str, x: Array, y: Array, dtype, out_dtype=None) -> Array:
    """`jnp.einsum(spec, x, y)` in the activation `dtype`, the result in `out_dtype` (default
    `dtype`). `spec` names every operand dim ("md,vd->mv": no ellipsis), and each dim of an
    operand is either in the output or contracted with the other operand."""
    out_dtype = jnp.dtype(out_dtype or dtype)
    if jnp.dtype(dtype) == jnp.float32:
        return jnp.einsum(spec, x, y).astype(out_dtype)
    _check(spec)
    return _mixed(spec, out_dtype, (x.dtype, y.dtype), cpu_shapes(), x, y)


def _parse(spec: str) -> tuple[str, str, str]:
    inputs, out = spec.split("->")
    x, y = inputs.split(",")
    return x, y, out


def _check(spec: str) -> None:
    """The backward pass contracts the cotangent with the other operand: every dim of an
    operand must be in one of them."""
    if "." in spec:
        raise ValueError(f"einsum {spec!r}: name every dim (no ellipsis)")
    x, y, out = _parse(spec)
    for own, other in ((x, y), (y, x)):
        if lone := set(own) - set(other) - set(out):
            raise ValueError(f"einsum {spec!r}: dims {sorted(lone)} are neither kept nor paired")


# `cpu` is a static argument, not read inside: a trace jax caches must not keep another
# platform's shapes.
@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3))
def _mixed(spec, out_dtype, dtypes, cpu, x, y):
    del dtypes
    x, y = x.astype(COMPUTE_DTYPE), y.astype(COMPUTE_DTYPE)
    return contract(spec, x, y, cpu=cpu, out_dtype=out_dtype)


def _mixed_forward(spec, out_dtype, dtypes, cpu, x, y):
    x, y = x.astype(COMPUTE_DTYPE), y.astype(COMPUTE_DTYPE)
    return contract(spec, x, y, cpu=cpu, out_dtype=out_dtype), (x, y)


def _mixed_backward(spec, out_dtype, dtypes, cpu, saved, grad):
    """Each operand's gradient is the contraction of the cotangent with the other operand."""
    del out_dtype
    x, y = saved
    sx, sy, out = _parse(spec)
    grad = grad.astype(COMPUTE_DTYPE)
    dx = contract(f"{out},{sy}->{sx}", grad, y, cpu=cpu, out_dtype=dtypes[0])
    dy = contract(f"{out},{sx}->{sy}", grad, x, cpu=cpu, out_dtype=dtypes[1])
    return dx, dy


_mixed.defvjp(_mixed_forward, _mixed_backward)


def _trailing(dims: str, contracted: set[str]) -> bool:
    return bool(contracted) and set(dims[len(dims) - len(contracted) :]) == contracted


def contract(
    spec: str, a: Array, b: Array, *, cpu: bool | None = None, out_dtype=jnp.float32
) -> Array:
    """bf16 `a` and `b` contracted as `spec` says, accumulated in float32, returned in
    `out_dtype`; with `cpu` (default: `cpu_shapes()`) in a form XLA:CPU keeps on its bf16
    kernels (see the module docstring). TPU and GPU dots return `out_dtype` themselves: their
    matrix units accumulate in float32 either way, and a float32 result the backward pass keeps
    is twice the memory (docs/memory_plan.md)."""
    if not (cpu_shapes() if cpu is None else cpu):
        return jnp.einsum(spec, a, b, preferred_element_type=out_dtype)
    return _cpu_contract(spec, a, b).astype(out_dtype)


def _cpu_contract(spec: str, a: Array, b: Array) -> Array:
    """The float32 product in XLA:CPU's shapes for bf16 kernels."""
    sa, sb, out = _parse(spec)
    contracted = (set(sa) & set(sb)) - set(out)
    if not _trailing(sa, contracted) and _trailing(sb, contracted):
        sa, sb, a, b = sb, sa, b, a
    elif not _trailing(sa, contracted):
        sa, sb, a, b = sa + _UNIT, sb + _UNIT, a[..., None], b[..., None]
    rows = [i for i, d in enumerate(sa) if d not in sb]
    if rows and all(a.shape[i] == 1 for i in rows):
        # Two rows in place of one, in the dim XLA takes for the rows; the copy is sliced off.
        a = jnp.broadcast_to(a, a.shape[: rows[-1]] + (2,) + a.shape[rows[-1] + 1 :])
        both = jnp.einsum(f"{sa},{sb}->{out}", a, b, preferred_element_type=jnp.float32)
        return jax.lax.slice_in_dim(both, 0, 1, axis=out.index(sa[rows[-1]]))
    return jnp.einsum(f"{sa},{sb}->{out}", a, b, preferred_element_type=jnp.float32)


def sum_rows(x: Array) -> Array:
    """`x` summed over its leading axis, keeping it (size 1). On XLA:CPU as a float32 product
    with a row of ones: its reduction over a leading axis ran at ~1 GB/s when the trailing dims
    are large (a batch's gradient of an attention bias), its dot at the memory's rate."""
    if not cpu_shapes():
        return jnp.sum(x, axis=0, keepdims=True)
    ones = jnp.ones((1, x.shape[0]), x.dtype)
    summed = jnp.matmul(ones, x.reshape(x.shape[0], -1), precision=jax.lax.Precision.HIGHEST)
    return summed.reshape((1,) + x.shape[1:])
