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
from t5tpu.model.model_family import network_module
from t5tpu.model.network import T5Config
from t5tpu.model.t5gemma_network import T5GemmaConfig


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


def boxed_params(config: T5Config | T5GemmaConfig):
    """Parameter shapes with their logical axes, from the network alone (no vocabulary file).
    Neither remat, dropout nor the sequence lengths change them: traced without the first two
    (remat's tracing is most of the cost) and shared by every plan of the same geometry."""
    return _traced_params(dataclasses.replace(config, remat_policy="none", dropout_rate=0.0))


def _one_layer_a_stack(config: T5Config | T5GemmaConfig):
    if isinstance(config, T5GemmaConfig):  # local and global layers have the same parameters
        encoder, decoder = (
            dataclasses.replace(s, num_layers=1, layer_types=None)
            for s in (config.encoder, config.decoder)
        )
        return dataclasses.replace(config, encoder=encoder, decoder=decoder)
    return dataclasses.replace(config, num_encoder_layers=1, num_decoder_layers=1)


@functools.lru_cache(maxsize=8)
def _traced_params(config: T5Config | T5GemmaConfig):
    """The network traced with one layer a stack, its other layers given that layer's shapes:
    every layer of a stack has the same parameters, and tracing each layer's forward pass is
    what takes the time (seconds for 24-layer stacks)."""
    module = network_module(_one_layer_a_stack(config))
    tokens = jnp.ones((1, 1), jnp.int32)
    params = jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), tokens, tokens))["params"]
    depth = {"encoder": config.num_encoder_layers, "decoder": config.num_decoder_layers}
    return {
        name: _stacked(tree, depth.get(name), config.scan_layers) for name, tree in params.items()
    }


def _stacked(stack, layers: int | None, scanned: bool):
    """`stack`'s one traced layer as `layers` of them: layers_0..layers_{n-1} unrolled, or a
    leading "layers" dim of n scanned. Anything else (the embedding) is returned as it is."""
    if layers is None:
        return stack
    if scanned:
        grow = lambda x: jax.ShapeDtypeStruct((layers, *x.shape[1:]), x.dtype)  # noqa: E731
        return stack | {"layers": jax.tree.map(grow, stack["layers"])}
    rest = {k: v for k, v in stack.items() if k != "layers_0"}
    return rest | {f"layers_{i}": stack["layers_0"] for i in range(layers)}


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
