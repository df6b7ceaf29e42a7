"""Which model the server answers with, and how: read from the gin files (the settings
`t5tpu infer` would use), the flags and Vertex AI's environment, all checked before anything is
loaded; then the loading itself (in the model's worker thread).

The model is the first of: --model (a MODEL_DIR, a checkpoint_N directory, a Hugging Face T5
directory or a T5X / Mesh TF checkpoint), MODEL_DIR bound in gin (at CHECKPOINT_STEP), and
AIP_STORAGE_URI (where Vertex AI copied the model's artifacts). How it answers is the run's (its
run record, storage/run_record.py): lengths come from the flags, else TASK_FEATURE_LENGTHS,
else the run's, else t5tpu.load's defaults; each decoding default from infer's bindings (NUM_BEAMS,
TEMPERATURE, ..., infer.beam_alpha) where the gin files make them, else the run's; inputs
are shaped as the run's task shaped its training inputs; what to do with long inputs comes from
INFER_TRUNCATION. LoRA adapters (--adapter) are opened and checked against the model here too
(serve/lora_adapters.py), so a wrong one is refused before the server listens.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable

from t5tpu import validators
from t5tpu.config import gin_setup, runner_settings
from t5tpu.errors import UserError
from t5tpu.model.decoding_settings import DecodingSettings
from t5tpu.runners import run_lengths
from t5tpu.serve import lora_adapters
from t5tpu.serve.model_worker import Answering, ModelWorker, Runs
from t5tpu.storage import locations
from t5tpu.storage.run_record import RunRecord

STORAGE_URI = "AIP_STORAGE_URI"


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
    defaults: DecodingSettings
    truncation: str
    adapters: tuple[lora_adapters.AdapterCheckpoint, ...] = ()
    # How the model (None) and each adapter answer: its run's record, lengths and defaults.
    answering: dict[str | None, Answering] = dataclasses.field(default_factory=dict)


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
    if not locations.is_remote(path) and not os.path.exists(path):
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
    say: Callable[[str], None] = print,
) -> ModelSetup:
    """The setup the flags, gin files, environment and the model's run record describe,
    checked; reads no parameters (only records and the files' fingerprints). With adapters
    (NAME=PATH) and no model named, the model is the first adapter's base."""
    _parse_gin(gin_flags)
    bound = runner_settings.bound_settings("infer", runner_settings.InferSettings)
    opened = lora_adapters.open_adapters(adapters)
    if opened and not (model or bound.model_dir or environ.get(STORAGE_URI)):
        model = opened[0].record.base.path  # no model named: the adapters' base
    path = _path(model, bound.model_dir, environ)
    step = None if model else _step(bound.checkpoint_step)
    record = _run_record(path, step)
    # A base that records no run (a pretrained import) answers at its first adapter's lengths.
    sized = record or (opened[0].run if opened else None)
    told = (lengths, bound.task_feature_lengths)
    answering = {None: _answering(record, sized, told, say)}
    answering.update((a.name, _answering(a.run, a.run, told, say)) for a in opened)
    setup = ModelSetup(
        path=path,
        step=step,
        gin=gin_flags,
        # The engine's: the longest any of them takes.
        max_input_length=max(a.input_length for a in answering.values()),
        max_target_length=max(a.defaults.max_new_tokens for a in answering.values()),
        defaults=answering[None].defaults,
        truncation=truncation or bound.truncation,
        adapters=opened,
        answering=answering,
    )
    validators.choice(runner_settings.TRUNCATION).check("INFER_TRUNCATION", setup.truncation)
    setup.defaults.check(vocab_size=sys.maxsize)  # top_k is checked once loaded
    if opened:
        from t5tpu.formats import loader

        lora_adapters.check_base(opened, loader.checkpoint_path(setup.path, setup.step))
    return setup


def _run_record(path: str, step: int | None) -> RunRecord | None:
    from t5tpu.formats import loader

    return loader.open_checkpoint(path, step=step, setting="--model").run_record()


def _answering(record: RunRecord | None, sized: RunRecord | None, told, say) -> Answering:
    """How a model whose run is `record` answers: at the lengths `told` (the flags', each, else
    TASK_FEATURE_LENGTHS'), else `sized`'s, with its decoding defaults."""
    flags, gin_lengths = told
    input_length, target_length = _lengths(flags, gin_lengths, sized, say)
    return Answering(record, input_length, _defaults(sized, target_length))


def _lengths(flags, told, record, say) -> tuple[int, int]:
    """The flags' lengths, each else TASK_FEATURE_LENGTHS', else the run's (run_lengths)."""
    chosen = run_lengths.chosen(told, record, setting="TASK_FEATURE_LENGTHS", say=say)
    return tuple(
        validators.whole(low=1).check(name, default if given is None else given)
        for name, given, default in zip(
            ("--max_input_length", "--max_target_length"), flags, chosen, strict=True
        )
    )


def _defaults(record: RunRecord | None, target_length: int) -> DecodingSettings:
    """Each decoding default from the gin files where they bind it, else from the run."""
    settings = runner_settings.infer_decoding(record.decoding if record else None)
    # n-best only when a request asks: a default of several would make every answer a list.
    return dataclasses.replace(settings, num_return_sequences=1, max_new_tokens=target_length)


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
    setup.defaults.check(vocab_size=model.config.vocab_size)
    say(f"loaded {model!r}")
    served = lora_adapters.load_adapters(setup.adapters, base=model, partitioner=partitioner)
    if served:
        say(f"loaded the LoRA adapters {', '.join(served.names)} over it")
    return ModelWorker(
        model=model,
        max_batch_size=max_batch_size,
        defaults=setup.defaults,
        adapters=served,
        runs=Runs(setup.answering) if setup.answering else None,
    )
