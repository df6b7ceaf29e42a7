"""`t5tpu plan`: will this training run fit the slice? Answered before paying for the TPU.

Reads the same gin files as `t5tpu train` (model, topology, run settings), allocates nothing,
and prints per-device bytes of parameters, optimizer state, gradients and activations, the
sharding of every parameter, whether the peak fits the chip's HBM and, when it does not, the
knobs that would make it fit, lowest resulting peak first. Everything it needs comes from the train
runner's bindings (`train.batch_size`, ...); `plan.*` bindings override them.

The peak is an estimate (docs/memory_plan.md says how close it comes); `plan.compile = True`
also compiles the real train step for the slice, with libtpu's compile-only TPU devices and no
TPU, and judges the fit by XLA's own memory analysis.
"""

from __future__ import annotations

import contextlib
import math
import re
import time

import gin
import jax

from t5tpu import partitioning
from t5tpu.config import gin_setup
from t5tpu.data import pipeline
from t5tpu.errors import UserError
from t5tpu.model.network import T5Config
from t5tpu.model.t5gemma_network import T5GemmaConfig
from t5tpu.partitioning import GiB, Partitioner
from t5tpu.planning import compiled_memory, knobs, lora_plan, memory_plan, placements, roofline
from t5tpu.runners import lora_run


def _train_binding(name: str):
    """`train.<name>` as the parsed gin files bind it, or None."""
    value = gin_setup.bound_value(f"train.{name}")
    if value is gin.REQUIRED:
        raise UserError(
            f"{name.upper()} must be set for `t5tpu plan`; pass --gin.{name.upper()}=..."
        )
    return value


def _setting(name: str, given, default=None):
    value = given if given is not None else _train_binding(name)
    return default if value is None else value


def _unit(plan: memory_plan.MemoryPlan) -> tuple[str, int]:
    """GiB for real models, MiB for the small CPU ones."""
    return ("GiB", GiB) if plan.peak >= GiB else ("MiB", 2**20)


def _collapsed_placements(
    plan: memory_plan.MemoryPlan,
) -> list[tuple[str, int, placements.Placement]]:
    """Placements with layers_N folded into one row per parameter role: (name, count, row)."""
    rows: dict[str, list] = {}
    for p in plan.placements:
        key = re.sub(r"layers_\d+", "layers_*", p.name)
        rows.setdefault(key, [0, p])[0] += 1
    return [(name, count, p) for name, (count, p) in rows.items()]


def _spec_text(spec) -> str:
    return "(" + ", ".join("-" if axes is None else str(axes) for axes in spec) + ")"


def report(
    plan: memory_plan.MemoryPlan,
    options: list[knobs.Knob] = (),
    compiled: compiled_memory.CompiledMemory | None = None,
) -> str:
    """The plan as text: header, per-device bytes, the compiler's figures when it was asked,
    verdict, knobs, every parameter's sharding."""
    c, w, t = plan.config, plan.workload, plan.topology
    mesh = plan.mesh
    num_params = sum(math.prod(p.shape) for p in plan.placements)
    per_device = w.batch_size // mesh["data"] // w.num_microbatches
    hbm = f"{t.hbm_gib_per_device:g} GiB HBM per device" if t.hbm_gib_per_device else "HBM unknown"
    lines = [
        f"topology {t.name}: {mesh['data'] * mesh['model']} devices on {t.num_hosts} host(s), "
        f"{hbm}; mesh data={mesh['data']} x model={mesh['model']}",
        f"model: {num_params:,} parameters ({_dtypes(c)}), activations {c.dtype}, "
        f"remat {c.remat_policy}",
        f"step: batch {w.batch_size}, inputs {w.input_length}, targets {w.target_length}, "
        f"{w.num_microbatches} microbatch(es) -> {per_device} examples per device at a time",
        "",
        f"{f'per device (estimated for {plan.compiler.upper()})':31}{_unit(plan)[0]}",
        *(
            f"  {label:22} {value / _unit(plan)[1]:9.2f}"
            for label, value in (
                ("parameters", plan.params),
                ("optimizer state", plan.opt_state),
                ("gradients", plan.gradients),
                ("activations (estimate)", plan.activations),
                ("update temporaries", plan.update_temporaries),
                ("batch", plan.batch),
            )
        ),
        f"  {'peak (estimate)':22} {plan.peak / _unit(plan)[1]:9.2f}   at the {plan.peak_phase}",
        *(_compiled_lines(plan, compiled) if compiled else _caveats(plan)),
        f"  {_verdict(plan, compiled)}",
        *(_roofline_lines(plan, compiled) if compiled else []),
    ]
    if _fits(plan, compiled) is False:
        lines += ["", f"to make it fit ({_knobs_judged(plan, compiled)}):"]
        lines += [f"  {line}" for line in knob_lines(plan, options, compiled)]
    lines += ["", "parameter shardings (layers_* stands for every layer):"]
    lines += [
        f"  {name:58} x{count:<3} {str(p.shape):18} {_spec_text(p.logical_axes):28} -> "
        f"{_spec_text(p.spec):16} {p.bytes_per_device / 2**20:9.2f} MiB"
        for name, count, p in _collapsed_placements(plan)
    ]
    return "\n".join(lines)


def _dtypes(config: T5Config | T5GemmaConfig) -> str:
    if config.lora is None:
        return "float32"
    s = config.lora
    return (
        f"LoRA: a frozen {s.base_dtype} base, float32 adapters of rank {s.rank} on "
        f"{', '.join(s.targets)}"
    )


def _caveats(plan: memory_plan.MemoryPlan) -> list[str]:
    """What the estimate is known to leave out for this setting (docs/memory_plan.md)."""
    config = plan.config
    if plan.compiler != memory_plan.TPU:
        return []
    if isinstance(config, T5GemmaConfig):
        return [
            "  unverified for T5Gemma on TPU at this size: its activations were read off one "
            "tiny compile (0.74-0.81 of TPU's compiler there, 1.07 at 2B-2B with two layers, "
            "docs/memory_plan.md); --gin.plan.compile=True gives the compiler's own figure"
        ]
    if config.scan_layers or not plan.parameters_over_data:
        return []  # scanned, or 1-D: the estimate tracks TPU's compiler (docs/memory_plan.md)
    lines = [
        "  low for 2-D parameter partitioning with unrolled layers: TPU's compiler gathers "
        "many layers' weights over 'data' at once, which this estimate leaves out (3B on a "
        "v5e-64 needed 1.54x this peak, docs/memory_plan.md); --gin.plan.compile=True gives "
        "the compiler's own figure"
    ]
    if config.remat_policy == "full" and isinstance(config, T5Config):  # T5Gemma's never scan
        lines.append(
            "  with remat, T5Config.scan_layers = True gathers one layer's at a time (11B on a "
            "v4-128 took a third of the memory scanned)"
        )
    return lines


def _compiled_lines(
    plan: memory_plan.MemoryPlan, compiled: compiled_memory.CompiledMemory
) -> list[str]:
    name, unit = _unit(plan)
    if compiled.out_of_memory:
        return [f"  compiled for {compiled.device_kind}: {compiled.out_of_memory}"]
    if compiled.heap_peak:
        parts = f"TPU's heap peak, with the arguments {compiled.arguments / unit:.2f} {name}"
    else:
        parts = (
            f"= arguments {compiled.arguments / unit:.2f} + temporaries "
            f"{compiled.temporaries / unit:.2f} + outputs {compiled.outputs / unit:.2f} - "
            f"donated {compiled.aliased / unit:.2f} {name}"
        )
    return [
        f"  {'peak (XLA, compiled)':22} {compiled.peak / unit:9.2f}   for {compiled.device_kind}; "
        f"the estimate is {plan.peak / compiled.peak:.2f} of it",
        f"    {parts}",
    ]


def _roofline_lines(
    plan: memory_plan.MemoryPlan, compiled: compiled_memory.CompiledMemory
) -> list[str]:
    """The compiled step's roofline on the slice's chips (planning/roofline.py), when TPU's
    compiler placed it and the chip is in the table."""
    generation = (plan.topology.tpu_topology or "").split(":")[0]
    chip = roofline.chip_of(plan.topology.tpu_topology)
    if compiled.out_of_memory or chip is None or not compiled.flops:
        return []
    if not isinstance(plan.config, T5Config):  # the analytic FLOPs count T5's layers only
        return []
    from t5tpu.bench.workloads import forward_flops

    w, c = plan.workload, plan.config
    # A LoRA step takes no gradients of the frozen weights: about 2 forward passes, not 3.
    passes = 2 if c.lora is not None else 3
    devices = plan.mesh["data"] * plan.mesh["model"]
    analytic = passes * forward_flops(c, w.batch_size, w.input_length, w.target_length)
    estimate = roofline.of_train_step(
        flops=compiled.flops,
        bytes_accessed=compiled.bytes_accessed,
        analytic_flops=analytic / devices,
        loops=c.scan_layers or w.num_microbatches > 1,
        chip=chip,
        batch_size=w.batch_size,
    )
    return roofline.describe(estimate, generation)


def _peak(plan: memory_plan.MemoryPlan, compiled) -> int:
    return compiled.peak if compiled and not compiled.out_of_memory else plan.peak


def _fits(plan: memory_plan.MemoryPlan, compiled) -> bool | None:
    if compiled and compiled.out_of_memory:
        return False
    return None if plan.hbm is None else _peak(plan, compiled) <= plan.hbm


def _largest_part(plan: memory_plan.MemoryPlan) -> str:
    parts = {
        "parameters, their gradients and the update's temporaries": plan.params
        + plan.gradients
        + plan.update_temporaries,
        "optimizer state": plan.opt_state,
        "activations": plan.activations,
    }
    return max(parts, key=parts.get)


def _verdict(plan: memory_plan.MemoryPlan, compiled=None) -> str:
    fits = _fits(plan, compiled)
    if fits is None:
        return "no HBM size for this topology: bind Topology.hbm_gib_per_device to check the fit"
    if compiled and compiled.out_of_memory:
        return "DOES NOT FIT: TPU's compiler could not place the step in the chip's HBM"
    hbm = plan.hbm / GiB
    verdict = "fits" if fits else "DOES NOT FIT"
    source = " (XLA's, compiled)" if compiled else ""
    peak = _peak(plan, compiled) / GiB
    return f"{verdict}: peak {peak:.2f} GiB of {hbm:g} GiB HBM per device{source}"


def _need_and_hbm(plan: memory_plan.MemoryPlan, compiled) -> tuple[int, int | None]:
    """The step's peak and the HBM it has: the compiler's when the step was compiled (TPU's
    out-of-memory message names both), else the estimate and the topology's HBM."""
    if compiled and compiled.out_of_memory:
        if compiled.needed:
            return compiled.needed, compiled.available
        return plan.peak, plan.hbm
    return _peak(plan, compiled), plan.hbm


def knob_budget(plan: memory_plan.MemoryPlan, compiled=None) -> int | None:
    """The estimated peak a knob must reach to fit. Knobs are estimates; when the compiled step
    needed more than the estimate, the HBM is scaled down by the same ratio, so that a knob
    fits when the compiler would place it (if its figure moves with the estimate)."""
    need, hbm = _need_and_hbm(plan, compiled)
    return None if hbm is None else int(hbm * plan.peak / need)


def _knobs_judged(plan: memory_plan.MemoryPlan, compiled) -> str:
    if not compiled:
        return "lowest peak first"
    need, _ = _need_and_hbm(plan, compiled)
    if need == plan.peak:
        return "estimated peaks, lowest first; compile to check"
    name, unit = _unit(plan)
    return (
        f"estimated peaks, lowest first; the compiler needed {need / plan.peak:.2f}x the "
        f"estimate, so each must stay under {knob_budget(plan, compiled) / unit:.2f} {name}; "
        "compile to check"
    )


def knob_lines(plan: memory_plan.MemoryPlan, found: list[knobs.Knob], compiled=None) -> list[str]:
    name, unit = _unit(plan)
    lines = [
        f"{k.setting}: peak {k.plan.peak / unit:.2f} {name} "
        f"({'fits' if k.fits else 'still too big'})"
        for k in found
    ]
    if not any(k.fits for k in found):
        need, hbm = _need_and_hbm(plan, compiled)
        # Rounded up: a step 0.7% too big needs 1.1x, not "1.0x".
        more = (
            f"at least {math.ceil(10 * need / hbm) / 10:.1f}x the memory" if hbm else "more memory"
        )
        lines.append(
            f"nothing on this slice is enough: the largest part is the {_largest_part(plan)}; "
            f"use a slice with {more} (more devices, with 2-D "
            "parameter partitioning to spread parameters, gradients and optimizer state over "
            "them)"
        )
    return lines


@gin_setup.runner
def plan(
    *,
    task_feature_lengths: dict | None = None,
    batch_size: int | None = None,
    num_microbatches: int | None = None,
    optimizer=None,
    partitioner: Partitioner | None = None,
    compile: bool = False,
) -> memory_plan.MemoryPlan:
    """Prints the memory plan of the configured training run (with `compile`, XLA's figures for
    the compiled step too); returns the estimate."""
    lengths = pipeline.model_lengths(_setting("task_feature_lengths", task_feature_lengths))
    work = memory_plan.Workload(
        int(_setting("batch_size", batch_size, 128)),
        *lengths,
        int(_setting("num_microbatches", num_microbatches, 1)),
    )
    optimizer = _setting("optimizer", optimizer)
    if optimizer is None:
        raise UserError(
            "no optimizer bound: include configs/runs/finetune.gin or bind train.optimizer"
        )
    partitioner = partitioner or _setting("partitioner", None) or Partitioner()
    topology = partitioner.topology
    with compiled_memory.libtpu_environment(topology) if compile else contextlib.nullcontext():
        num_devices = topology.num_devices or jax.device_count()
        data_parallelism = partitioning.mesh_shape(num_devices, partitioner.num_partitions)["data"]
        # What `t5tpu train` would refuse is refused here too.
        partitioning.check_batch_size(
            "BATCH_SIZE", work.batch_size, data_parallelism, work.num_microbatches
        )
        result = _plan_training(optimizer, partitioner, work, num_devices)
        compiled = _compile(result, optimizer, partitioner) if compile else None
    fits = _fits(result, compiled)
    options = []
    if fits is False:
        budget = knob_budget(result, compiled)
        options = knobs.ranked(result, optimizer, partitioner, budget)
    print(report(result, options, compiled), flush=True)
    return result


def _plan_training(optimizer, partitioner, work, num_devices) -> memory_plan.MemoryPlan:
    """The plan of a full fine-tuning run, or of a LoRA run (train.method), of the model file's
    config: a T5Gemma one as bound, else T5Config's bindings."""
    bound = gin_setup.bound_value("EncoderDecoderModel.config")
    config = bound if isinstance(bound, T5GemmaConfig) else T5Config()
    settings = lora_run.settings_of(_train_binding("method"))
    if settings is None:
        return memory_plan.plan_training(config, optimizer, partitioner, work, num_devices)
    return lora_plan.plan_lora_training(config, settings, optimizer, partitioner, work, num_devices)


def _compile(
    plan: memory_plan.MemoryPlan, optimizer, given: Partitioner
) -> compiled_memory.CompiledMemory:
    from t5tpu.model.encoder_decoder import EncoderDecoderModel
    from t5tpu.runtime.lazy_imports import seqio

    topology = given.topology
    print(
        f"compiling the train step for {topology.tpu_topology or 'the local devices'} "
        "(a 3B or 11B model on a pod slice takes 5-15 minutes, 1-2 with scanned layers)",
        flush=True,
    )
    devices = compiled_memory.devices_for(topology)
    partitioner = Partitioner(given.num_partitions, given.rules, topology, devices)
    # The step needs the vocabulary's size only (the real vocabulary may be on gs://).
    vocabulary = seqio.PassThroughVocabulary(plan.config.vocab_size)
    model = EncoderDecoderModel(plan.config, vocabulary)
    pack = bool(_setting("use_packing", None, False))
    start = time.monotonic()
    memory = compiled_memory.train_step_memory(model, optimizer, partitioner, plan.workload, pack)
    print(f"compiled in {time.monotonic() - start:.0f} s", flush=True)
    return memory
