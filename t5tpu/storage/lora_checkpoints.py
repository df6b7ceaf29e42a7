"""Checkpoints of LoRA runs: their `params` item holds the adapters alone, and their metadata
the LoRA settings and the base checkpoint (path and fingerprint, lora_base_fingerprint.py).

The record and the adapters' bytes are read here, onto the adapter shapes the caller gives;
which shapes a model's adapters take (model/lora.py), and the base, which may be in any format,
are formats/loader.py's, which every command reads checkpoints through.
"""

from __future__ import annotations

import dataclasses

import jax

from t5tpu.errors import UserError
from t5tpu.model import lora
from t5tpu.storage import checkpoints
from t5tpu.storage import model_dir as paths
from t5tpu.storage.lora_base_fingerprint import BaseReference

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


def check_geometry(mngr, step: int, expected) -> None:
    """Refuses, listing the differences, adapters of checkpoint `step` other than `expected`
    (the adapter shapes the model's kernels take, layers unrolled as on disk)."""
    differences = checkpoints.geometry_differences(
        checkpoints.flat_shapes(mngr.item_metadata(step)["params"]),
        checkpoints.flat_shapes(expected),
    )
    if differences:
        raise UserError(
            f"the LoRA adapters of {paths.checkpoint_dir(str(mngr.directory), step)} do not fit "
            f"this model ({differences}); use the model gin file they were trained with"
        )


def restore_adapters(mngr, step: int, targets):
    """The adapters alone of adapter checkpoint `step`, onto `targets` (shapes, dtypes and
    shardings, as ShapeDtypeStructs)."""
    return checkpoints.restore_params(
        mngr, step, targets, jax.tree_util.tree_map(lambda t: t.sharding, targets)
    )
