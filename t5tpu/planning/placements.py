"""Where each parameter lives on the mesh and how many bytes it takes on one device, read off
the network's shapes and logical axes without allocating anything (memory_plan.py's exact part:
parameters, gradients, optimizer state)."""

from __future__ import annotations

import dataclasses
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from t5tpu import partitioning
from t5tpu.model.network import T5Config, Transformer


@dataclasses.dataclass(frozen=True)
class Placement:
    """One parameter: its logical axes, mesh sharding and bytes on each device."""

    name: str
    shape: tuple[int, ...]
    logical_axes: tuple
    spec: PartitionSpec
    bytes_per_device: int


def bytes_per_device(shape, dtype, spec: PartitionSpec, mesh: dict[str, int]) -> int:
    """Bytes of the largest shard of an array (shardings here always divide evenly)."""
    count = partitioning.shard_count(spec, mesh)
    return math.ceil(math.prod(shape) / count) * jnp.dtype(dtype).itemsize


def _path_name(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)


def boxed_params(config: T5Config):
    """Parameter shapes with their logical axes, from the network alone (no vocabulary file).
    Neither remat, dropout nor the sequence lengths change them: traced without the first two
    (remat's tracing is most of the cost) and shared by every plan of the same geometry."""
    return _traced_params(dataclasses.replace(config, remat_policy="none", dropout_rate=0.0))


@functools.lru_cache(maxsize=8)
def _traced_params(config: T5Config):
    module = Transformer(config)
    tokens = jnp.ones((1, 1), jnp.int32)
    return jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), tokens, tokens))["params"]


def placements(boxed, rules, mesh: dict[str, int]) -> list[Placement]:
    logical = nn.get_partition_spec(boxed)
    shapes = nn.unbox(boxed)
    specs = partitioning.param_specs(boxed, rules, mesh)
    is_spec = {"is_leaf": lambda x: isinstance(x, PartitionSpec)}
    rows = []
    for (path, leaf), axes, spec in zip(
        jax.tree_util.tree_flatten_with_path(shapes)[0],
        jax.tree_util.tree_leaves(logical, **is_spec),
        jax.tree_util.tree_leaves(specs, **is_spec),
        strict=True,
    ):
        rows.append(
            Placement(
                _path_name(path),
                tuple(leaf.shape),
                tuple(axes),
                spec,
                bytes_per_device(leaf.shape, leaf.dtype, spec, mesh),
            )
        )
    return rows


def opt_state_bytes(optimizer, boxed, rules, mesh: dict[str, int]) -> int:
    params = nn.unbox(boxed)
    abstract = jax.eval_shape(optimizer.init, params)
    specs = partitioning.opt_state_specs(
        abstract, params, partitioning.param_specs(boxed, rules, mesh)
    )
    return sum(
        bytes_per_device(leaf.shape, leaf.dtype, spec, mesh)
        for leaf, spec in zip(
            jax.tree_util.tree_leaves(abstract),
            jax.tree_util.tree_leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec)),
            strict=True,
        )
    )
