"""The memory plan of a LoRA run (train.method = @lora()): memory_plan.plan_training's for the
same model and workload, with the state of a frozen base.

The activations are the full run's (the backward pass still runs through every layer, for the
adapters' gradients); what changes is the state: base weights in lora.base_dtype with neither
gradient nor optimizer state, adapters in float32 with both, partitioned like their kernels.
Scanned layers need no cast copy of a bfloat16 base when the activations are bfloat16 too.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from t5tpu import partitioning
from t5tpu.model import lora
from t5tpu.model.network import T5Config
from t5tpu.planning import memory_plan
from t5tpu.planning.placements import Placement, boxed_params, opt_state_bytes, placements

_ADAPTER_SUFFIXES = tuple(f"/{name}" for name in lora.ADAPTER_NAMES)


def _is_adapter(row: Placement) -> bool:
    return row.name.endswith(_ADAPTER_SUFFIXES)


def _base_row(row: Placement, itemsize: int) -> Placement:
    return dataclasses.replace(row, bytes_per_device=row.bytes_per_device * itemsize // 4)


def plan_lora_training(
    config: T5Config,
    settings: lora.LoraSettings,
    optimizer,
    partitioner: partitioning.Partitioner,
    work: memory_plan.Workload,
    num_devices: int,
) -> memory_plan.MemoryPlan:
    """The per-device plan of `t5tpu train` training `settings`' adapters on a frozen base."""
    full = memory_plan.plan_training(config, optimizer, partitioner, work, num_devices)
    adapted = dataclasses.replace(config, lora=settings)
    boxed = boxed_params(adapted)
    _, boxed_adapters = lora.split(boxed)
    itemsize = jnp.dtype(settings.base_dtype).itemsize
    rows = [
        row if _is_adapter(row) else _base_row(row, itemsize)
        for row in placements(boxed, partitioner.rules, full.mesh)
    ]
    adapter_rows = [row for row in rows if _is_adapter(row)]
    gradients = sum(row.bytes_per_device for row in adapter_rows)
    same_dtype = itemsize == config.activation_dtype.itemsize
    weight_copy = 0 if same_dtype else full.weight_copy
    return dataclasses.replace(
        full,
        config=adapted,
        placements=rows,
        params=sum(row.bytes_per_device for row in rows),
        opt_state=opt_state_bytes(optimizer, boxed_adapters, partitioner.rules, full.mesh),
        gradients=gradients,
        first_gradients=0,  # the embedding and the output layer are frozen
        decoder_gradients=sum(
            row.bytes_per_device for row in adapter_rows if row.name.startswith("decoder/")
        ),
        weight_copy=weight_copy,
    )
