"""Which model the server answers with, and how: read from the gin files (the settings
`t5tpu infer` would use), the flags and Vertex AI's environment, all checked before anything is
loaded; then the loading itself (in the model's worker thread).

The model is the first of: --model (a MODEL_DIR, a checkpoint_N directory, a Hugging Face T5
directory or a T5X / Mesh TF checkpoint), MODEL_DIR bound in gin (at CHECKPOINT_STEP), and
AIP_STORAGE_URI (where Vertex AI copied the model's artifacts). Lengths come from the flags, else
TASK_FEATURE_LENGTHS, else t5tpu.load's defaults; the decoding defaults from NUM_BEAMS,
TEMPERATURE, TOP_K and infer.beam_alpha / infer.random_seed; what to do with long inputs from
INFER_TRUNCATION. LoRA adapters (--adapter) are opened and checked against the model here too
(serve/adapters.py), so a wrong one is refused before the server listens.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable

from t5tpu import validators
from t5tpu.config import gin_setup, runner_settings
from t5tpu.data import pipeline
from t5tpu.errors import UserError
from t5tpu.model import decoding
from t5tpu.serve import adapters as lora_adapters
from t5tpu.serve.model_worker import ModelWorker
from t5tpu.serve.payloads import Decoding

STORAGE_URI = "AIP_STORAGE_URI"
# t5tpu.load's own defaults, for a model served without TASK_FEATURE_LENGTHS.
DEFAULT_LENGTHS = (512, 128)


@dataclasses.dataclass(frozen=True)
class GinFlags:
    files: tuple[str, ...] = ()
    bindings: tuple[str, ...] = ()
    search_paths: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class ModelSetup:
    """Everything the worker thread needs to load the model and run it."""

    path: str
    step: int | None
    gin: GinFlags
    max_input_length: int
    max_target_length: int
    defaults: Decoding
    beam_alpha: float
    truncation: str
    adapters: tuple[lora_adapters.AdapterCheckpoint, ...] = ()


def _step(checkpoint_step) -> int | None:
    if checkpoint_step == "latest":
        return None
    if isinstance(checkpoint_step, str) and checkpoint_step.isdigit():
        return int(checkpoint_step)
    if validators.is_whole(checkpoint_step):
        return checkpoint_step
    raise UserError(
        f"CHECKPOINT_STEP = {checkpoint_step!r}: a server answers with one checkpoint, 'latest' "
        "or a step"
    )


def _path(model: str | None, model_dir, environ: dict) -> str:
    path = model or model_dir or environ.get(STORAGE_URI)
    if not path:
        raise UserError(
            "no model to serve: pass --model=PATH, or --gin_file=... with "
            "--gin.MODEL_DIR=\"'/path/to/run'\" (Vertex AI sets AIP_STORAGE_URI)"
        )
    if "://" not in path and not os.path.exists(path):
        raise UserError(f"the model {path} does not exist; check --model or MODEL_DIR")
    return str(path)


def _parse_gin(gin_flags: GinFlags) -> None:
    if gin_flags.files:
        gin_setup.parse(
            gin_files=list(gin_flags.files),
            bindings=list(gin_flags.bindings),
            search_paths=list(gin_flags.search_paths),
        )
    elif gin_flags.bindings:
        raise UserError("--gin.NAME=VALUE bindings need the --gin_file they bind into")


def model_setup(
    *,
    gin_flags: GinFlags,
    model: str | None,
    lengths: tuple[int | None, int | None],
    truncation: str | None,
    environ: dict,
    adapters: tuple[str, ...] = (),
) -> ModelSetup:
    """The setup the flags, gin files and environment describe, checked; reads no parameters
    (only the adapters' records and the files' fingerprints). With adapters (NAME=PATH) and no
    model named, the model is the first adapter's base."""
    _parse_gin(gin_flags)
    bound = runner_settings.bound_settings("infer", runner_settings.InferSettings)
    gin_lengths = (
        pipeline.model_lengths(bound.task_feature_lengths)
        if bound.task_feature_lengths
        else DEFAULT_LENGTHS
    )
    input_length, target_length = (
        validators.whole(low=1).check(name, given or default)
        for name, given, default in zip(
            ("--max_input_length", "--max_target_length"), lengths, gin_lengths, strict=True
        )
    )
    opened = lora_adapters.open_adapters(adapters)
    if opened and not (model or bound.model_dir or environ.get(STORAGE_URI)):
        model = opened[0].record.base.path  # no model named: the adapters' base
    setup = ModelSetup(
        path=_path(model, bound.model_dir, environ),
        step=None if model else _step(bound.checkpoint_step),
        gin=gin_flags,
        max_input_length=input_length,
        max_target_length=target_length,
        defaults=Decoding(
            num_beams=bound.num_beams,
            max_length=target_length,
            temperature=float(bound.temperature),
            top_k=bound.top_k,
            seed=bound.random_seed,
        ),
        beam_alpha=float(bound.beam_alpha),
        truncation=truncation or bound.truncation,
        adapters=opened,
    )
    validators.choice(runner_settings.TRUNCATION).check("INFER_TRUNCATION", setup.truncation)
    _decoding_settings(setup).check(vocab_size=sys.maxsize)  # top_k is checked once loaded
    if opened:
        from t5tpu.api import loading

        lora_adapters.check_base(opened, loading.checkpoint_path(setup.path, setup.step))
    return setup


def _decoding_settings(setup: ModelSetup) -> decoding.DecodingSettings:
    settings = setup.defaults
    return decoding.DecodingSettings(
        temperature=settings.temperature,
        top_k=settings.top_k,
        num_beams=settings.num_beams,
        beam_alpha=setup.beam_alpha,
    )


def load_worker(
    setup: ModelSetup, *, max_batch_size: int, say: Callable[[str], None]
) -> ModelWorker:
    """The model loaded and placed on the devices, wrapped for serving (not yet compiled)."""
    from t5tpu import api
    from t5tpu.partitioning import Partitioner

    partitioner = Partitioner()
    say(f"loading {setup.path}")
    model = api.load(
        setup.path,
        step=setup.step,
        gin_files=setup.gin.files,
        batch_size=max_batch_size,
        max_input_length=setup.max_input_length,
        max_target_length=setup.max_target_length,
        partitioner=partitioner,
    )
    model.vocabulary  # noqa: B018 - a model without one cannot take text: say so now
    _decoding_settings(setup).check(vocab_size=model.model.config.vocab_size)
    say(f"loaded {model!r}")
    served = lora_adapters.load_adapters(setup.adapters, base=model, partitioner=partitioner)
    if served:
        say(f"loaded the LoRA adapters {', '.join(served.names)} over it")
    return ModelWorker(
        model=model,
        max_batch_size=max_batch_size,
        defaults=setup.defaults,
        beam_alpha=setup.beam_alpha,
        adapters=served,
    )
