"""Which model the server answers with, and how: read from the gin files (the settings
`t5tpu infer` would use), the flags and Vertex AI's environment, all checked before anything is
loaded; then the loading itself (in the model's worker thread).

The model is the first of: --model (a MODEL_DIR, a checkpoint_N directory, a Hugging Face T5
directory or a T5X / Mesh TF checkpoint), MODEL_DIR bound in gin (at CHECKPOINT_STEP), and
AIP_STORAGE_URI (where Vertex AI copied the model's artifacts). Lengths come from the flags, else
TASK_FEATURE_LENGTHS, else t5tpu.load's defaults; the decoding defaults from NUM_BEAMS,
TEMPERATURE, TOP_K and infer.beam_alpha / infer.random_seed; what to do with long inputs from
INFER_TRUNCATION.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable

import gin

from t5tpu.config import gin_setup
from t5tpu.data import pipeline
from t5tpu.errors import UserError
from t5tpu.model import decoding
from t5tpu.serve.model_worker import ModelWorker
from t5tpu.serve.payloads import Decoding

STORAGE_URI = "AIP_STORAGE_URI"
# t5tpu.load's own defaults, for a model served without TASK_FEATURE_LENGTHS.
DEFAULT_LENGTHS = (512, 128)
TRUNCATION = ("warn", "error")


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


def _bound(parameter: str, default):
    value = gin_setup.bound_value(parameter)
    return default if value is None or value is gin.REQUIRED else value


def _step(checkpoint_step) -> int | None:
    if checkpoint_step == "latest":
        return None
    if isinstance(checkpoint_step, str) and checkpoint_step.isdigit():
        return int(checkpoint_step)
    if isinstance(checkpoint_step, int) and not isinstance(checkpoint_step, bool):
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


def _check_length(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UserError(f"{name} = {value!r} must be a whole number >= 1")
    return value


def model_setup(
    *,
    gin_flags: GinFlags,
    model: str | None,
    lengths: tuple[int | None, int | None],
    truncation: str | None,
    environ: dict,
) -> ModelSetup:
    """The setup the flags, gin files and environment describe, checked; reads no checkpoint."""
    if gin_flags.files:
        gin_setup.parse(
            gin_files=list(gin_flags.files),
            bindings=list(gin_flags.bindings),
            search_paths=list(gin_flags.search_paths),
        )
    elif gin_flags.bindings:
        raise UserError("--gin.NAME=VALUE bindings need the --gin_file they bind into")
    try:
        feature_lengths = _bound("infer.task_feature_lengths", None)
        gin_lengths = (
            pipeline.model_lengths(feature_lengths) if feature_lengths else DEFAULT_LENGTHS
        )
        input_length, target_length = (
            _check_length(name, given or default)
            for name, given, default in zip(
                ("--max_input_length", "--max_target_length"), lengths, gin_lengths, strict=True
            )
        )
        defaults = Decoding(
            num_beams=_bound("infer.num_beams", 1),
            max_length=target_length,
            temperature=float(_bound("infer.temperature", 0.0)),
            top_k=_bound("infer.top_k", 0),
            seed=_bound("infer.random_seed", 0),
        )
        setup = ModelSetup(
            path=_path(model, _bound("infer.model_dir", None), environ),
            step=None if model else _step(_bound("infer.checkpoint_step", "latest")),
            gin=gin_flags,
            max_input_length=input_length,
            max_target_length=target_length,
            defaults=defaults,
            beam_alpha=float(_bound("infer.beam_alpha", 0.6)),
            truncation=truncation or _bound("infer.truncation", "warn"),
        )
    finally:
        gin.clear_config()
    if setup.truncation not in TRUNCATION:
        raise UserError(f"INFER_TRUNCATION = {setup.truncation!r}; use 'warn' or 'error'")
    _decoding_settings(setup).check(vocab_size=sys.maxsize)  # top_k is checked once loaded
    return setup


def _decoding_settings(setup: ModelSetup) -> decoding.DecodingSettings:
    settings = setup.defaults
    return decoding.DecodingSettings(
        temperature=settings.temperature,
        top_k=settings.top_k,
        num_beams=settings.num_beams,
        beam_alpha=setup.beam_alpha,
    )


def load_engine(
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
    if setup.gin.files:
        # load() read the model from the gin files and cleared them; the tasks' prompts follow
        # what they bind (normalize_questions, the data they name), as in training.
        gin_setup.parse(
            gin_files=list(setup.gin.files),
            bindings=list(setup.gin.bindings),
            search_paths=list(setup.gin.search_paths),
        )
    say(f"loaded {model!r}")
    return ModelWorker(
        model=model,
        max_batch_size=max_batch_size,
        defaults=setup.defaults,
        beam_alpha=setup.beam_alpha,
    )
