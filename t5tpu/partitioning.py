"""Device mesh ('data', 'model') and the logical axis rules that place arrays on it.

Parameters and activations carry T5X's logical axis names (batch, length, embed, mlp, heads, kv,
joined_kv, vocab, relpos_buckets, and layers: the leading axis of scanned layers' parameters and
caches); a rule list maps each name to a mesh axis or to None
(replicated). Model parallelism shards heads, mlp and vocab over 'model'; data parallelism splits
the batch over 'data'. With `parameter_partitioning='2d'` parameters are also sharded over 'data'
along embed (ZeRO-3 style), which is what lets 3B/11B fit on small slices.

The Partitioner knows its configuration (model-parallel degree, rules, topology) before it knows
any device: `t5tpu plan` computes shardings for a 128-chip slice on a laptop from the same rules
that place arrays on a real mesh, which is only built when first used.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
import functools
import math

import flax.linen as nn
import gin
import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from t5tpu import validators
from t5tpu.errors import UserError

MESH_AXES = ("data", "model")
GiB = 1024**3

# Axes no rule shards; listed so that every logical name has a rule (T5X lists them too).
# "layers" (scanned layer stacks) must stay whole: each scan step reads one layer's slice.
_UNSHARDED_AXES = ("kv", "length", "relpos_buckets", "layers")


@gin.configurable
def standard_logical_axis_rules(
    parameter_partitioning: str = "1d", activation_partitioning: str = "1d"
) -> tuple[tuple[str, str | None], ...]:
    """T5X's four variants: 1-D or 2-D partitioning of parameters and of activations.

    flax assigns rules in list order, a rule taking effect only while its mesh axis is still
    unused by the array. So the 'embed' rules come last: a kernel (embed, mlp) must give 'model'
    to mlp first. With 2-D activations, ('embed', 'model') precedes ('embed', 'data'): an
    activation (batch, length, embed) has already given 'data' to batch and takes 'model' for
    embed; a kernel (embed, mlp) has given 'model' to mlp and, with 2-D parameters, takes 'data'.
    """
    if parameter_partitioning not in ("1d", "2d") or activation_partitioning not in ("1d", "2d"):
        raise UserError("parameter_partitioning and activation_partitioning must be '1d' or '2d'")
    rules = [
        ("batch", "data"),
        ("vocab", "model"),
        ("mlp", "model"),
        ("heads", "model"),
        # T5Gemma's key/value heads (fewer than its query heads): sharded where they divide.
        ("kv_heads", "model"),
        ("joined_kv", "model"),
    ]
    rules += [(name, None) for name in _UNSHARDED_AXES]
    if activation_partitioning == "2d":
        rules.append(("embed", "model"))
    rules.append(("embed", "data" if parameter_partitioning == "2d" else None))
    return tuple(rules)


@gin.configurable
@dataclasses.dataclass(frozen=True)
class Topology:
    """What a slice is: its name, device count, hosts and memory per device (for `t5tpu plan`).

    A device is what jax.devices() lists: a TensorCore on v2/v3, a (megacore) chip on v4/v5p,
    a chip on v5e/v6e. `num_devices=None` (the cpu topology) means whatever is visible.
    `tpu_topology` is libtpu's name for the slice (generation:chip grid, e.g. 'v3:2x2' for a
    v3-8), which `t5tpu plan` compiles for without a TPU.
    """

    name: str = "cpu"
    num_devices: int | None = None
    num_hosts: int = 1
    hbm_gib_per_device: float | None = None
    tpu_topology: str | None = None

    @property
    def hbm_bytes_per_device(self) -> int | None:
        return None if self.hbm_gib_per_device is None else int(self.hbm_gib_per_device * GiB)


@dataclasses.dataclass(frozen=True)
class DataLayout:
    """Which shard of the input this host reads: every host with the same rows of the global
    batch reads the same shard (they differ only when the 'model' axis spans hosts)."""

    shard_index: int
    num_shards: int
    local_batch_size: int


def mesh_shape(num_devices: int, num_partitions: int) -> dict[str, int]:
    if num_partitions < 1 or num_devices % num_partitions:
        raise UserError(
            f"Partitioner.num_partitions={num_partitions} does not divide the {num_devices} "
            "devices; choose a divisor (1 for pure data parallelism)"
        )
    return {"data": num_devices // num_partitions, "model": num_partitions}


def check_batch_size(
    name: str, batch_size: int, data_parallelism: int, num_microbatches: int = 1
) -> None:
    """A batch (gin macro `name`) must split evenly over the 'data' axis (and microbatches)."""
    into = f"the {data_parallelism} data-parallel devices"
    if num_microbatches > 1:
        into += f" x {num_microbatches} microbatches"
    validators.multiple(data_parallelism * num_microbatches, into).check(name, batch_size)


def build_mesh(devices: list, num_partitions: int) -> Mesh:
    """A ('data', 'model') mesh; on TPUs jax's mesh_utils lays 'model' along physical neighbours."""
    shape = tuple(mesh_shape(len(devices), num_partitions).values())
    try:
        device_grid = mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=True)
    except (AssertionError, NotImplementedError, ValueError):
        device_grid = np.asarray(devices).reshape(shape)
    return Mesh(device_grid, MESH_AXES)


def spec_for_shape(
    logical_axes: tuple, shape: tuple[int, ...], rules, mesh_sizes: dict[str, int]
) -> PartitionSpec:
    """The mesh PartitionSpec of an array by the rules. A dimension that its mesh axis does not
    divide (12 heads on an 8-way 'model' axis) stays replicated: jit rejects uneven shardings."""
    spec = nn.logical_to_mesh_axes(logical_axes, rules)
    fitted = []
    for size, axes in zip(shape, spec, strict=True):
        names = (axes,) if isinstance(axes, str) else tuple(axes or ())
        ways = math.prod(mesh_sizes[name] for name in names)
        fitted.append(axes if ways == 1 or size % ways == 0 else None)
    return PartitionSpec(*fitted)


def shard_count(spec: PartitionSpec, mesh_sizes: dict[str, int]) -> int:
    """Into how many pieces `spec` cuts an array (devices holding a replica share a piece)."""
    count = 1
    for axes in spec:
        for name in (axes,) if isinstance(axes, str) else tuple(axes or ()):
            count *= mesh_sizes[name]
    return count


def param_specs(boxed_params, rules, mesh_sizes: dict[str, int]):
    """Tree of mesh PartitionSpecs for logically annotated (boxed) parameters or their shapes."""
    logical = nn.get_partition_spec(boxed_params)
    shapes = nn.unbox(boxed_params)
    return jax.tree_util.tree_map(
        lambda axes, leaf: spec_for_shape(tuple(axes), leaf.shape, rules, mesh_sizes),
        logical,
        shapes,
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )


def _factored_spec(moment_shape, param_shape, spec: PartitionSpec) -> PartitionSpec:
    """Spec of a factored moment: the parameter with one dimension reduced away, or two
    neighbouring ones (heads and head_dim of an attention kernel, training/optim.py). Where it
    is ambiguous which went (equal sizes), the dimensions that disagree stay unsharded."""
    param_shape, moment_shape = tuple(param_shape), tuple(moment_shape)
    axes = list(spec) + [None] * (len(param_shape) - len(spec))
    candidates = [
        axes[:i] + axes[end:]
        for i in range(len(param_shape))
        for end in (i + 1, i + 2)
        if end <= len(param_shape) and param_shape[:i] + param_shape[end:] == moment_shape
    ]
    if not candidates:
        return PartitionSpec()
    return PartitionSpec(
        *(a if all(c[d] == a for c in candidates) else None for d, a in enumerate(candidates[0]))
    )


def opt_state_specs(abstract_opt_state, abstract_params, specs):
    """PartitionSpecs for optimizer state, derived from the parameter each leaf belongs to:
    AdamW's moments and Adafactor's unfactored moments take the parameter's spec, Adafactor's
    factored row/column moments the spec of the dimensions they keep; counters are replicated.

    A leaf belongs to the parameter whose tree path ends its own (optax nests the parameter tree
    inside its state: (..., 'v_row', 'encoder', 'layers_0', ...))."""
    flat_params = jax.tree_util.tree_flatten_with_path(abstract_params)[0]
    flat_specs = jax.tree_util.tree_leaves(specs, is_leaf=lambda x: isinstance(x, PartitionSpec))
    by_path = {
        tuple(path): (leaf.shape, spec)
        for (path, leaf), spec in zip(flat_params, flat_specs, strict=True)
    }

    def spec_of(path, leaf):
        for start in range(len(path)):
            found = by_path.get(tuple(path[start:]))
            if found is None:
                continue
            param_shape, spec = found
            if tuple(leaf.shape) == tuple(param_shape):
                return spec
            if len(leaf.shape) < len(param_shape):
                return _factored_spec(leaf.shape, param_shape, spec)
            return PartitionSpec()
        return PartitionSpec()

    return jax.tree_util.tree_map_with_path(spec_of, abstract_opt_state)


# The platform the program being traced now is for, where the tracer knows it (Partitioner.jit).
_TRACED_PLATFORM: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "traced_platform", default=None
)


@contextlib.contextmanager
def tracing_for(platform: str):
    """Traces inside are for `platform` ('cpu', 'tpu', 'cuda', ...)."""
    token = _TRACED_PLATFORM.set(platform)
    try:
        yield
    finally:
        _TRACED_PLATFORM.reset(token)


def traced_platform() -> str:
    """The platform the program traced now runs on: the one `tracing_for` names, else jax's
    default backend (where a plain jax.jit runs)."""
    return _TRACED_PLATFORM.get() or jax.default_backend()


@gin.configurable
class Partitioner:
    """Mesh, logical axis rules and the shardings they give parameters, state and batches."""

    def __init__(
        self,
        num_partitions: int = 1,
        logical_axis_rules: tuple | list | None = None,
        topology: Topology | None = None,
        devices: list | None = None,
    ):
        if num_partitions < 1:
            raise UserError(f"Partitioner.num_partitions={num_partitions}; use 1 or more")
        self.num_partitions = num_partitions
        self.rules = tuple(
            tuple(rule) for rule in (logical_axis_rules or standard_logical_axis_rules())
        )
        self.topology = topology or Topology()
        self._devices = devices

    @functools.cached_property
    def mesh(self) -> Mesh:
        devices = list(self._devices or jax.devices())
        expected = self.topology.num_devices
        if self._devices is None and expected and expected != len(devices):
            raise UserError(
                f"the {self.topology.name} topology has {expected} devices but "
                f"{len(devices)} are visible; use the topology file of this machine "
                "(configs/topologies/)"
            )
        return build_mesh(devices, self.num_partitions)

    @property
    def mesh_sizes(self) -> dict[str, int]:
        return dict(self.mesh.shape)

    @property
    def data_parallelism(self) -> int:
        return self.mesh.shape["data"]

    def sharding(self, spec: PartitionSpec) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    def batch_sharding(self) -> NamedSharding:
        return self.sharding(PartitionSpec("data"))

    def replicated(self) -> NamedSharding:
        return self.sharding(PartitionSpec())

    def _to_shardings(self, specs):
        return jax.tree_util.tree_map(
            self.sharding, specs, is_leaf=lambda x: isinstance(x, PartitionSpec)
        )

    def param_shardings(self, boxed_params):
        """NamedShardings for a tree of logically annotated (boxed) parameters or their shapes."""
        return self._to_shardings(param_specs(boxed_params, self.rules, self.mesh_sizes))

    def opt_state_shardings(self, abstract_opt_state, boxed_params):
        """NamedShardings for optimizer state, following each leaf's parameter."""
        specs = param_specs(boxed_params, self.rules, self.mesh_sizes)
        return self._to_shardings(
            opt_state_specs(abstract_opt_state, nn.unbox(boxed_params), specs)
        )

    def activation_context(self):
        """Context in which `nn.with_logical_constraint` inside the model takes effect: flax
        applies constraints only under a mesh, and jax.set_mesh is refused inside jit, so the
        abstract mesh is used (valid while tracing). The model's dots take the shapes of the
        mesh's platform (model/precision.py): the devices compiled for, not jax's default
        backend (libtpu's compile-only TPU devices are compiled for from a CPU process)."""
        stack = contextlib.ExitStack()
        stack.enter_context(jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh))
        stack.enter_context(nn.logical_axis_rules(self.rules))
        stack.enter_context(tracing_for(self.mesh.devices.flat[0].platform))
        return stack

    def jit(self, fn, in_shardings, out_shardings=None, donate_argnums=()):
        """jax.jit of `fn` traced under the activation rules, so activations (and decoding
        caches) are constrained by them too."""

        @functools.wraps(fn)
        def constrained(*args):
            with self.activation_context():
                return fn(*args)

        kwargs = {} if out_shardings is None else {"out_shardings": out_shardings}
        return jax.jit(
            constrained, in_shardings=in_shardings, donate_argnums=donate_argnums, **kwargs
        )

    def check_batch_size(self, name: str, batch_size: int, num_microbatches: int = 1) -> None:
        check_batch_size(name, batch_size, self.data_parallelism, num_microbatches)

    def data_layout(self, global_batch_size: int) -> DataLayout:
        """This host's shard of the input for a global batch of `global_batch_size` rows."""
        self.check_batch_size("batch size", global_batch_size)
        data_size = self.data_parallelism
        rows_by_host = host_data_rows(self.batch_sharding())
        distinct = sorted(set(rows_by_host.values()))
        if len({row for rows in distinct for row in rows}) != sum(map(len, distinct)):
            raise UserError(
                "hosts share only some rows of the batch on this mesh; choose "
                "Partitioner.num_partitions that divides or is a multiple of the devices per host"
            )
        mine = rows_by_host[jax.process_index()]
        per_row = global_batch_size // data_size
        return DataLayout(distinct.index(mine), len(distinct), len(mine) * per_row)


@functools.lru_cache(maxsize=32)  # asked every step; the answer is fixed per sharding
def host_data_rows(batch_sharding: NamedSharding) -> dict[int, tuple[int, ...]]:
    """{process index: the indices along 'data' (the batch rows, in units of one data shard)
    that its devices hold}."""
    data_size = batch_sharding.mesh.shape["data"]
    rows = collections.defaultdict(set)
    for device, index in batch_sharding.devices_indices_map((data_size,)).items():
        rows[device.process_index].add(index[0].start or 0)
    return {process: tuple(sorted(r)) for process, r in rows.items()}
