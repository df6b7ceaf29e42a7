"""XLA's own answer to `t5tpu plan`: the real train step compiled for the slice, and the memory
its compiler assigns each device.

A TPU topology is compiled for libtpu's compile-only devices of that slice (`Topology.
tpu_topology`, e.g. 'v3:8x8'): TPU's compiler runs on any machine with libtpu installed, no TPU
needed, and a pod slice's devices are all compiled for from one process. The cpu topology is
compiled for the visible devices.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import importlib.util
import os
import re
import resource

import jax
import jax.numpy as jnp

from t5tpu.data import pipeline
from t5tpu.errors import UserError
from t5tpu.partitioning import Partitioner, Topology
from t5tpu.planning.memory_plan import Workload
from t5tpu.training import lora_base, trainer


@dataclasses.dataclass(frozen=True)
class CompiledMemory:
    """Bytes per device of the compiled step, as XLA's memory analysis reports them.

    TPU's compiler fits the step into the chip's HBM: a step that compiles fits, one that
    does not is refused with `out_of_memory` saying by how much. With HBM to spare it keeps
    more than it must (docs/memory_plan.md), so the peak of a roomy compile is not the least
    the step needs."""

    device_kind: str
    arguments: int  # state and batch
    temporaries: int
    outputs: int
    aliased: int  # outputs written over donated arguments (the new state)
    # TPU's compiler's own peak: the most bytes its buffer assignment holds at once, the figure
    # its out-of-memory errors measure against HBM. Its temporaries are more than the
    # buffers ever live together (docs/memory_plan.md, "Checked against XLA", has a case).
    # XLA's CPU compiler reports its arguments here, so 0 on CPU.
    heap_peak: int = 0
    out_of_memory: str = ""  # TPU's compiler's message when it could not fit the step
    # What that message says the step needed and the HBM it had (0 when it says neither).
    needed: int = 0
    available: int = 0
    # XLA's cost analysis of the compiled step, per device (a loop's body counted once).
    flops: float = 0.0
    bytes_accessed: float = 0.0

    @property
    def peak(self) -> int:
        return self.heap_peak or self.arguments + self.temporaries + self.outputs - self.aliased


@contextlib.contextmanager
def libtpu_environment(topology: Topology):
    """What TPU's compiler needs from this process; enter before jax first starts its backends.
    A deep stack (kept afterwards). And off a TPU VM (no TPU device files), stand-ins for what
    libtpu asks a TPU VM's metadata server, which it otherwise answers with five lines of
    errors on every start; they go when the block ends."""
    if topology.tpu_topology:
        _lift_stack_limit()
    if not topology.tpu_topology or glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"):
        yield
        return
    stand_ins = {
        "TPU_SKIP_MDS_QUERY": "1",
        "TPU_ACCELERATOR_TYPE": topology.name,
        "TPU_WORKER_HOSTNAMES": "localhost",
        # Compile-only devices hold no chip: let two plans (or test workers) load libtpu at once.
        "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
    }
    added = [name for name in stand_ins if name not in os.environ]
    os.environ.update({name: stand_ins[name] for name in added})
    try:
        yield
    finally:
        for name in added:
            del os.environ[name]


def _lift_stack_limit() -> None:
    """TPU's compiler recurses deeply on big pod programs: 3B for a v4-32 overflows an 8 MiB
    stack (the usual `ulimit -s`) and compiles with it unlimited. Lifted in-process, the soft
    limit lets the stack grow; memory is used only as deep as the compiler goes."""
    _, hard = resource.getrlimit(resource.RLIMIT_STACK)
    resource.setrlimit(resource.RLIMIT_STACK, (hard, hard))


def compile_only_devices(topology: Topology) -> list:
    """The devices of a TPU slice as TPU's compiler sees them, without the slice."""
    if importlib.util.find_spec("libtpu") is None:
        raise UserError(
            f"compiling for {topology.name} needs libtpu: install the TPU compiler that matches "
            "this jax (pip install -c constraints.txt libtpu, or pip install -e '.[tpu]'); no "
            "TPU is needed"
        )
    from jax.experimental import topologies

    # A v4 or v5p chip's two TensorCores are one jax device (megacore) on Cloud TPU; libtpu
    # describes them core by core unless asked for that configuration.
    megacore = topology.tpu_topology.split(":")[0] in ("v4", "v5p")
    options = {"chip_config_name": "megacore"} if megacore else {}
    try:
        description = topologies.get_topology_desc(topology.tpu_topology, "tpu", **options)
        devices = list(description.devices)
    except Exception as e:  # libtpu raises bare runtime errors (unknown slice, lock held, ...)
        raise UserError(
            f"libtpu could not describe {topology.tpu_topology!r} for {topology.name}: "
            f"{str(e).splitlines()[0]}"
        ) from None
    if topology.num_devices and len(devices) != topology.num_devices:
        raise UserError(
            f"Topology.tpu_topology={topology.tpu_topology!r} has {len(devices)} devices, "
            f"Topology.num_devices={topology.num_devices}; make them agree"
        )
    return devices


def devices_for(topology: Topology) -> list:
    if topology.tpu_topology:
        return compile_only_devices(topology)
    if topology.name != "cpu":
        raise UserError(
            f"the {topology.name} topology names no TPU slice to compile for; bind "
            "Topology.tpu_topology (libtpu's name, e.g. 'v3:2x2' for a v3-8)"
        )
    return jax.devices()


def train_step_memory(
    model, optimizer, partitioner: Partitioner, work: Workload, pack: bool = False
) -> CompiledMemory:
    """Compiles the train step `t5tpu train` would run (same shardings, donation, microbatches
    and batch features) for the partitioner's devices and reads XLA's memory analysis."""
    if model.config.lora is not None:  # a LoRA run: the frozen base is one more argument
        shapes = lora_base.state_shardings(model, optimizer, partitioner)
        abstract = (shapes.abstract, shapes.base)
        step = lora_base.compile_train_step(
            model, optimizer, shapes, partitioner, work.num_microbatches
        )
    else:
        state, shardings = trainer.state_shardings(model, optimizer, partitioner)
        abstract = (state,)
        step = trainer.compile_train_step(
            model, optimizer, shardings, partitioner, work.num_microbatches
        )
    features = pipeline.feature_converter(pack).get_model_feature_lengths(
        {"inputs": work.input_length, "targets": work.target_length}
    )
    batch = {
        name: jax.ShapeDtypeStruct((work.batch_size, length), jnp.int32)
        for name, length in features.items()
    }
    seed = jax.ShapeDtypeStruct((2,), jnp.uint32)
    device = partitioner.mesh.devices.flat[0]
    device_kind = device.device_kind
    try:
        compiled = step.lower(*abstract, batch, seed).compile()
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        summary = _oom_summary(str(e))
        needed, available = _oom_bytes(summary)
        return CompiledMemory(
            device_kind, 0, 0, 0, 0, out_of_memory=summary, needed=needed, available=available
        )
    memory, cost = compiled.memory_analysis(), compiled.cost_analysis()
    cost = (cost[0] if isinstance(cost, list) else cost) or {}
    return CompiledMemory(
        device_kind=device_kind,
        arguments=memory.argument_size_in_bytes,
        temporaries=memory.temp_size_in_bytes,
        outputs=memory.output_size_in_bytes,
        aliased=memory.alias_size_in_bytes,
        heap_peak=memory.peak_memory_in_bytes if device.platform == "tpu" else 0,
        flops=float(cost.get("flops", 0.0)),
        bytes_accessed=float(cost.get("bytes accessed", 0.0)),
    )


def _oom_summary(message: str) -> str:
    """The sentence of TPU's out-of-memory error that says how much was needed."""
    found = re.search(r"(Ran out of memory[^\n\\]*?)(?:\\n|\n|$)", message)
    return (found.group(1) if found else message.splitlines()[0]).strip()


_UNITS = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_SIZE = r"([\d.]+)([KMGT]?)i?B?"


def _oom_bytes(summary: str) -> tuple[int, int]:
    """(needed, available) bytes from TPU's out-of-memory sentence, in either of its forms:
    '... required for HLO temporaries (906.53M) exceeds available HBM (900.00M)' or
    'Used 17.55G of 15.48G hbm'; (0, 0) when it has neither."""
    found = re.search(rf"\({_SIZE}\) exceeds available HBM \({_SIZE}\)", summary) or re.search(
        rf"Used {_SIZE} of {_SIZE} hbm", summary
    )
    if not found:
        return 0, 0
    need, need_unit, have, have_unit = found.groups()
    return int(float(need) * _UNITS[need_unit]), int(float(have) * _UNITS[have_unit])
