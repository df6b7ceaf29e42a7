"""Per-device memory of a training step, computed without allocating anything: `t5tpu plan`.

Parameters, optimizer state and gradients are counted exactly from their shapes and the
shardings the logical axis rules give them on the topology's mesh. Activations are estimated
from the tensors the backward pass keeps, layer by layer, at the configured batch, lengths,
remat policy and microbatches, with coefficients read off XLA's buffer assignment of the real
train step; scanned layers without remat keep what jax saves, which the plan reads off jax's
own trace of the model. Three things depend on the compiler that builds the step, and the
plan follows the one the topology implies (XLA's CPU compiler for the 'cpu' topology, TPU's
for the others): which tensors a layer keeps, whether the optimizer update materializes
parameter-sized temporaries, and whether remat is honoured. tests/test_plan.py checks the
plan against XLA's compiled memory analysis on every run; docs/memory_plan.md says how close
it is, for both compilers.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from t5tpu import partitioning
from t5tpu.model.network import T5Config, Transformer
from t5tpu.planning import layer_geometry
from t5tpu.planning.layer_geometry import StackGeometry
from t5tpu.planning.placements import Placement, boxed_params, opt_state_bytes, placements

GiB = partitioning.GiB

CPU, TPU = "cpu", "tpu"


def compiler_for(topology: partitioning.Topology) -> str:
    """The XLA compiler that builds the step on this topology: CPU for 'cpu', else TPU's."""
    return CPU if topology.name == "cpu" else TPU


@dataclasses.dataclass(frozen=True)
class Workload:
    """What a training step processes: the global batch and lengths, split into microbatches."""

    batch_size: int
    input_length: int
    target_length: int
    num_microbatches: int = 1


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    topology: partitioning.Topology
    mesh: dict[str, int]
    workload: Workload
    config: T5Config
    placements: list[Placement]
    params: int
    opt_state: int
    gradients: int
    activations: int
    batch: int
    # Gradients the backward pass produces first (the output layer's and the embedding's),
    # already live while the activations are largest on CPU. TPU's compiler computes them
    # last, from the logits' gradient it keeps anyway (its buffer assignment; 0 there).
    first_gradients: int = 0
    compiler: str = TPU
    # The backward pass runs through the decoder first: when it is done, the decoder's
    # gradients exist and the encoder's activations are still kept.
    encoder_activations: int = 0
    decoder_gradients: int = 0
    # Scanned layers keep a copy of their stacked weights at the activation dtype until the
    # backward loop is done, live at both backward-pass peaks: in bfloat16 TPU's compiler
    # casts them once, before the forward loop (the cast is loop-invariant); in float32 the
    # forward loop stacks each layer's weights again as a residual for the backward one.
    weight_copy: int = 0

    @property
    def update_temporaries(self) -> int:
        """Parameter-sized float32 buffers the update needs besides the gradients. XLA's CPU
        compiler materializes two (the normalized gradients and the optimizer's updates, both
        live while the new parameters are written); TPU's fuses each parameter's update into
        one loop that writes the donated parameter in place, and keeps none (both read off
        the compilers' buffer assignments of the step, docs/memory_plan.md)."""
        return 2 * self.gradients if self.compiler == CPU else 0

    @property
    def phases(self) -> dict[str, int]:
        """Per-device bytes at the three candidate peaks of the step: the start of the
        backward pass (state, kept activations, the first gradients or, with microbatches,
        the gradient accumulator), the end of the decoder's backward pass (the encoder's
        activations, the first and the decoder's gradients) and the optimizer update (state,
        gradients and the update's temporaries)."""
        state = self.params + self.opt_state + self.batch
        backward = state + self.weight_copy
        accumulator = self.gradients if self.workload.num_microbatches > 1 else 0
        decoder_done = self.first_gradients + self.decoder_gradients
        return {
            "start of the backward pass": backward
            + self.activations
            + max(accumulator, self.first_gradients),
            "end of the decoder's backward pass": backward
            + self.encoder_activations
            + max(accumulator, decoder_done),
            "optimizer update": state + self.gradients + self.update_temporaries,
        }

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phases.get)

    @property
    def peak(self) -> int:
        return self.phases[self.peak_phase]

    @property
    def hbm(self) -> int | None:
        return self.topology.hbm_bytes_per_device

    @property
    def parameters_over_data(self) -> bool:
        """Whether parameters are sharded over 'data' too (2-D parameter partitioning), so
        each layer gathers its weights over 'data' and reduce-scatters their gradients."""
        return self.mesh["data"] > 1 and any(
            "data" in jax.tree_util.tree_leaves(tuple(p.spec)) for p in self.placements
        )

    @property
    def fits(self) -> bool | None:
        return None if self.hbm is None else self.peak <= self.hbm


class _Activations:
    """Bytes per device of activation tensors named by logical axes, sharded by the rules."""

    def __init__(self, config: T5Config, rules, mesh: dict[str, int], batch: int):
        self.config, self.rules, self.mesh, self.batch = config, rules, mesh, batch
        self.itemsize = config.activation_dtype.itemsize
        self.geometry = layer_geometry.geometry_of(config)

    def __call__(self, axes: tuple[str, ...], shape: tuple[int, ...], itemsize=None) -> int:
        return math.prod(self.local_shape(axes, shape)) * (itemsize or self.itemsize)

    def local_shape(self, axes: tuple[str, ...], shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of one device's shard (the rules only shard dimensions they divide)."""
        spec = partitioning.spec_for_shape(axes, shape, self.rules, self.mesh)
        return tuple(
            size // partitioning.shard_count(PartitionSpec(axis), self.mesh)
            for size, axis in zip(shape, spec, strict=True)
        )

    def token(self, length: int, axis: str, size: int) -> float:
        return self(("batch", "length", axis), (self.batch, length, size))

    def heads(self, stack: StackGeometry, length: int, kv: bool = False) -> float:
        """Query heads' projections (or, `kv`, the key or value heads')."""
        heads, axis = (stack.num_kv_heads, stack.kv_axis) if kv else (stack.num_heads, "heads")
        return self(("batch", "length", axis, "kv"), (self.batch, length, heads, stack.head_dim))

    def scores(self, stack: StackGeometry, q_length: int, k_length: int, itemsize=None) -> float:
        """One score per query head and key: [batch, kv heads, query heads a group x queries,
        keys] as the grouped attention lays them out ([batch, heads, q, k] without groups)."""
        group = stack.num_heads // stack.num_kv_heads
        shape = (self.batch, stack.num_kv_heads, group * q_length, k_length)
        return self(("batch", stack.kv_axis, "length", None), shape, itemsize)


# The size from which XLA's CPU compiler prefers YNNPACK for an op (kMinElements in XLA's
# backends/cpu/ynn_support.cc). For an RMSNorm's backward pass the size that counts is that of
# its sum over the embedding, one element per token: bracketed on 8x1 meshes, 3,968 tokens a
# device stay with XLA's own fusions, 4,096 go to YNNPACK.
_CPU_YNN_MIN_ELEMENTS = 4096


def _ynn_norm_copies(act: _Activations, length: int, compiler: str) -> int:
    """Embed-sized tensors an RMSNorm keeps on CPU beyond its residual sum and two products:
    once a device's tokens (the elements of the norm's sum over the embedding) reach
    YNNPACK's minimum, XLA's CPU compiler hands the norm's backward pass to YNNPACK and keeps
    that fusion's operands, the norm's scale broadcast to the activation's shape and a
    second copy of the normalized product."""
    tokens = act(("batch", "length"), (act.batch, length), 1)
    return 2 if compiler == CPU and tokens >= _CPU_YNN_MIN_ELEMENTS else 0


def _layer_kept(
    act: _Activations,
    stack: StackGeometry,
    length: int,
    cross_length: int | None,
    compiler: str,
    recomputed=False,
) -> float:
    """Bytes one layer keeps for its backward pass, counted from the compilers' buffer
    assignments of the train step (docs/memory_plan.md). Per attention both compilers keep the
    query, key, value and output projections. XLA's CPU compiler also keeps, per RMSNorm, the
    residual sum and the norm's two products (and `_ynn_norm_copies`); per attention two
    float32 score tensors (the softmax and its exponentials); per feed-forward each input
    projection, its activation and the gating products. TPU's fuses the norms and the
    feed-forward's activation and gating into the matmuls that read them and recomputes them
    in the backward pass: it keeps the residual sums, the self-attention's normalized input
    (read by three projections), the feed-forward's input projections and one score tensor
    (the softmax; both while remat recomputes the layer). T5Gemma's layers: on CPU a norm
    after each block keeps its input (the block's output projection) and one product more,
    and soft-capping keeps each score tensor's tanh; TPU's keeps two tensors a block and one
    more, two float32 score tensors (the logits and the softmax's shifted logits) and the
    feed-forward's input projections in float32 (read off its tiny model's assignment)."""
    g = act.geometry
    blocks = 3 if cross_length else 2
    norms = blocks * (2 if g.sandwich_norms else 1)
    if compiler == CPU:
        embed, mlp, scores = 3 * blocks, 3 * g.mlp_inputs - 1, 2 + g.softcapped_scores
        embed += 2 * blocks if g.sandwich_norms else 0
    elif g.sandwich_norms:  # T5Gemma on TPU: its tiny model's buffer assignment (v5e)
        embed, mlp, scores = 2 * blocks + 1, g.mlp_inputs - 1, 2
    else:
        embed, mlp, scores = norms + 1, g.mlp_inputs, 2 if recomputed else 1
    embed += norms * _ynn_norm_copies(act, length, compiler)
    kept = embed * act.token(length, "embed", stack.emb_dim)
    if compiler == TPU and g.sandwich_norms:
        # the feed-forward's input projections in float32 (their matmuls' output dtype), and
        # one of them rounded to the activation dtype (`mlp` above)
        kept += g.mlp_inputs * act(
            ("batch", "length", "mlp"), (act.batch, length, stack.mlp_dim), 4
        )
    kept += 2 * act.heads(stack, length) + 2 * act.heads(stack, length, kv=True)
    kept += scores * act.scores(stack, length, length, 4)
    if cross_length:
        kept += 2 * act.heads(stack, length) + 2 * act.heads(stack, cross_length, kv=True)
        kept += scores * act.scores(stack, length, cross_length, 4)
    kept += mlp * act.token(length, "mlp", stack.mlp_dim)
    return kept


def _layer_dots(
    act: _Activations, stack: StackGeometry, length: int, cross_length: int | None = None
) -> float:
    """Bytes remat 'dots' keeps of one layer: the outputs of its projections (matmuls without
    batch dimensions): query/key/value and output projections, the feed-forward input
    projections and its output projection."""
    kept = act.heads(stack, length) + 2 * act.heads(stack, length, kv=True)
    kept += 2 * act.token(length, "embed", stack.emb_dim)
    if cross_length:
        kept += act.heads(stack, length) + 2 * act.heads(stack, cross_length, kv=True)
        kept += act.token(length, "embed", stack.emb_dim)
    kept += act.geometry.mlp_inputs * act.token(length, "mlp", stack.mlp_dim)
    return kept


def _stack_kept(
    act: _Activations, stack: StackGeometry, length: int, logits: bool, compiler: str
) -> float:
    """What a stack keeps outside its layers: its embedding lookups and final norm, the
    one-hot relative position buckets (float32, not batched) and, for the decoder, the
    float32 logits with the gradient of the cross-entropy (and soft-capping's tanh; on TPU
    T5Gemma keeps its final norm's two tensors and one logits tensor). On CPU
    T5Gemma's encoder also holds two constants broadcast to its scores' shape and two to its
    tokens' (read by its backward pass, materialized during the forward one)."""
    g = act.geometry
    gemma_tpu = g.gemma and compiler == TPU  # its final norm's two tensors, one logits tensor
    embed = (2 if gemma_tpu else 4) + _ynn_norm_copies(act, length, compiler)
    kept = embed * act.token(length, "embed", stack.emb_dim)
    kept += length * length * g.position_buckets * 4
    if logits:
        vocab = act(("batch", "length", "vocab"), (act.batch, length, g.vocab_size), 4)
        kept += (1 if gemma_tpu else 2 + g.softcapped_logits) * vocab
    elif g.gemma and compiler == CPU:
        kept += 2 * act.scores(stack, length, length, 4) + 2 * act.token(
            length, "embed", stack.emb_dim
        )
    return kept


@functools.lru_cache(maxsize=32)
def _residual_bytes(config: T5Config, batch: int, input_length: int, target_length: int) -> int:
    """Bytes of everything jax saves for the backward pass of this model (abstract tracing:
    nothing is computed or allocated)."""
    module = Transformer(config)
    encoder = jax.ShapeDtypeStruct((batch, input_length), jnp.int32)
    decoder = jax.ShapeDtypeStruct((batch, target_length), jnp.int32)
    rngs = {"dropout": jax.random.PRNGKey(0)}

    def residuals(enc, dec):
        def summed_logits(params):
            return module.apply(params, enc, dec, deterministic=False, rngs=rngs).sum()

        params = module.init(jax.random.PRNGKey(0), enc, dec)
        return jax.vjp(summed_logits, params)[1]  # the backward function: leaves are residuals

    saved = jax.eval_shape(residuals, encoder, decoder)
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(saved))


def _scanned_layer_saved(act: _Activations, input_length: int, target_length: int):
    """Bytes one scanned encoder layer and one decoder layer save per device for the backward
    pass without remat. jax decides what a scanned layer saves, not XLA: every layer's
    residuals leave the forward loop stacked (float32 norm inputs, dropout masks, projections,
    scores), where TPU's compiler fuses and recomputes most of them for unrolled layers. Read
    off jax's own trace of the model as one device runs it (its shard of the batch, heads and
    feed-forward; two layers a stack against one), less the weights as the layers used them:
    `MemoryPlan.weight_copy` counts those."""
    c = act.config
    batch, _, emb_dim = act.local_shape(("batch", "length", "embed"), (act.batch, 1, c.emb_dim))
    heads = act.local_shape(("batch", "length", "heads", "kv"), (act.batch, 1, c.num_heads, 1))
    _, _, mlp_dim = act.local_shape(("batch", "length", "mlp"), (act.batch, 1, c.mlp_dim))
    local = dataclasses.replace(
        c,
        emb_dim=emb_dim,
        num_heads=heads[2],
        mlp_dim=mlp_dim,
        vocab_size=8,  # the layers do not see it
        num_encoder_layers=1,
        num_decoder_layers=1,
    )
    lengths = (batch, input_length, target_length)
    one = _residual_bytes(local, *lengths)
    per_layer = []
    for stack in ("num_encoder_layers", "num_decoder_layers"):
        two = dataclasses.replace(local, **{stack: 2})
        weights = (_layer_param_count(two) - _layer_param_count(local)) * act.itemsize
        per_layer.append(_residual_bytes(two, *lengths) - one - weights)
    return tuple(per_layer)


def _layer_param_count(config: T5Config) -> int:
    """Parameters of the whole model; two depths apart, they give one layer's."""
    return sum(math.prod(x.shape) for x in jax.tree_util.tree_leaves(boxed_params(config)))


def _stack_layers_kept(
    act: _Activations, stack: StackGeometry, length: int, cross_length, compiler
) -> float:
    """What a stack's layers keep (scanned without remat: `_scanned_layer_saved`): everything
    without remat; with remat each layer's input (and with 'dots' its projections; the caller
    adds the one layer recomputed at a time)."""
    num_layers = stack.num_layers
    if act.config.remat_policy == "none":
        return num_layers * _layer_kept(act, stack, length, cross_length, compiler)
    kept = num_layers * act.token(length, "embed", stack.emb_dim)
    if act.config.remat_policy == "dots":
        kept += num_layers * _layer_dots(act, stack, length, cross_length)
    return kept


def activation_bytes(
    config: T5Config, rules, mesh: dict[str, int], work: Workload, compiler: str = TPU
) -> tuple[int, int]:
    """Bytes per device of the activations a (micro)batch keeps for its backward pass: all of
    them (where the backward pass starts) and the encoder's (where the decoder's backward
    pass ends)."""
    if compiler == CPU and not config.scan_layers:
        # XLA's CPU scheduler runs every rematerialized unrolled layer's recomputation during
        # the forward pass (its inputs are ready there), so all recomputed layers are live
        # when the backward pass starts and the peak is that of no remat. TPU's recomputes
        # each layer just before its backward pass, and so does CPU's inside a scan's loop.
        config = dataclasses.replace(config, remat_policy="none")
    micro = work.batch_size // work.num_microbatches
    act = _Activations(config, rules, mesh, micro)
    g = act.geometry
    L, T = work.input_length, work.target_length
    if config.scan_layers and config.remat_policy == "none":
        encoder_layer, decoder_layer = _scanned_layer_saved(act, L, T)
        encoder = config.num_encoder_layers * encoder_layer
        decoder = config.num_decoder_layers * decoder_layer
    else:
        encoder = _stack_layers_kept(act, g.encoder, L, None, compiler)
        decoder = _stack_layers_kept(act, g.decoder, T, L, compiler)
    encoder += _stack_kept(act, g.encoder, L, logits=False, compiler=compiler)
    decoder += _stack_kept(act, g.decoder, T, logits=True, compiler=compiler)
    if config.remat_policy != "none":
        # One layer at a time is recomputed in full during the backward pass; counted with the
        # encoder's activations, as the encoder's last layer is next when the decoder is done.
        encoder += max(
            _layer_kept(act, g.encoder, L, None, compiler, recomputed=True),
            _layer_kept(act, g.decoder, T, L, compiler, recomputed=True),
        )
    return int(encoder + decoder), int(encoder)


def plan_training(
    config: T5Config,
    optimizer,
    partitioner: partitioning.Partitioner,
    work: Workload,
    num_devices: int,
) -> MemoryPlan:
    """The per-device memory plan of `t5tpu train` with this model, optimizer and mesh, as the
    compiler of the partitioner's topology builds the step."""
    compiler = compiler_for(partitioner.topology)
    mesh = partitioning.mesh_shape(num_devices, partitioner.num_partitions)
    boxed = boxed_params(config)
    rows = placements(boxed, partitioner.rules, mesh)
    params = sum(p.bytes_per_device for p in rows)
    output_layers = layer_geometry.geometry_of(config).output_layers
    first_gradients = 0
    if compiler == CPU:
        first_gradients = sum(p.bytes_per_device for p in rows if p.name in output_layers)
    decoder_gradients = sum(
        p.bytes_per_device
        for p in rows
        if p.name.startswith("decoder/") and p.name not in output_layers
    )
    activations, encoder_activations = activation_bytes(
        config, partitioner.rules, mesh, work, compiler
    )
    weight_copy = 0
    if config.scan_layers:
        stacked = sum(p.bytes_per_device for p in rows if "/layers/" in p.name)
        weight_copy = stacked * config.activation_dtype.itemsize // 4
    # The batch: int32 tokens of the encoder and the decoder (inputs, targets, loss weights).
    per_device_batch = work.batch_size / mesh["data"]
    batch = int(per_device_batch * (work.input_length + 3 * work.target_length) * 4)
    return MemoryPlan(
        topology=partitioner.topology,
        mesh=mesh,
        workload=work,
        config=config,
        placements=rows,
        params=params,
        opt_state=opt_state_bytes(optimizer, boxed, partitioner.rules, mesh),
        gradients=params,
        first_gradients=first_gradients,
        activations=activations,
        encoder_activations=encoder_activations,
        decoder_gradients=decoder_gradients,
        weight_copy=weight_copy,
        batch=batch,
        compiler=compiler,
    )
