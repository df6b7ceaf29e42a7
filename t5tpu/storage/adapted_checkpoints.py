"""Checkpoints of LoRA runs: their `params` item holds the adapters alone, and their metadata
the LoRA settings and the base checkpoint (path and fingerprint, base_fingerprint.py).

The record and the adapters are read here; the base, which may be in any format, is opened and
merged by formats/loader.py, which every command reads checkpoints through.
"""

from __future__ import annotations

import dataclasses

import jax

from t5tpu.errors import UserError
from t5tpu.model import layer_stacking, lora
from t5tpu.storage import checkpoints
from t5tpu.storage import model_dir as paths
from t5tpu.storage.base_fingerprint import BaseReference

# The custom metadata key of an adapter checkpoint.
LORA = "lora"


@dataclasses.dataclass(frozen=True)
class AdapterRecord:
    """What an adapter checkpoint says about itself beside the adapters."""

    settings: lora.LoraSettings
    base: BaseReference

    def metadata(self) -> dict:
        return {LORA: {"settings": self.settings.record(), "base": self.base.record()}}

    @classmethod
    def from_metadata(cls, metadata: dict | None) -> AdapterRecord | None:
        record = (metadata or {}).get(LORA)
        if not record:
            return None
        settings = lora.LoraSettings.from_record(record["settings"])
        return cls(settings, BaseReference.from_record(record["base"]))


def record_of(mngr, step: int) -> AdapterRecord | None:
    """The adapter record of checkpoint `step`; None for a plain checkpoint."""
    return AdapterRecord.from_metadata(mngr.metadata(step).custom_metadata)


def _adapter_targets(abstract_params, shardings, record: AdapterRecord):
    return lora.adapter_shapes(abstract_params, shardings, record.settings)


def check_geometry(mngr, step: int, abstract_params) -> None:
    """checkpoints.check_geometry for plain checkpoints; for adapter ones, the adapters are
    checked against the ones the model's kernels take."""
    record = record_of(mngr, step)
    if record is None:
        checkpoints.check_geometry(mngr, step, abstract_params)
        return
    expected = _adapter_targets(layer_stacking.unstack_layers(abstract_params), None, record)
    differences = checkpoints.geometry_differences(
        checkpoints.flat_shapes(mngr.item_metadata(step)["params"]),
        checkpoints.flat_shapes(expected),
    )
    if differences:
        raise UserError(
            f"the LoRA adapters of {paths.checkpoint_dir(str(mngr.directory), step)} do not fit "
            f"this model ({differences}); use the model gin file they were trained with"
        )


def restore_adapters(mngr, step: int, abstract_params, shardings, record: AdapterRecord):
    """The adapters alone of adapter checkpoint `step` (float32, placed like the kernels they
    adapt), checked against the ones the model's kernels take (`abstract_params`)."""
    check_geometry(mngr, step, abstract_params)
    targets = _adapter_targets(abstract_params, shardings, record)
    return checkpoints.restore_params(
        mngr, step, targets, jax.tree_util.tree_map(lambda t: t.sharding, targets)
    )
