"""`t5tpu convert`: pretrained T5 weights in (Hugging Face, T5X, Mesh TF) and out (Hugging
Face, PEFT). `to_t5tpu` and `to_hf` are what it runs (its flags are t5tpu.cli.convert's); the
checkpoints are opened and read by formats/loader.py, as every command reads them:

- to_t5tpu writes DIR/checkpoint_<step>/params (orbax, parameters only; the step is the
  source's: 0 for Hugging Face) and DIR/model.gin: the model's geometry, the source's vocabulary
  if it has one, and INITIAL_CHECKPOINT_PATH, so that
  `t5tpu train --gin_file=EXPERIMENT --gin_file=DIR/model.gin` fine-tunes from it.
- to_hf writes a Hugging Face directory from a t5tpu checkpoint_<step> (or the newest one of a
  MODEL_DIR). What shapes cannot tell (the gated activation, the relative position distance,
  the vocabulary) comes from the gin files given, else from the model.gin or config.gin beside
  the checkpoint. A LoRA run's checkpoint is written merged into its base, or its adapters
  alone in PEFT's format.

T5Gemma goes both ways too: its Hugging Face directory in (model.gin then binds T5GemmaConfig
and both stacks' geometry) and out through hf_t5gemma.py, its adapters named as transformers'.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
from collections.abc import Iterator

import jax
import orbax.checkpoint as ocp
from etils import epath

from t5tpu.errors import EnvironmentFault, UserError
from t5tpu.formats import (
    hf_format,
    hf_run_record,
    hf_t5gemma,
    hf_tokenizer,
    loader,
    peft_format,
    vocabulary_source,
)
from t5tpu.formats.vocabulary_source import VocabularySource
from t5tpu.model import lora, param_shapes
from t5tpu.model.network import T5Config
from t5tpu.model.t5gemma_network import T5GemmaConfig
from t5tpu.storage import atomic_files, checkpoints, locations, remote, save_guards
from t5tpu.storage.model_dir import MODEL_GIN, checkpoint_dir

# Geometry fields written into model.gin, in this order.
_GEOMETRY = (
    "vocab_size",
    "emb_dim",
    "num_heads",
    "head_dim",
    "mlp_dim",
    "num_encoder_layers",
    "num_decoder_layers",
    "mlp_activations",
    "logits_via_embedding",
    "relative_attention_num_buckets",
    "relative_attention_max_distance",
    "relative_bias_per_layer",
)


# ---------------------------------------------------------------------------------------------
# model.gin


def model_gin(
    config: T5Config | T5GemmaConfig,
    checkpoint_path: str,
    vocabulary: VocabularySource,
    command: str,
    assumed: str = "",
) -> str:
    gemma = isinstance(config, T5GemmaConfig)
    lines = [
        f"# Written by `{command}`.",
        "# The converted model's geometry, vocabulary and weights. Give it after an experiment"
        + (" of a T5Gemma model gin:" if gemma else ":"),
        "#   t5tpu train --gin_file=EXPERIMENT.gin "
        f"--gin_file={os.path.join(_parent(checkpoint_path), MODEL_GIN)}",
    ]
    if assumed:
        lines.append(f"# Not in the checkpoint, assumed as in T5: {assumed}.")
    lines.append("")
    if gemma:
        lines += t5gemma_geometry(config)
    else:
        lines += [f"T5Config.{field} = {getattr(config, field)!r}" for field in _GEOMETRY]
    lines.append("")
    lines += vocabulary.gin_bindings()
    if vocabulary.kind == vocabulary_source.NONE:
        usual = (
            "Gemma's tokenizer.model, no extra ids"
            if gemma
            else "gs://t5-data/vocabs/cc_all.32000/sentencepiece.model, 100 extra ids"
        )
        lines += [
            "# The checkpoint carries no vocabulary: the experiment's model gin binds it",
            f"# (usually {usual}).",
        ]
    lines += ["", f"INITIAL_CHECKPOINT_PATH = {checkpoint_path!r}", ""]
    return "\n".join(lines)


# T5GemmaConfig's fields written into model.gin; dtype, dropout, remat and LoRA are the run's.
_T5GEMMA_GEOMETRY = ("vocab_size", "final_logit_softcapping", "decoder_start_id")


def t5gemma_geometry(config: T5GemmaConfig) -> list[str]:
    """The bindings of a T5Gemma model: the config itself (a T5 experiment's model is replaced)
    and every field of each stack, so that no size file's binding outlives the checkpoint's."""
    lines = ["EncoderDecoderModel.config = @T5GemmaConfig()"]
    lines += [f"T5GemmaConfig.{field} = {getattr(config, field)!r}" for field in _T5GEMMA_GEOMETRY]
    stacks = {"encoder": config.encoder}
    if config.decoder != config.encoder:
        stacks["decoder"] = config.decoder
    else:  # None: the encoder's geometry, whatever a size file's decoder/ bindings say
        lines.append("T5GemmaConfig.decoder = None")
    for scope, stack in stacks.items():
        lines.append(f"T5GemmaConfig.{scope} = @{scope}/T5GemmaStack()")
        lines += [
            f"{scope}/T5GemmaStack.{field.name} = {getattr(stack, field.name)!r}"
            for field in dataclasses.fields(stack)
        ]
    return lines


def _parent(path: str) -> str:
    return os.path.dirname(path.rstrip("/"))


# ---------------------------------------------------------------------------------------------
# what `t5tpu convert` runs


def _check_output(output_dir: str, input_path: str, overwrite: bool) -> None:
    """Refuses to write into a non-empty directory without --overwrite, and to write where
    the input is (which --overwrite would delete)."""
    inside = os.path.join(locations.absolute(input_path), "").startswith(
        os.path.join(locations.absolute(output_dir), "")
    )
    if inside:
        raise UserError(f"--output_dir={output_dir} contains --input; choose another directory")
    remote.check_storage(output_dir, "--output_dir")
    output = epath.Path(output_dir)
    if output.exists() and not output.is_dir():
        raise UserError(
            f"--output_dir={output_dir} is a file where a folder should be; move it away or "
            "choose another directory"
        )
    # A staging folder a killed convert left is not output: the next success removes it.
    held = (
        [p for p in output.iterdir() if not p.name.startswith(_STAGING)] if output.exists() else []
    )
    if held and not overwrite:
        raise UserError(
            f"--output_dir={output_dir} already exists and is not empty; pass --overwrite to "
            "replace it, or choose another directory"
        )


def _replace_output(output_dir: str) -> None:
    """Empties the output directory; called only once everything has been read."""
    output = epath.Path(output_dir)
    if output.exists():
        output.rmtree()
    output.mkdir(parents=True, exist_ok=True)


# The folder inside --output_dir where a convert writes before moving its files into place.
_STAGING = ".t5tpu-staging-"
# What `t5tpu convert` names when its output cannot be written.
_SETTING = "--output_dir"


@contextlib.contextmanager
def _written_output(output_dir: str) -> Iterator[str]:
    """The folder to write the new output into: a staging folder inside `output_dir` (so on
    its file system, whatever is mounted where), whose entries replace the folder's own
    (--overwrite) only once the block completes. On a failure the staging folder goes, and
    `output_dir` too if this run made it: what was there is as it was, and the same command
    can be rerun. On gs://, where a rename is a copy, the output is written in place."""
    if locations.is_remote(output_dir):
        _replace_output(output_dir)
        yield output_dir
        return
    made = not os.path.exists(output_dir)
    staging = os.path.join(output_dir, f"{_STAGING}{os.getpid()}")
    try:
        with atomic_files.write_faults(output_dir, _SETTING):
            os.makedirs(staging, exist_ok=True)
        try:
            yield staging
        except (UserError, EnvironmentFault) as e:  # they name the staging folder
            raise _renamed(e, staging, output_dir) from None
        with atomic_files.write_faults(output_dir, _SETTING):
            for name in os.listdir(output_dir):
                old = os.path.join(output_dir, name)
                if old != staging:
                    _remove(old)
            for name in os.listdir(staging):
                os.rename(os.path.join(staging, name), os.path.join(output_dir, name))
            os.rmdir(staging)
    except BaseException:
        shutil.rmtree(output_dir if made else staging, ignore_errors=True)
        raise


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.remove(path)


def _renamed(error: Exception, staging: str, output_dir: str) -> Exception:
    if isinstance(error, EnvironmentFault):
        cause = error.cause.replace(staging, output_dir)
        return EnvironmentFault(error.path.replace(staging, output_dir), cause)
    return UserError(str(error).replace(staging, output_dir))


def save_params(output_dir: str, step: int, params) -> str:
    """Writes output_dir/checkpoint_<step>/params with orbax (parameters only); returns the
    checkpoint directory. A full disk is save_guards' EnvironmentFault, the partial save gone."""
    mngr = checkpoints.manager(output_dir)
    with save_guards.disk_faults(mngr, step):
        mngr.save(step, args=ocp.args.Composite(params=ocp.args.StandardSave(params)), force=True)
        mngr.wait_until_finished()
    mngr.close()
    return checkpoint_dir(output_dir, step)


def _count(params) -> int:
    return sum(x.size for x in jax.tree_util.tree_leaves(params))


def to_t5tpu(
    *, input_path: str, output_dir: str, source: str | None, overwrite: bool, command: str
) -> None:
    """Writes a Hugging Face, T5X or Mesh TF checkpoint (`source`, else detected) as
    output_dir/checkpoint_<step> plus model.gin; `command` is recorded in model.gin."""
    remote.check_storage(input_path, "--input")
    if not source and loader.is_model_dir(input_path):
        source = "t5tpu"
    source = source or loader.detect_format(input_path, "--input")
    if source not in loader.IMPORTERS:
        raise UserError(
            f"{input_path} is a {source} checkpoint already; `t5tpu convert --to=hf` exports it "
            "(a LoRA run's adapters alone, for PEFT: --lora=adapters)"
        )
    _check_output(output_dir, input_path, overwrite)
    reader = loader.IMPORTERS[source](input_path)
    config = reader.config()
    step = reader.step
    params = reader.load(param_shapes.abstract_params(config, unrolled=True))
    vocabulary = reader.vocabulary()

    output_dir = locations.absolute(output_dir)
    checkpoint = checkpoint_dir(output_dir, step)
    model_file = vocabulary.model_file and epath.Path(vocabulary.model_file).read_bytes()
    if model_file:  # model.gin names the copy, which moves with the checkpoint
        copied = os.path.join(output_dir, hf_tokenizer.VOCABULARY_FILE)
        vocabulary = dataclasses.replace(vocabulary, model_file=copied)
    assumed = "" if source == "hf" else loader.assumptions(config)
    text = model_gin(
        config,
        checkpoint_path=checkpoint,
        vocabulary=vocabulary,
        command=command,
        assumed=assumed,
    )
    gin_path = os.path.join(output_dir, MODEL_GIN)
    with _written_output(output_dir) as folder:
        save_params(folder, step, params)
        if model_file:
            copy = os.path.join(folder, hf_tokenizer.VOCABULARY_FILE)
            atomic_files.write_atomically(copy, model_file, setting=_SETTING)
        atomic_files.write_atomically(os.path.join(folder, MODEL_GIN), text, setting=_SETTING)
    print(
        f"wrote {checkpoint} ({_count(params):,} parameters) and {gin_path}; fine-tune with: "
        f"t5tpu train --gin_file=EXPERIMENT.gin --gin_file={gin_path}",
        flush=True,
    )


def _export_source(path: str) -> loader.Checkpoint:
    """A t5tpu checkpoint_<step> directory, or the newest in a MODEL_DIR, opened."""
    remote.check_storage(path, "--input")
    if not epath.Path(path).is_dir():
        raise UserError(f"--input={path} is not a directory; give a t5tpu checkpoint_<step>")
    if not (loader.is_step_dir(path) or loader.is_model_dir(path)):
        raise UserError(
            f"--input={path} holds no t5tpu checkpoint; give a MODEL_DIR or its checkpoint_<step>"
        )
    return loader.open_checkpoint(path, setting="--input")


LORA_OUTPUTS = ("merged", "adapters", "base")


def _export_adapters(checkpoint: loader.Checkpoint, config: T5Config, output_dir: str) -> None:
    """A LoRA checkpoint's adapters alone, in PEFT's format."""
    adapters = checkpoint.adapters(param_shapes.abstract_params(config, unrolled=True))
    with _written_output(output_dir) as folder:
        peft_format.export(jax.device_get(adapters), checkpoint.lora.settings, config, folder)
    print(
        f"wrote the LoRA adapters of {checkpoint.path} to {output_dir} in PEFT's format; load "
        f"them with peft.PeftModel.from_pretrained(MODEL, '{output_dir}') onto the base as "
        f"they were trained on it: t5tpu convert --lora=base --input={checkpoint.path}",
        flush=True,
    )


def to_hf(
    *,
    input_path: str,
    output_dir: str,
    source: str | None,
    overwrite: bool,
    gin_files: list[str],
    lora_output: str = "merged",
) -> None:
    """Writes the t5tpu checkpoint at `input_path` (a checkpoint_<step>, or a MODEL_DIR's
    newest) as a Hugging Face directory; `gin_files` describe its model (default: the model.gin
    or config.gin beside it). A LoRA run's checkpoint is written merged into its base; with
    `lora_output='adapters'` as its adapters in PEFT's format, with 'base' as the base the
    adapters were trained on (rounded to lora.base_dtype, as training saw it): PEFT's adapters
    on that base are the model t5tpu runs."""
    if source not in (None, "t5tpu"):
        raise UserError("--to=hf exports a t5tpu checkpoint; drop --from")
    if lora_output not in LORA_OUTPUTS:
        raise UserError(f"--lora={lora_output!r}; use one of {', '.join(LORA_OUTPUTS)}")
    checkpoint = _export_source(input_path)  # a half-copied one: one line, nothing written
    _check_output(output_dir, input_path, overwrite)
    if lora_output != "merged" and checkpoint.lora is None:
        raise UserError(f"--lora={lora_output}: {input_path} is not a LoRA run's checkpoint")
    model = checkpoint.model(gin_files)
    if lora_output == "adapters":
        _export_adapters(checkpoint, model.config, output_dir)
        return
    abstract = param_shapes.abstract_params(model.config, unrolled=True)
    if lora_output == "base":
        parts = checkpoint.load_apart(abstract)
        params = lora.base_as_trained(parts.base, parts.settings.base_dtype)
    else:
        params = checkpoint.load(abstract)
    _write_hf(checkpoint, model, jax.device_get(params), output_dir)


def _write_hf(checkpoint: loader.Checkpoint, model, params, output_dir: str) -> None:
    """The Hugging Face directory of `params`, a model of `checkpoint`, with its run record."""
    record = checkpoint.run_record()
    gemma = isinstance(model.config, T5GemmaConfig)
    # T5Gemma's directories are written by its own module (its names, ids and vocabulary file).
    export = hf_t5gemma.export if gemma else hf_format.export
    with _written_output(output_dir) as folder:
        export(
            params,
            model.config,
            folder,
            vocabulary_source.of_vocabulary(model.vocabulary),
            record=record,
        )
    loads = (
        f"transformers.T5GemmaForConditionalGeneration.from_pretrained('{output_dir}')"
        if gemma
        else f"transformers.T5ForConditionalGeneration.from_pretrained('{output_dir}'), or "
        f"pipeline('text2text-generation', model='{output_dir}'), which answers as t5tpu does"
    )
    print(
        f"wrote {output_dir} from {checkpoint.path} ({_count(params):,} parameters); load it "
        f"with {loads}",
        flush=True,
    )
    notes = hf_run_record.notes(record)
    if not gemma:  # the tokenizer notes are about T5Tokenizer's files, which T5Gemma's lack
        notes += _tokenizer_notes(model.vocabulary, output_dir)
    for note in notes:
        print(f"t5tpu: note: {note}", flush=True)


def _tokenizer_notes(vocabulary, output_dir: str) -> list[str]:
    pieces = hf_tokenizer.user_defined_pieces(vocabulary_source.of_vocabulary(vocabulary))
    if not pieces:
        return []
    return [
        f"the vocabulary's user-defined pieces ({', '.join(pieces[:3])}) are split otherwise by "
        "transformers' fast tokenizer: for t5tpu's ids on text holding them, load "
        f"AutoTokenizer.from_pretrained('{output_dir}', use_fast=False) for the pipeline"
    ]
