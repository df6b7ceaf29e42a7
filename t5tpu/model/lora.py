"""Low-rank adapters (LoRA) on a frozen T5: the settings, the adapter of one dense layer, and the
parameter trees of an adapted model (base and adapters apart, joined, merged).

An adapted kernel W of shape in_dims + out_dims gets `lora_a` (in_dims + (rank,)) and `lora_b`
((rank,) + out_dims) beside it; the layer computes x W + (dropout(x) A) B * alpha / rank. `lora_a`
carries the kernel's logical axes for its input dims and `lora_b` those of its output dims, with
the rank axis ("lora_rank") unsharded, so each adapter is partitioned like the weight it adapts.
`lora_b` starts at zero: a fresh adapter leaves the base model's outputs unchanged.

Targets are named as Hugging Face's T5 names its modules (and PEFT's target_modules do): q, k, v, o
for every attention (self, cross and the encoder's), wi (wi_0 and wi_1 of a gated feed-forward)
and wo.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import flax.linen as nn
import gin
import jax
import jax.numpy as jnp

from t5tpu import validators
from t5tpu.errors import UserError

ADAPTER_NAMES = ("lora_a", "lora_b")
RANK_AXIS = "lora_rank"
TARGETS = ("q", "k", "v", "o", "wi", "wo")
# The parameter name of each attention target (MultiHeadAttention's dense layers).
ATTENTION_TARGETS = {"query": "q", "key": "k", "value": "v", "out": "o"}
BASE_DTYPES = ("bfloat16", "float32")
# PEFT's initialization of A (Kaiming-uniform with a = sqrt(5)): uniform in +-1/sqrt(fan_in).
_A_INIT = nn.initializers.variance_scaling(1.0 / 3.0, "fan_in", "uniform")


@dataclasses.dataclass(frozen=True)
class LoraSettings:
    """What a LoRA run adapts and how (defaults: PEFT's for T5)."""

    rank: int = 8
    alpha: float = 8.0
    dropout: float = 0.0
    targets: tuple[str, ...] = ("q", "v")
    # The frozen base weights' dtype in training: bfloat16 halves them; float32 keeps them exact.
    base_dtype: str = "bfloat16"

    def __post_init__(self):
        validators.whole(low=1).check("lora.rank", self.rank, example="8")
        validators.number(above=0).check("lora.alpha", self.alpha, example="8.0")
        validators.number(low=0, below=1).check("lora.dropout", self.dropout, example="0.0")
        if isinstance(self.targets, str) or not self.targets:
            raise UserError(f"lora.targets = {self.targets!r}: give a tuple such as ('q', 'v')")
        unknown = [t for t in self.targets if t not in TARGETS]
        if unknown:
            raise UserError(
                f"lora.targets has {', '.join(map(repr, unknown))}; choose from "
                f"{', '.join(TARGETS)}"
            )
        validators.choice(BASE_DTYPES).check("lora.base_dtype", self.base_dtype)
        object.__setattr__(self, "targets", tuple(self.targets))

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def adapts(self, target: str) -> bool:
        return target in self.targets

    def record(self) -> dict:
        """The settings as plain JSON values (saved with every checkpoint of the run)."""
        return {**dataclasses.asdict(self), "targets": list(self.targets)}

    @classmethod
    def from_record(cls, record: dict) -> LoraSettings:
        return cls(**{**record, "targets": tuple(record["targets"])})


@gin.configurable
def lora(
    rank: int = 8,
    alpha: float = 8.0,
    dropout: float = 0.0,
    targets: tuple[str, ...] = ("q", "v"),
    base_dtype: str = "bfloat16",
) -> LoraSettings:
    """`train.method = @lora()`: fine-tune low-rank adapters on a frozen base."""
    return LoraSettings(rank, float(alpha), float(dropout), tuple(targets), base_dtype)


def mlp_target(dense_name: str) -> str:
    """The target name of an MLP dense layer: wi, wi_0, wi_1 -> 'wi'; wo -> 'wo'."""
    return "wi" if dense_name.startswith("wi") else dense_name


def adapter_output(
    module: nn.Module, rows: jax.Array, *, in_shape, features, kernel_axes, settings, dtype, einsum
) -> jax.Array:
    """The adapter's [tokens, fan_out] output for `rows` ([tokens, fan_in]), made inside the
    dense `module` (so `lora_a`/`lora_b` sit beside its kernel). `einsum` is the model's
    mixed-precision matmul; the result is in float32, scaled by alpha / rank."""
    num_in = len(in_shape)
    fan_in, fan_out, rank = math.prod(in_shape), math.prod(features), settings.rank

    def init_a(key, shape, param_dtype):
        return _A_INIT(key, (fan_in, rank), param_dtype).reshape(shape)

    a = module.param(
        "lora_a",
        nn.with_logical_partitioning(init_a, tuple(kernel_axes[:num_in]) + (RANK_AXIS,)),
        tuple(in_shape) + (rank,),
        jnp.float32,
    )
    b = module.param(
        "lora_b",
        nn.with_logical_partitioning(
            nn.initializers.zeros, (RANK_AXIS,) + tuple(kernel_axes[num_in:])
        ),
        (rank,) + tuple(features),
        jnp.float32,
    )
    if settings.dropout > 0 and module.has_rng("dropout"):
        rows = nn.Dropout(settings.dropout, name="lora_dropout")(rows, deterministic=False)
    low = einsum("mk,kr->mr", rows, a.reshape((fan_in, rank)), dtype, jnp.float32)
    low = (low * settings.scale).astype(dtype)
    return einsum("mr,rn->mn", low, b.reshape((rank, fan_out)), dtype, jnp.float32)


# ---------------------------------------------------------------------------------------------
# parameter trees


def _is_adapter_leaf(key) -> bool:
    return key in ADAPTER_NAMES


def split(params) -> tuple[dict, dict]:
    """(base, adapters): the adapted model's parameters apart, each a nest of dicts."""
    base, adapters = {}, {}
    for key, value in params.items():
        if isinstance(value, dict):
            b, a = split(value)
            if b:
                base[key] = b
            if a:
                adapters[key] = a
        elif _is_adapter_leaf(key):
            adapters[key] = value
        else:
            base[key] = value
    return base, adapters


def join(base, adapters) -> dict:
    """The adapted model's parameters: `base` with `adapters` beside their kernels."""
    joined = dict(base)
    for key, value in adapters.items():
        joined[key] = join(joined.get(key, {}), value) if isinstance(value, dict) else value
    return joined


def merge(base, adapters, settings: LoraSettings) -> dict:
    """Plain model parameters: every adapted kernel W replaced by W + A B * alpha / rank, in
    float32 (base and adapters in the unrolled or the stacked layout alike)."""
    merged = dict(base)
    for key, value in adapters.items():
        if isinstance(value, dict) and "lora_a" not in value:
            merged[key] = merge(base[key], value, settings)
        elif isinstance(value, dict):
            merged[key] = dict(
                base[key], kernel=merged_kernel(base[key]["kernel"], value, settings)
            )
    return merged


def merged_kernel(kernel, adapter: dict, settings: LoraSettings):
    """W + A B * scale for one kernel; a leading layer axis (a scanned stack) is kept."""
    a, b = adapter["lora_a"], adapter["lora_b"]
    stacked = a.ndim + b.ndim - 2 == kernel.ndim + 1
    lead = 1 if stacked else 0
    num_in = a.ndim - 1 - lead
    fan_in = math.prod(kernel.shape[lead : lead + num_in])
    flat_a = a.reshape(a.shape[:lead] + (fan_in, settings.rank)).astype(jnp.float32)
    flat_b = b.reshape(b.shape[:lead] + (settings.rank, -1)).astype(jnp.float32)
    delta = jnp.einsum("...kr,...rn->...kn", flat_a, flat_b) * settings.scale
    return kernel.astype(jnp.float32) + delta.reshape(kernel.shape)


def cast(tree, dtype: str):
    """`tree`'s floating leaves in `dtype` (the frozen base in its training dtype)."""
    dtype = jnp.dtype(dtype)
    return jax.tree_util.tree_map(
        lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree
    )


def base_as_trained(params, dtype: str):
    """The base as a LoRA run trained its adapters on it: every floating leaf but the adapters'
    rounded to `dtype` (the run's lora.base_dtype), each kept in its own dtype; `lora_a` and
    `lora_b` as they are, so a joined tree (base and adapters) works as well as a base alone.

    Training, loading (adapters merged onto it) and serving (inside its jitted programs) all
    call this, so the three see the same bits. It rounds with lax.reduce_precision rather than
    a cast down and back up, which XLA may drop inside a jitted program as a no-op (excess
    precision allowed); a float32 base in float32 runs is returned unchanged."""
    info = jnp.finfo(dtype)

    def rounded(path, x):
        keep = not jnp.issubdtype(x.dtype, jnp.floating) or jnp.finfo(x.dtype).nmant <= info.nmant
        if keep or _is_adapter_leaf(getattr(path[-1], "key", None)):
            return x
        return jax.lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)

    return jax.tree_util.tree_map_with_path(rounded, params)


def served_tree(params, rounded) -> dict:
    """An adapted tree as the engine of several adapters holds it: the parameters, and a flag
    (a replicated bool array, so one program runs every adapter) for `served_view` to round
    the base by."""
    return {"params": params, "rounded": rounded}


def served_view(base_dtype: str | None):
    """The engine's param_view of `served_tree`s: the base as the adapter's run trained on it
    (base_as_trained in `base_dtype`) where the flag says so, as it is where not (the base
    alone); with no `base_dtype`, every tree as it is. Here, not in serve/, so the engine's
    programs call down into model/ and never back up."""
    if base_dtype is None:
        return _params_of
    return functools.partial(_rounded_where_flagged, base_dtype=base_dtype)


def _params_of(tree):
    return tree["params"]


def _rounded_where_flagged(tree, *, base_dtype: str):
    trained = base_as_trained(tree["params"], base_dtype)
    return jax.tree_util.tree_map(
        lambda low, x: jnp.where(tree["rounded"], low, x), trained, tree["params"]
    )


def _target(path: tuple[str, ...]) -> tuple[str, int] | None:
    """(target name, number of input dims) of the dense layer at `path` (the keys down to its
    dict), None for one no target names."""
    if len(path) < 2:
        return None
    parent, name = path[-2], path[-1]
    if name in ATTENTION_TARGETS and "attention" in parent:
        return ATTENTION_TARGETS[name], 2 if name == "out" else 1
    if parent == "mlp" and (name.startswith("wi") or name == "wo"):
        return mlp_target(name), 1
    return None


def _placed(sharding, spec: tuple):
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec))
    return sharding  # a single device's, or none


def _adapter_of(kernel, sharding, num_in: int, lead: int, rank: int) -> dict:
    spec = tuple(getattr(sharding, "spec", ()))
    spec = spec + (None,) * (kernel.ndim - len(spec))
    split_at = lead + num_in
    shapes = {
        "lora_a": (kernel.shape[:split_at] + (rank,), spec[:split_at] + (None,)),
        "lora_b": (
            kernel.shape[:lead] + (rank,) + kernel.shape[split_at:],
            spec[:lead] + (None,) + spec[split_at:],
        ),
    }
    return {
        name: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=_placed(sharding, axes))
        for name, (shape, axes) in shapes.items()
    }


def adapter_shapes(abstract, shardings, settings: LoraSettings, path: tuple[str, ...] = ()):
    """The adapters `settings` add to plain parameters `abstract` (shapes, unrolled or stacked),
    as float32 ShapeDtypeStructs placed like their kernels (`shardings`: a tree like
    `abstract`, or None), so they can be read without building the adapted model."""
    found = {}
    for key, value in abstract.items():
        if not isinstance(value, dict):
            continue
        here = path + (key,)
        target = _target(here)
        if target and "kernel" in value and settings.adapts(target[0]):
            lead = 1 if "layers" in path else 0
            sharding = None if shardings is None else shardings[key]["kernel"]
            found[key] = _adapter_of(value["kernel"], sharding, target[1], lead, settings.rank)
        else:
            inner = adapter_shapes(
                value, None if shardings is None else shardings[key], settings, here
            )
            if inner:
                found[key] = inner
    return found
