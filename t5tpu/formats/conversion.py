"""Pretrained T5 weights in (Hugging Face, T5X, Mesh TF) and out (Hugging Face).

`open_checkpoint` is what the train runner (INITIAL_CHECKPOINT_PATH) and `t5tpu.load` call.
`to_t5tpu` and `to_hf` are what `t5tpu convert` runs (its flags are t5tpu.cli.convert's):

- to_t5tpu writes DIR/checkpoint_<step>/params (orbax, parameters only; the step is the
  source's: 0 for Hugging Face) and DIR/model.gin: the model's geometry, the source's vocabulary
  if it has one, and INITIAL_CHECKPOINT_PATH, so that
  `t5tpu train --gin_file=EXPERIMENT --gin_file=DIR/model.gin` fine-tunes from it.
- to_hf writes a Hugging Face directory from a t5tpu checkpoint_<step> (or the newest one of a
  MODEL_DIR). What shapes cannot tell (the gated activation, the relative position distance,
  the vocabulary) comes from the gin files given, else from the model.gin or config.gin beside
  the checkpoint.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import tempfile
from collections.abc import Iterator

import jax
import orbax.checkpoint as ocp
from etils import epath

from t5tpu.config import checkpoint_gin
from t5tpu.data import vocab
from t5tpu.errors import EnvironmentFault, UserError
from t5tpu.formats import (
    checkpoint_reader,
    hf_format,
    hf_tokenizer,
    mesh_tf_format,
    peft_format,
    t5x_format,
    vocabulary_source,
)
from t5tpu.formats.vocabulary_source import VocabularySource
from t5tpu.model import layer_stacking
from t5tpu.model.network import T5Config
from t5tpu.storage import (
    adapted_checkpoints,
    atomic_files,
    checkpoints,
    remote,
    save_guards,
    user_files,
)
from t5tpu.storage.model_dir import MODEL_GIN, TRAIN_CONFIG, checkpoint_dir, step_of

# The formats t5tpu imports (checkpoint_reader.CheckpointReader), in the order detect_format tries.
IMPORTERS: dict[str, type[checkpoint_reader.CheckpointReader]] = {
    "hf": hf_format.HFCheckpoint,
    "t5x": t5x_format.T5XCheckpoint,
    "mesh_tf": mesh_tf_format.MeshTFCheckpoint,
}
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
)

# ---------------------------------------------------------------------------------------------
# what the train runner calls


def _absolute(path: str) -> str:
    return path if "://" in path else os.path.abspath(path)


@dataclasses.dataclass(frozen=True)
class StepDir:
    """A t5tpu checkpoint_<step> directory: its MODEL_DIR (absolute, as orbax needs) and step."""

    model_dir: str
    step: int


def _named_step_dir(path: str) -> StepDir | None:
    """The StepDir that `path` names (checkpoint_<step>), from its name alone, else None."""
    path = _absolute(path.rstrip("/"))
    step = step_of(path)
    return None if step is None else StepDir(os.path.dirname(path), step)


def _t5tpu_step_dir(path: str) -> StepDir | None:
    """The StepDir of a t5tpu checkpoint_<step> directory (it holds params/), else None."""
    named = _named_step_dir(path)
    return named if named and epath.Path(path, "params").is_dir() else None


def detect_format(path: str, setting: str = "INITIAL_CHECKPOINT_PATH") -> str:
    """'hf', 't5x', 'mesh_tf' or 't5tpu' (an orbax checkpoint_<step> directory); `setting`
    names the path in errors."""
    remote.check_storage(path, setting)
    # Every question below is one for storage: answered within the storage answer time, and
    # a file that cannot be read (permissions) is one line.
    try:
        return remote.answered(lambda: _detected_format(path), path=path, setting=setting)
    except OSError as e:
        raise UserError(
            f"{setting}={path} cannot be read ({e.strerror or e}); check its permissions"
        ) from None


def _detected_format(path: str) -> str:
    if not epath.Path(path).exists() and not epath.Path(f"{path}.index").exists():  # Mesh TF
        raise UserError(f"checkpoint {path} does not exist")
    if _t5tpu_step_dir(path):
        return "t5tpu"
    for source, reader in IMPORTERS.items():
        if reader.recognizes(path):
            return source
    raise UserError(
        f"{path} is not a checkpoint t5tpu reads: expected a Hugging Face directory "
        "(config.json + model.safetensors), a T5X checkpoint_<step> directory (msgpack "
        "`checkpoint` file), a Mesh TF model.ckpt-<step> prefix or its directory, or a t5tpu "
        "checkpoint_<step> directory"
    )


def _single_device(abstract_params):
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree_util.tree_map(lambda _: device, abstract_params)


@dataclasses.dataclass(frozen=True)
class OpenedCheckpoint:
    """A checkpoint whose format was found once (each storage question is a round trip on
    gs://): a t5tpu checkpoint_<step> (`step_dir`) or one read through `reader`."""

    path: str
    format: str  # 'hf', 't5x', 'mesh_tf' or 't5tpu'
    reader: checkpoint_reader.CheckpointReader | None = None
    step_dir: StepDir | None = None

    @property
    def step(self) -> int:
        """The training step it was saved at (0 for Hugging Face)."""
        return self.step_dir.step if self.step_dir else self.reader.step

    def load(self, abstract_params, shardings=None):
        """The parameters, as a tree like `abstract_params` (float32). Names and shapes are
        checked against the model before anything is read: a mismatch is a UserError listing
        them. With `shardings` (a tree of shardings like the parameters) each array is placed
        as it is read; without, they are numpy arrays (t5tpu checkpoints come back on the first
        device). Every format holds layers unrolled (layers_N); for a model that scans its
        layers they are stacked after reading."""
        if self.step_dir:
            model_dir, step = self.step_dir.model_dir, self.step_dir.step
            # A damaged one is refused in one line before orbax starts: a restore that fails
            # part-way leaves its worker threads printing tracebacks.
            checkpoints.check_readable(model_dir, step)
            return adapted_checkpoints.restore_params(
                checkpoints.manager(model_dir, read_only=True),
                step,
                abstract_params,
                shardings if shardings is not None else _single_device(abstract_params),
                load_base=load_base,  # a LoRA run's checkpoint: its base, adapters merged
            )
        unrolled, unrolled_shardings = layer_stacking.unrolled_targets(abstract_params, shardings)
        params = self.reader.load(unrolled, unrolled_shardings)
        return layer_stacking.stack_onto(params, abstract_params, shardings)


def load_base(path: str, abstract_params, shardings):
    """A LoRA run's base checkpoint (any format), as OpenedCheckpoint.load reads it."""
    return open_checkpoint(path, "the LoRA run's base").load(abstract_params, shardings)


def open_checkpoint(path: str, setting: str = "INITIAL_CHECKPOINT_PATH") -> OpenedCheckpoint:
    """The checkpoint at `path`, in any format detect_format knows, its format found once;
    `setting` names the path in errors."""
    source = detect_format(path, setting)
    if source == "t5tpu":
        return OpenedCheckpoint(path, source, step_dir=_named_step_dir(path))
    return OpenedCheckpoint(path, source, reader=IMPORTERS[source](path))


# ---------------------------------------------------------------------------------------------
# model.gin


def model_gin(
    config: T5Config,
    checkpoint_path: str,
    vocabulary: VocabularySource,
    command: str,
    assumed: str = "",
) -> str:
    lines = [
        f"# Written by `{command}`.",
        "# The converted model's geometry, vocabulary and weights. Give it after an experiment:",
        "#   t5tpu train --gin_file=EXPERIMENT.gin "
        f"--gin_file={os.path.join(_parent(checkpoint_path), MODEL_GIN)}",
    ]
    if assumed:
        lines.append(f"# Not in the checkpoint, assumed as in T5: {assumed}.")
    lines.append("")
    lines += [f"T5Config.{field} = {getattr(config, field)!r}" for field in _GEOMETRY]
    lines.append("")
    lines += vocabulary.gin_bindings()
    if vocabulary.kind == vocabulary_source.NONE:
        lines += [
            "# The checkpoint carries no vocabulary: the experiment's model gin binds it (T5's:",
            "# gs://t5-data/vocabs/cc_all.32000/sentencepiece.model, 100 extra ids).",
        ]
    lines += ["", f"INITIAL_CHECKPOINT_PATH = {checkpoint_path!r}", ""]
    return "\n".join(lines)


def _parent(path: str) -> str:
    return os.path.dirname(path.rstrip("/"))


# ---------------------------------------------------------------------------------------------
# what `t5tpu convert` runs


def _check_output(output_dir: str, input_path: str, overwrite: bool) -> None:
    """Refuses to write into a non-empty directory without --overwrite, and to write where
    the input is (which --overwrite would delete)."""
    inside = os.path.join(_absolute(input_path), "").startswith(
        os.path.join(_absolute(output_dir), "")
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
    if "://" in output_dir:
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
    source = source or detect_format(input_path, "--input")
    if source not in IMPORTERS:
        raise UserError(
            f"{input_path} is a {source} checkpoint already; `t5tpu convert --to=hf` exports it"
        )
    _check_output(output_dir, input_path, overwrite)
    reader = IMPORTERS[source](input_path)
    config = reader.config()
    step = reader.step
    params = reader.load(checkpoint_reader.abstract_params(config))
    vocabulary = reader.vocabulary()

    output_dir = _absolute(output_dir)
    checkpoint = checkpoint_dir(output_dir, step)
    model_file = vocabulary.model_file and epath.Path(vocabulary.model_file).read_bytes()
    if model_file:  # model.gin names the copy, which moves with the checkpoint
        copied = os.path.join(output_dir, hf_tokenizer.VOCABULARY_FILE)
        vocabulary = dataclasses.replace(vocabulary, model_file=copied)
    assumed = "" if source == "hf" else _assumptions(config)
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


def _assumptions(config: T5Config) -> str:
    gated = len(config.mlp_activations) == 2
    activation = "gated-GELU feed-forward (wi_0/wi_1)" if gated else "ReLU feed-forward"
    return f"{activation}, relative_attention_max_distance = 128"


def _export_source(path: str) -> StepDir:
    """A t5tpu checkpoint_<step> directory, or the newest in a MODEL_DIR."""
    remote.check_storage(path, "--input")
    found = _t5tpu_step_dir(path)
    if found:
        return found
    if not epath.Path(path).is_dir():
        raise UserError(f"--input={path} is not a directory; give a t5tpu checkpoint_<step>")
    model_dir = _absolute(path.rstrip("/"))
    try:
        return StepDir(model_dir, checkpoints.steps_to_restore(model_dir, "latest")[0])
    except UserError:
        raise UserError(
            f"--input={path} holds no t5tpu checkpoint; give a MODEL_DIR or its checkpoint_<step>"
        ) from None


@dataclasses.dataclass(frozen=True)
class _GinModel:
    config: T5Config
    vocabulary: object | None  # None: the gin files bind none
    shapes: dict[str, tuple]  # of the parameters the config gives


def _gin_model() -> _GinModel:
    """The model the parsed gin files bind, its parameters' shapes, and their vocabulary if
    they bind one; all built while those files are the gin config (T5Config is a configurable
    that gin records each time one is made)."""
    bound = any(
        checkpoint_gin.is_bound("default_vocabulary", parameter)
        for parameter in ("sentencepiece_model_file", "kind")
    )
    config = T5Config()
    return _GinModel(
        config=config,
        vocabulary=vocab.default_vocabulary() if bound else None,
        shapes=checkpoints.flat_shapes(checkpoint_reader.abstract_params(config)),
    )


def model_from_gin(gin_files: list[str], shapes: dict[str, tuple] | None):
    """(T5Config, seqio vocabulary or None) bound by the gin files, checked against the
    checkpoint's shapes (None: checked when the parameters are read); without gin files, the
    geometry the shapes give and no vocabulary."""
    if not gin_files:
        flat = {name: checkpoint_reader.flat_layout_shape(name, s) for name, s in shapes.items()}
        config = checkpoint_reader.config_from_flat_shapes(flat)
        print(f"no model gin file: assuming {_assumptions(config)}; no vocabulary", flush=True)
        return config, None
    try:
        # Read apart from the caller's gin config, which is left as it was.
        model = checkpoint_gin.build_from(gin_files, _gin_model)
    except (OSError, ValueError, SyntaxError) as e:
        raise UserError(f"cannot read the model from {', '.join(gin_files)}: {e}") from None
    differences = shapes is not None and checkpoints.geometry_differences(shapes, model.shapes)
    if differences:
        raise UserError(
            f"{', '.join(gin_files)} describe another model than the checkpoint ({differences}); "
            "pass --gin_file with the checkpoint's model gin file"
        )
    return model.config, model.vocabulary


def _readable_gin_files(gin_files: list[str], staging: str) -> list[str]:
    """`gin_files` with remote ones (the config.gin beside a gs:// checkpoint) copied into
    `staging` through epath: gin opens files with open() alone."""
    readable = []
    for index, path in enumerate(gin_files):
        if "://" in path:
            local = os.path.join(staging, f"{index}_{os.path.basename(path)}")
            epath.Path(local).write_bytes(user_files.read_bytes(path, what="--gin_file"))
            path = local
        readable.append(path)
    return readable


LORA_OUTPUTS = ("merged", "adapters")


def _export_adapters(mngr, step: int, record, config: T5Config, output_dir: str) -> None:
    """A LoRA checkpoint's adapters alone, in PEFT's format."""
    abstract = checkpoint_reader.abstract_params(config)
    adapters = adapted_checkpoints.restore_adapters(
        mngr, step, abstract, _single_device(abstract), record
    )
    with _written_output(output_dir) as folder:
        peft_format.export(jax.device_get(adapters), record.settings, config, folder)
    print(
        f"wrote the LoRA adapters of {checkpoint_dir(str(mngr.directory), step)} to {output_dir} "
        f"in PEFT's format; load them with peft.PeftModel.from_pretrained(MODEL, "
        f"'{output_dir}') onto the Hugging Face export of the base {record.base.path}",
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
    or config.gin beside it). A LoRA run's checkpoint is written merged into its base, or with
    `lora_output='adapters'` as its adapters in PEFT's format."""
    if source not in (None, "t5tpu"):
        raise UserError("--to=hf exports a t5tpu checkpoint; drop --from")
    if lora_output not in LORA_OUTPUTS:
        raise UserError(f"--lora={lora_output!r}; use one of {', '.join(LORA_OUTPUTS)}")
    source_dir = _export_source(input_path)
    run_dir, step = source_dir.model_dir, source_dir.step
    checkpoints.check_readable(run_dir, step)  # a half-copied one: one line, nothing written
    _check_output(output_dir, input_path, overwrite)
    mngr = checkpoints.manager(run_dir, read_only=True)
    record = adapted_checkpoints.record_of(mngr, step)
    if lora_output == "adapters" and record is None:
        raise UserError(f"--lora=adapters: {input_path} is not a LoRA run's checkpoint")
    shapes = adapted_checkpoints.param_shapes(mngr, step)
    beside = [os.path.join(run_dir, name) for name in (MODEL_GIN, TRAIN_CONFIG)]
    gin_files = gin_files or [path for path in beside if epath.Path(path).exists()][:1]
    with tempfile.TemporaryDirectory(prefix="t5tpu-gin-") as staging:
        readable = _readable_gin_files(gin_files, staging)
        config, vocabulary = model_from_gin(readable, shapes)
    if lora_output == "adapters":
        _export_adapters(mngr, step, record, config, output_dir)
        return
    abstract = checkpoint_reader.abstract_params(config)
    params = adapted_checkpoints.restore_params(
        mngr, step, abstract, _single_device(abstract), load_base=load_base
    )
    with _written_output(output_dir) as folder:
        hf_format.export(
            jax.device_get(params), config, folder, vocabulary_source.of_vocabulary(vocabulary)
        )
    print(
        f"wrote {output_dir} from {checkpoint_dir(run_dir, step)} "
        f"({_count(params):,} parameters); load it with "
        f"transformers.T5ForConditionalGeneration.from_pretrained('{output_dir}')",
        flush=True,
    )
