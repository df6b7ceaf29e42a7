"""LoRA adapters served over one base: `t5tpu serve --adapter NAME=MODEL_DIR` (repeatable), a
request choosing one with its "adapter" parameter.

At start-up, before anything is loaded, each adapter's checkpoint must be a LoRA run's, all of
one LoRA settings, each trained on the served model's files (their fingerprints,
base_fingerprint.py): anything else is refused in one line. Once the base is loaded, each
adapter's `lora_a`/`lora_b` are read and joined to the base's parameters: the base arrays are
the base engine's own, referenced by every adapter's tree, never copied. One Engine with the
adapted network (x W + (x A) B * alpha / rank) runs every adapter: they share its compiled
programs, and the worker hands it the chosen adapter's tree before each group of rows.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from t5tpu.errors import UserError
from t5tpu.model import lora, precision
from t5tpu.model.engine import Engine
from t5tpu.storage import adapted_checkpoints, base_fingerprint, checkpoints
from t5tpu.storage import model_dir as paths
from t5tpu.storage.adapted_checkpoints import AdapterRecord

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


@dataclasses.dataclass(frozen=True)
class AdapterCheckpoint:
    """An adapter to serve: its name, its checkpoint (MODEL_DIR and step) and what that says."""

    name: str
    model_dir: str
    step: int
    record: AdapterRecord

    @property
    def path(self) -> str:
        return paths.checkpoint_dir(self.model_dir, self.step)


def _spec(text: str) -> tuple[str, str]:
    name, equals, path = text.partition("=")
    if not equals or not path or not _NAME.fullmatch(name):
        raise UserError(
            f"--adapter={text!r}: give NAME=MODEL_DIR (a LoRA run's MODEL_DIR or checkpoint_N), "
            "NAME of letters, digits, _ . -"
        )
    return name, path


def _absolute(path: str) -> str:
    return path if "://" in path else os.path.abspath(path)


def open_adapter(text: str) -> AdapterCheckpoint:
    """The adapter `--adapter=NAME=PATH` names: PATH's newest checkpoint, or PATH itself."""
    from t5tpu.api import loading

    name, given = _spec(text)
    if "://" not in given and not os.path.exists(given):
        raise UserError(f"--adapter {name}={given} does not exist; give a LoRA run's MODEL_DIR")
    path = _absolute(loading.checkpoint_path(given).rstrip("/"))
    step = paths.step_of(path)
    if step is None:
        raise UserError(
            f"--adapter {name}={given} is not a t5tpu MODEL_DIR or checkpoint_N; give a LoRA run's"
        )
    model_dir = os.path.dirname(path)
    record = adapted_checkpoints.record_of(checkpoints.manager(model_dir, read_only=True), step)
    if record is None:
        raise UserError(
            f"--adapter {name}={given} is a full model's checkpoint, not a LoRA run's: serve it "
            "on its own with --model"
        )
    return AdapterCheckpoint(name, model_dir, step, record)


def open_adapters(texts: Sequence[str]) -> tuple[AdapterCheckpoint, ...]:
    """The adapters the --adapter flags name, each once, all of one LoRA settings."""
    opened = tuple(open_adapter(text) for text in texts)
    names = [adapter.name for adapter in opened]
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise UserError(f"--adapter {twice[0]} is given twice; give each adapter its own name")
    others = [a.name for a in opened if a.record.settings != opened[0].record.settings]
    if others:
        raise UserError(
            f"--adapter {others[0]} has other LoRA settings (rank, alpha, targets, base_dtype) "
            f"than {opened[0].name}; serve adapters of one settings together"
        )
    return opened


def check_base(adapters: Sequence[AdapterCheckpoint], served: str) -> None:
    """Refuses, in one line, an adapter trained on another base than the checkpoint `served`."""
    if not adapters:
        return
    found = base_fingerprint.fingerprint(served)
    for adapter in adapters:
        if adapter.record.base.fingerprint != found:
            raise UserError(
                f"--adapter {adapter.name} was trained on the base {adapter.record.base.path}, "
                f"not on the served model {served}; serve it with --model="
                f"{adapter.record.base.path}"
            )


@dataclasses.dataclass
class ServedAdapters:
    """The adapters' parameter trees by name (each the base's arrays with its adapters beside
    the kernels) and the one engine that runs them."""

    engine: Engine
    params: dict[str, object]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.params)

    def engine_for(self, name: str) -> Engine:
        """The engine, set to decode and score with adapter `name` (no copy, no compile)."""
        self.engine.set_params(self.params[name])
        return self.engine


def _rounded_base(base_dtype: str):
    """The parameters with the base leaves rounded to `base_dtype`, as a LoRA run trains on
    them (and t5tpu.load merges onto them); the adapters as they are. reduce_precision, not a
    cast there and back, which XLA may drop as a no-op."""
    info = jnp.finfo(base_dtype)

    def rounded(x):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            return x
        return jax.lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)

    def view(params):
        base, adapters = lora.split(params)
        return lora.join(jax.tree_util.tree_map(rounded, base), adapters)

    return view


def _param_view(settings: lora.LoraSettings, activation_dtype):
    # A bfloat16 engine reads bfloat16 weights anyway; a float32 one must round them itself.
    if jnp.dtype(activation_dtype) != jnp.float32 or settings.base_dtype == "float32":
        return None
    return _rounded_base(settings.base_dtype)


def load_adapters(
    adapters: Sequence[AdapterCheckpoint], *, base, partitioner
) -> ServedAdapters | None:
    """The adapters over `base` (a loaded T5Model, whose parameters they share)."""
    from t5tpu.training import frozen_base

    if not adapters:
        return None
    base_params = base.engine.params
    shardings = jax.tree_util.tree_map(lambda x: x.sharding, base_params)
    abstract = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), base_params
    )
    dtype = base.model.config.activation_dtype
    trees = {}
    for adapter in adapters:
        mngr = checkpoints.manager(adapter.model_dir, read_only=True)
        own = adapted_checkpoints.restore_adapters(
            mngr, adapter.step, abstract, shardings, adapter.record
        )
        trees[adapter.name] = lora.join(base_params, precision.cast_params(own, dtype))
    settings = adapters[0].record.settings
    first = trees[adapters[0].name]
    engine = Engine(
        network=frozen_base.adapted_model(base.model, settings),
        params=first,
        param_shardings=jax.tree_util.tree_map(lambda x: x.sharding, first),
        partitioner=partitioner,
        batch_size=base.shapes.batch_size,
        max_input_length=base.shapes.max_input_length,
        max_target_length=base.shapes.max_target_length,
        param_view=_param_view(settings, dtype),
    )
    return ServedAdapters(engine=engine, params=trees)
