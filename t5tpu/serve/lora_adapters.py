"""LoRA adapters served over one base: `t5tpu serve --adapter NAME=MODEL_DIR` (repeatable), a
request choosing one with its "adapter" parameter.

At start-up, before anything is loaded, each adapter's checkpoint must be a LoRA run's, all of
one LoRA settings, each trained on the served model's files (their fingerprints,
lora_base_fingerprint.py): anything else is refused in one line. Once the base is loaded, each
adapter's `lora_a`/`lora_b` are read and joined to the base's parameters: the base arrays are
the base engine's own, referenced by every adapter's tree, never copied. One Engine with the
adapted network (x W + (x A) B * alpha / rank) runs every adapter and the base itself, as an
adapter of zeros: they all share its compiled programs (the base's own engine compiles none),
and the worker hands it the chosen tree before each group of rows.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from t5tpu.errors import UserError
from t5tpu.formats import loader
from t5tpu.model import lora, precision
from t5tpu.model.encoder_decoder import adapted_model
from t5tpu.model.engine import Engine
from t5tpu.storage import locations, lora_base_fingerprint
from t5tpu.storage.lora_checkpoints import AdapterRecord
from t5tpu.storage.run_record import RunRecord

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


@dataclasses.dataclass(frozen=True)
class AdapterCheckpoint:
    """An adapter to serve: its name, its checkpoint (opened by formats/loader.py, a LoRA run's)
    and that run's record."""

    name: str
    checkpoint: loader.Checkpoint
    run: RunRecord | None = None  # the LoRA run's record: its task, lengths, input shaping

    @property
    def record(self) -> AdapterRecord:
        return self.checkpoint.lora


def _spec(text: str) -> tuple[str, str]:
    name, equals, path = text.partition("=")
    if not equals or not path or not _NAME.fullmatch(name):
        raise UserError(
            f"--adapter={text!r}: give NAME=MODEL_DIR (a LoRA run's MODEL_DIR or checkpoint_N), "
            "NAME of letters, digits, _ . -"
        )
    return name, path


def open_adapter(text: str) -> AdapterCheckpoint:
    """The adapter `--adapter=NAME=PATH` names: PATH's newest checkpoint, or PATH itself."""
    name, given = _spec(text)
    if not locations.is_remote(given) and not os.path.exists(given):
        raise UserError(f"--adapter {name}={given} does not exist; give a LoRA run's MODEL_DIR")
    step_dir = loader.named_step_dir(loader.checkpoint_path(given))
    if step_dir is None:
        raise UserError(
            f"--adapter {name}={given} is not a t5tpu MODEL_DIR or checkpoint_N; give a LoRA run's"
        )
    checkpoint = loader.in_model_dir(step_dir.model_dir, step_dir.step)
    if checkpoint.lora is None:
        raise UserError(
            f"--adapter {name}={given} is a full model's checkpoint, not a LoRA run's: serve it "
            "on its own with --model"
        )
    return AdapterCheckpoint(name, checkpoint, checkpoint.run_record())


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
    found = lora_base_fingerprint.fingerprint(served)
    for adapter in adapters:
        if adapter.record.base.fingerprint != found:
            raise UserError(
                f"--adapter {adapter.name} was trained on the base {adapter.record.base.path}, "
                f"not on the served model {served}; serve it with --model="
                f"{adapter.record.base.path}"
            )


@dataclasses.dataclass
class ServedAdapters:
    """The engine that runs every adapter and the base, and each one's parameter tree: the
    base's arrays with an adapter beside the kernels (the base's own: zeros), and whether to
    round the base as the adapter's run trained on it."""

    engine: Engine
    params: dict[str | None, dict]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name in self.params if name is not None)

    def engine_for(self, name: str | None) -> Engine:
        """The engine, set to decode and score with adapter `name` (None: the base alone); no
        copy, no compile."""
        self.engine.set_params(self.params[name])
        return self.engine


def _needs_rounding(settings: lora.LoraSettings, activation_dtype) -> bool:
    # A bfloat16 engine reads bfloat16 weights anyway; a float32 one must round them itself.
    return jnp.dtype(activation_dtype) == jnp.float32 and settings.base_dtype != "float32"


def _zeros_like(tree):
    """Zeros of `tree`'s shapes on its shardings, made on the host (no program compiled)."""
    return jax.tree_util.tree_map(
        lambda x: jax.device_put(np.zeros(x.shape, x.dtype), x.sharding), tree
    )


def load_adapters(
    adapters: Sequence[AdapterCheckpoint], *, base, partitioner
) -> ServedAdapters | None:
    """The adapters over `base` (a loaded T5Model, whose parameters they share), and the base
    itself as an adapter of zeros: one engine, one set of programs, serves them all (the zero
    adapters cost a rank-r matmul beside each adapted kernel)."""
    if not adapters:
        return None
    base_params = base.engine.params
    shardings = jax.tree_util.tree_map(lambda x: x.sharding, base_params)
    abstract = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), base_params
    )
    dtype = base.config.activation_dtype
    settings = adapters[0].record.settings
    flag = jax.device_put(np.bool_(False), partitioner.replicated())
    trees: dict[str | None, dict] = {}
    for adapter in adapters:
        own = adapter.checkpoint.adapters(abstract, shardings)
        joined = lora.join(base_params, precision.cast_params(own, dtype))
        rounded = jax.device_put(np.bool_(_needs_rounding(settings, dtype)), flag.sharding)
        trees[adapter.name] = lora.served_tree(joined, rounded)
    _, first = lora.split(trees[adapters[0].name]["params"])
    trees[None] = lora.served_tree(lora.join(base_params, _zeros_like(first)), flag)
    engine = Engine(
        model=adapted_model(base.model, settings),
        params=trees[None],
        param_shardings=jax.tree_util.tree_map(lambda x: x.sharding, trees[None]),
        partitioner=partitioner,
        batch_size=base.shapes.batch_size,
        max_input_length=base.shapes.max_input_length,
        max_target_length=base.shapes.max_target_length,
        param_view=lora.served_view(
            settings.base_dtype if _needs_rounding(settings, dtype) else None
        ),
    )
    return ServedAdapters(engine=engine, params=trees)
