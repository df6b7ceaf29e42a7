"""Checkpoints of LoRA runs: their `params` item holds the adapters alone, and their metadata
the LoRA settings and the base checkpoint (path and fingerprint, base_fingerprint.py).

Eval, infer, `t5tpu.load` and the converters read any t5tpu checkpoint through `restore_params`
here: a plain one as checkpoints.restore_params does, an adapter one as the base (read by the
caller's `load_base`, which knows every format a base may be in) with the adapters merged into
its kernels, so everything after it sees plain parameters.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

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


def param_shapes(mngr, step: int) -> dict[str, tuple] | None:
    """The flat parameter shapes of a plain checkpoint; None for an adapter checkpoint (whose
    base is checked against the model when it is read)."""
    if record_of(mngr, step):
        return None
    return checkpoints.flat_shapes(mngr.item_metadata(step)["params"])


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


def restore_params(
    mngr, step: int, abstract_params, shardings, *, load_base: Callable | None = None
):
    """The plain parameters of checkpoint `step`, placed on `shardings`: restored, or for an
    adapter checkpoint its base (`load_base(path, abstract_params, shardings)`, checked against
    its fingerprint first) with the adapters merged in, in float32."""
    record = record_of(mngr, step)
    if record is None:
        return checkpoints.restore_params(mngr, step, abstract_params, shardings)
    where = paths.checkpoint_dir(str(mngr.directory), step)
    if load_base is None:
        raise UserError(f"{where} holds LoRA adapters; load it with its base (t5tpu.load)")
    record.base.check(where)
    adapters = restore_adapters(mngr, step, abstract_params, shardings, record)
    base = load_base(record.base.path, abstract_params, shardings)

    def merged(base, adapters):
        # The base as the run trained on it (its base dtype), then the adapters added.
        rounded = lora.cast(lora.cast(base, record.settings.base_dtype), "float32")
        return lora.merge(rounded, adapters, record.settings)

    return jax.jit(merged, out_shardings=shardings, donate_argnums=(0,))(base, adapters)
