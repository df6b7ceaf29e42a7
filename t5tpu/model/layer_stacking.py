"""The two layouts of a layer stack's parameters: unrolled (layers_N) and stacked ("layers").

With T5Config.scan_layers the network holds each stack's layers as one subtree "layers" whose
leaves carry a leading layer axis, and so do the optimizer's moments, which mirror the
parameters. Everything outside the train state speaks layers_N: checkpoints on disk and the
importers and exporters. `stack_layers` and `unstack_layers` convert at those boundaries; both
leave a tree in the other layout unchanged, and look into dicts only (what flax and optax nest
parameter trees in), so they apply to parameters, optimizer states and whole train states.

Optax keeps a placeholder of shape (1,) for a moment a parameter does not use (Adafactor's
row/column moments of an unfactored parameter, its full moment of a factored one), in a stack
as in one layer: a stacked leaf has two or more dimensions, and a (1,) leaf in a stack is such
a placeholder, the same for every layer.
"""

from __future__ import annotations

import dataclasses
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

LAYERS = "layers"
_UNROLLED = re.compile(rf"{LAYERS}_(\d+)")


def _is_dict(x) -> bool:
    return isinstance(x, dict)


def _rebuild(tree, on_dict):
    """`tree` with every outermost dict d (the tree itself, or one inside tuples) replaced by
    on_dict(d)."""
    return jax.tree_util.tree_map(
        lambda x: on_dict(x) if _is_dict(x) else x, tree, is_leaf=_is_dict
    )


def _map_leaves(fn, tree):
    """fn applied to every non-dict value of a nest of dicts."""
    if _is_dict(tree):
        return {key: _map_leaves(fn, value) for key, value in tree.items()}
    return fn(tree)


def _leaves(tree) -> list:
    if _is_dict(tree):
        return [leaf for value in tree.values() for leaf in _leaves(value)]
    return [tree]


def _shape(leaf) -> tuple[int, ...]:
    return tuple(nn.unbox(leaf).shape)


def _layer_sharding(sharding):
    if not isinstance(sharding, NamedSharding):
        return sharding
    spec = tuple(sharding.spec)
    if spec and spec[0] is not None:
        raise ValueError(
            f"the stacked layer axis is sharded ({sharding.spec}); the logical axis rules must "
            f"map {LAYERS!r} to None"
        )
    return NamedSharding(sharding.mesh, PartitionSpec(*spec[1:]))


def _is_stacked_leaf(leaf) -> bool:
    return len(_shape(leaf)) >= 2  # not an optax placeholder (see the module docstring)


def layer_slice(leaf, index: int):
    """Layer `index` of a leaf of a stack: an array, a ShapeDtypeStruct (its sharding loses the
    layer axis too) or a logically partitioned box (its names lose "layers"); a placeholder is
    every layer's own."""
    if not _is_stacked_leaf(leaf):
        return leaf
    if isinstance(leaf, nn.LogicallyPartitioned):
        return dataclasses.replace(
            leaf, value=layer_slice(leaf.value, index), names=tuple(leaf.names[1:])
        )
    if isinstance(leaf, jax.ShapeDtypeStruct):
        sharding = _layer_sharding(leaf.sharding) if leaf.sharding is not None else None
        return jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype, sharding=sharding)
    return leaf[index]


def _stack_leaves(*leaves):
    """Leaves of the same role in every layer, stacked along a new leading axis (numpy stays
    numpy: importers hand over host arrays); placeholders are kept once."""
    if all(_shape(leaf) == (1,) for leaf in leaves):
        return leaves[0]
    if all(isinstance(leaf, np.ndarray) for leaf in leaves):
        return np.stack(leaves)
    return jnp.stack(leaves)


def _stack_depths(tree) -> dict:
    """{key of the dict holding a "layers" subtree (encoder, decoder): its number of layers},
    read off its stacked leaves, wherever in `tree` it has some: an optimizer state's moments
    of a stack may all be placeholders, and take the depth of the parameters they mirror."""
    depths = {}

    def visit(d: dict, holder=None) -> dict:
        for key, value in d.items():
            if key == LAYERS and _is_dict(value):
                stacked = [_shape(leaf)[0] for leaf in _leaves(value) if _is_stacked_leaf(leaf)]
                if stacked and depths.setdefault(holder, stacked[0]) != stacked[0]:
                    raise ValueError(
                        f"stacks under {holder!r} of {depths[holder]} and {stacked[0]} layers"
                    )
            else:
                _rebuild(value, lambda inner, key=key: visit(inner, key))
        return d

    _rebuild(tree, visit)
    return depths


def _unstack(tree, depths: dict, holder=None):
    if not _is_dict(tree):
        return _rebuild(tree, lambda d: _unstack(d, depths, holder))
    out = {}
    for key, value in tree.items():
        if key == LAYERS and _is_dict(value):
            if holder not in depths:
                raise ValueError(f"the depth of the stack under {holder!r} is unknown")
            for i in range(depths[holder]):
                out[f"{LAYERS}_{i}"] = _map_leaves(lambda leaf, i=i: layer_slice(leaf, i), value)
        else:
            out[key] = _unstack(value, depths, key)
    return out


def stack_layers(tree):
    """Every dict's layers_0..layers_{n-1} replaced by one "layers" subtree whose leaves are
    the layers' leaves stacked along a new leading axis."""
    if not _is_dict(tree):
        return _rebuild(tree, stack_layers)
    indices = sorted(int(m.group(1)) for key in tree if (m := _UNROLLED.fullmatch(key)))
    if indices and indices != list(range(len(indices))):
        raise ValueError(f"layers {indices} are not numbered 0..{len(indices) - 1}")
    out = {key: stack_layers(value) for key, value in tree.items()}
    if indices:
        per_layer = [out.pop(f"{LAYERS}_{i}") for i in indices]
        if LAYERS in out:
            raise ValueError(f"a tree holds both {LAYERS!r} and {LAYERS}_N")
        out[LAYERS] = jax.tree_util.tree_map(_stack_leaves, *per_layer)
    return out


def unstack_layers(tree):
    """The inverse of `stack_layers`: each "layers" subtree split into layers_0..layers_{n-1}.
    Takes arrays, ShapeDtypeStructs (with shardings) and logically partitioned boxes. Give an
    optimizer state together with its parameters, `(params, opt_state)`: a stack's depth is
    read off its parameters when all its moments are placeholders."""
    return _unstack(tree, _stack_depths(tree))


def is_stacked(tree) -> bool:
    """Whether any dict in `tree` holds a stacked "layers" subtree."""

    def holds_layers(d: dict) -> bool:
        return LAYERS in d or any(holds_layers(v) for v in d.values() if _is_dict(v))

    outermost = jax.tree_util.tree_leaves(tree, is_leaf=_is_dict)
    return any(_is_dict(d) and holds_layers(d) for d in outermost)


def unrolled_targets(abstract, shardings=None):
    """(shapes, shardings) of the layers_N layout for a possibly stacked tree of shapes and
    its shardings: what to read a checkpoint into before `stack_onto`."""
    if shardings is None:
        return unstack_layers(abstract), None
    placed = jax.tree_util.tree_map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
    )
    unrolled = unstack_layers(placed)
    return unrolled, jax.tree_util.tree_map(lambda a: a.sharding, unrolled)


def stack_onto(unrolled, abstract, shardings=None):
    """`unrolled` (layers_N) in the layout of `abstract`: stacked, and placed on `shardings`
    when given, if `abstract` is stacked; else unchanged."""
    if not is_stacked(abstract):
        return unrolled
    got = jax.eval_shape(stack_layers, unrolled)
    if jax.tree.map(_shape, got) != jax.tree.map(_shape, abstract):
        raise ValueError("stacked layers do not have the shapes of the model's")
    if shardings is None:
        return stack_layers(unrolled)
    return jax.jit(stack_layers, out_shardings=shardings)(unrolled)
