"""The one loader: any checkpoint t5tpu reads, opened once and restored as the caller asks.

`open_checkpoint(path)` takes a t5tpu MODEL_DIR (its newest readable checkpoint, or `step`'s),
a t5tpu checkpoint_<step>, a Hugging Face T5 directory, or a T5X / Mesh TF checkpoint, and finds
its format once (each storage question is a round trip on gs://); `in_model_dir` opens a step
of a MODEL_DIR the runners have already listed. The Checkpoint it returns says which model it
holds (`model()`: the gin files given, else the model.gin or config.gin beside a t5tpu
checkpoint, read here and nowhere else) and restores its parameters onto the caller's shapes,
shardings and dtype (`load()`).

A LoRA run's checkpoint holds its adapters alone (storage/lora_checkpoints.py) and names its
base (path and fingerprint): `load()` opens that base here, in whatever format it is, after
checking its fingerprint, and merges the adapters into the base as they were trained on it
(model/lora.py's base_as_trained); `load_apart()` keeps them apart for a caller that runs the
adapted network. A LoRA checkpoint without its model gin, without its base, or whose base has
changed is refused in one line. `t5tpu.load`, eval, infer, INITIAL_CHECKPOINT_PATH and
`t5tpu convert` all read checkpoints here.
"""

from __future__ import annotations

import dataclasses
import os

import jax
from etils import epath

from t5tpu.config import checkpoint_gin
from t5tpu.data import vocab
from t5tpu.errors import UserError
from t5tpu.formats import checkpoint_reader, hf_format, hf_t5gemma, mesh_tf_format, t5x_format
from t5tpu.model import layer_stacking, lora, param_shapes, precision
from t5tpu.model.network import T5Config
from t5tpu.storage import checkpoints, locations, lora_checkpoints, remote
from t5tpu.storage import model_dir as paths
from t5tpu.storage.lora_checkpoints import AdapterRecord
from t5tpu.storage.run_record import RunRecord


class _HFDirectory:
    """A Hugging Face directory's reader: T5Gemma's for a config.json of model_type 't5gemma'
    (hf_t5gemma.py), else T5's (hf_format.py)."""

    recognizes = staticmethod(hf_format.HFCheckpoint.recognizes)

    def __new__(cls, path: str) -> checkpoint_reader.CheckpointReader:
        if hf_t5gemma.T5GemmaCheckpoint.recognizes(path):
            return hf_t5gemma.T5GemmaCheckpoint(path)
        return hf_format.HFCheckpoint(path)


# The formats t5tpu imports (checkpoint_reader.CheckpointReader), in the order detect_format tries.
IMPORTERS: dict[str, type[checkpoint_reader.CheckpointReader]] = {
    "hf": _HFDirectory,
    "t5x": t5x_format.T5XCheckpoint,
    "mesh_tf": mesh_tf_format.MeshTFCheckpoint,
}
# What errors call a LoRA checkpoint's base.
BASE_SETTING = "the LoRA run's base"


@dataclasses.dataclass(frozen=True)
class StepDir:
    """A t5tpu checkpoint_<step> directory: its MODEL_DIR (absolute, as orbax needs) and step."""

    model_dir: str
    step: int


def named_step_dir(path: str) -> StepDir | None:
    """The StepDir that `path` names (checkpoint_<step>), from its name alone, else None."""
    path = locations.absolute(path.rstrip("/"))
    step = paths.step_of(path)
    return None if step is None else StepDir(os.path.dirname(path), step)


def _t5tpu_step_dir(path: str) -> StepDir | None:
    """The StepDir of a t5tpu checkpoint_<step> directory (it holds params/), else None."""
    named = named_step_dir(path)
    return named if named and epath.Path(path, "params").is_dir() else None


def is_step_dir(path: str) -> bool:
    """Whether `path` is a t5tpu checkpoint_<step> directory."""
    return _t5tpu_step_dir(path) is not None


def is_model_dir(path: str) -> bool:
    """Whether `path` is a t5tpu MODEL_DIR: a folder of checkpoint_<step> folders with params/
    (T5X's model dirs hold checkpoint_<step> folders too, without params/)."""
    folder = epath.Path(path)
    return folder.is_dir() and any(folder.glob(f"{paths.STEP_PREFIX}_*/params"))


def checkpoint_path(path: str, step: int | None = None) -> str:
    """The checkpoint `open_checkpoint(path, step=step)` reads: a MODEL_DIR's newest readable
    one (or `step`'s), else `path` itself."""
    if is_model_dir(path):
        found = checkpoints.steps_to_restore(path, "latest" if step is None else step)
        return paths.checkpoint_dir(path, found[0])
    if step is not None:
        raise UserError(f"step={step} picks a checkpoint of a t5tpu MODEL_DIR; {path} is not one")
    return path


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
        "checkpoint_<step> directory or MODEL_DIR"
    )


def open_checkpoint(
    path: str, *, step: int | None = None, setting: str = "INITIAL_CHECKPOINT_PATH"
) -> Checkpoint:
    """The checkpoint at `path` (see the module docstring), its format found once; `setting`
    names the path in errors."""
    path = checkpoint_path(path, step)
    source = detect_format(path, setting)
    if source == "t5tpu":
        named = named_step_dir(path)
        return in_model_dir(named.model_dir, named.step)
    return Checkpoint(path=path, format=source, reader=IMPORTERS[source](path))


def in_model_dir(model_dir: str, step: int) -> Checkpoint:
    """Checkpoint `step` of a t5tpu MODEL_DIR, known to be there (the runners list the steps
    first), with its LoRA record if it is a LoRA run's."""
    model_dir = locations.absolute(model_dir.rstrip("/"))
    # A damaged one is refused in one line before orbax reads it: its metadata in a traceback,
    # or a restore that fails part-way, its worker threads printing tracebacks.
    checkpoints.check_readable(model_dir, step)
    mngr = checkpoints.manager(model_dir, read_only=True)
    return Checkpoint(
        path=paths.checkpoint_dir(model_dir, step),
        format="t5tpu",
        step_dir=StepDir(model_dir, step),
        lora=lora_checkpoints.record_of(mngr, step),
        manager=mngr,
    )


@dataclasses.dataclass(frozen=True)
class ModelDescription:
    """The model a checkpoint holds: its geometry, its vocabulary (None: the gin files bind
    none, or there are none), and the gin files that said so (none: read from the shapes)."""

    config: T5Config
    vocabulary: object | None
    gin_files: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class LoraParts:
    """A LoRA checkpoint read with its adapters apart: `base` as its checkpoint holds it (run it
    as trained through lora.base_as_trained(base, settings.base_dtype), inside the program) and
    the float32 `adapters`, both placed like the kernels they belong to."""

    base: object
    adapters: object
    settings: lora.LoraSettings


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """An opened checkpoint: a t5tpu checkpoint_<step> (`step_dir`, and `lora` for a LoRA
    run's) or an imported one read through `reader`."""

    path: str
    format: str  # 'hf', 't5x', 'mesh_tf' or 't5tpu'
    reader: checkpoint_reader.CheckpointReader | None = None
    step_dir: StepDir | None = None
    lora: AdapterRecord | None = None
    # The t5tpu checkpoint's orbax manager, read-only (made once: it lists the MODEL_DIR).
    manager: object = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def step(self) -> int:
        """The training step it was saved at (0 for Hugging Face)."""
        return self.step_dir.step if self.step_dir else self.reader.step

    def model(self, gin_files: list[str] | tuple[str, ...] = ()) -> ModelDescription:
        """The model `gin_files` describe, else the model.gin or config.gin beside a t5tpu
        checkpoint (else its geometry from its shapes, no vocabulary), else an imported
        checkpoint's own description (config.json and spiece.model; T5X and Mesh TF record
        neither vocabulary nor activations: T5 1.1's, without a vocabulary)."""
        gin_files = list(gin_files)
        if self.step_dir:
            gin_files = gin_files or self._gin_beside()
            return model_from_gin(gin_files, None if self.lora else self._shapes())
        if gin_files:  # names and shapes are checked against the checkpoint when it is read
            return model_from_gin(gin_files, None)
        reader = self.reader
        return ModelDescription(reader.config(), reader.vocabulary().load(), ())

    def run_record(self) -> RunRecord | None:
        """What the run that saved it decided about its inputs and outputs (its task, lengths,
        input shaping, decoding); a Hugging Face directory's as its config files say (the
        export writes them); None when the checkpoint does not say (one saved before runs
        recorded theirs, a conversion, T5X and Mesh TF)."""
        if self.step_dir:  # read here, parsed there: one module fewer on the way to the files
            return RunRecord.from_metadata(
                checkpoints.custom_metadata(self.manager, self.step), self.path
            )
        return self.reader.run_record()

    def _gin_beside(self) -> list[str]:
        run_dir = self.step_dir.model_dir
        beside = [os.path.join(run_dir, name) for name in (paths.MODEL_GIN, paths.TRAIN_CONFIG)]
        found = [path for path in beside if epath.Path(path).exists()][:1]
        if not found and self.lora:
            raise UserError(
                f"{self.path} holds LoRA adapters and {run_dir} has no {paths.MODEL_GIN} or "
                f"{paths.TRAIN_CONFIG} to say which model they adapt; put the run's "
                f"{paths.TRAIN_CONFIG} back, or give the model gin file it was trained with"
            )
        return found

    def _shapes(self) -> dict[str, tuple]:
        return checkpoints.flat_shapes(self.manager.item_metadata(self.step)["params"])

    def check_geometry(self, abstract_params) -> None:
        """Refuses, listing the differences, a t5tpu checkpoint (or its adapters) that is not
        of the model `abstract_params` describe; imported ones are checked as they are read."""
        if self.lora:
            unrolled = layer_stacking.unstack_layers(abstract_params)
            expected = lora.adapter_shapes(unrolled, None, self.lora.settings)
            lora_checkpoints.check_geometry(self.manager, self.step, expected)
        elif self.step_dir:
            checkpoints.check_geometry(self.manager, self.step, abstract_params)

    def load(self, abstract_params, shardings=None, *, dtype: str | None = None):
        """Plain parameters like `abstract_params`: a LoRA run's with its adapters merged into
        its base. Names and shapes are checked against the model before anything is read, a
        mismatch a UserError listing them. With `shardings` (a tree like the parameters) each
        array is placed as it is read; without, t5tpu checkpoints come back on the first device
        and imported ones as numpy arrays. float32, or `dtype`'s floating leaves."""
        if self.lora:
            params = self._merged(abstract_params, shardings)
        elif self.step_dir:
            params = self._restored(abstract_params, shardings)
        else:
            params = self._imported(abstract_params, shardings)
        return params if dtype is None else precision.cast_params(params, dtype, shardings)

    def load_apart(self, abstract_params, shardings=None) -> LoraParts:
        """A LoRA run's base (its fingerprint checked) and adapters, apart."""
        if not self.lora:
            raise UserError(f"{self.path} is not a LoRA run's checkpoint; load it whole")
        self.lora.base.check(self.path)
        base = open_checkpoint(self.lora.base.path, setting=BASE_SETTING)
        return LoraParts(
            base=base.load(abstract_params, shardings),
            adapters=self.adapters(abstract_params, shardings),
            settings=self.lora.settings,
        )

    def adapters(self, abstract_params, shardings=None):
        """A LoRA run's adapters alone (float32, placed like the kernels they adapt), checked
        against the ones the model's kernels (`abstract_params`) take."""
        if not self.lora:
            raise UserError(f"{self.path} is not a LoRA run's checkpoint; it holds no adapters")
        self.check_geometry(abstract_params)
        placed = _placed(abstract_params, shardings)
        targets = lora.adapter_shapes(abstract_params, placed, self.lora.settings)
        return lora_checkpoints.restore_adapters(self.manager, self.step, targets)

    def _restored(self, abstract_params, shardings):
        return checkpoints.restore_params(
            self.manager, self.step, abstract_params, _placed(abstract_params, shardings)
        )

    def _imported(self, abstract_params, shardings):
        # Every format holds layers unrolled (layers_N); a model that scans its layers gets
        # them stacked after reading.
        unrolled, unrolled_shardings = layer_stacking.unrolled_targets(abstract_params, shardings)
        params = self.reader.load(unrolled, unrolled_shardings)
        return layer_stacking.stack_onto(params, abstract_params, shardings)

    def _merged(self, abstract_params, shardings):
        parts = self.load_apart(abstract_params, shardings)
        settings = parts.settings

        def merged(base, adapters):
            return lora.merge(lora.base_as_trained(base, settings.base_dtype), adapters, settings)

        shardings = _placed(abstract_params, shardings)
        return jax.jit(merged, out_shardings=shardings, donate_argnums=(0,))(
            parts.base, parts.adapters
        )


def _placed(abstract_params, shardings):
    """`shardings`, or else the first device for every parameter."""
    if shardings is not None:
        return shardings
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree_util.tree_map(lambda _: device, abstract_params)


# ---------------------------------------------------------------------------------------------
# the model a checkpoint's gin files describe


def assumptions(config: T5Config) -> str:
    """What a checkpoint without a model description is taken to be, beyond its shapes."""
    gated = len(config.mlp_activations) == 2
    activation = "gated-GELU feed-forward (wi_0/wi_1)" if gated else "ReLU feed-forward"
    return f"{activation}, relative_attention_max_distance = 128"


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
    config = checkpoint_gin.bound_model_config() or T5Config()
    return _GinModel(
        config=config,
        vocabulary=vocab.default_vocabulary() if bound else None,
        shapes=checkpoints.flat_shapes(param_shapes.abstract_params(config, unrolled=True)),
    )


def model_from_gin(gin_files: list[str], shapes: dict[str, tuple] | None) -> ModelDescription:
    """The model the gin files bind (local or gs://), checked against the checkpoint's shapes
    (None: checked when the parameters are read); without gin files, the geometry the shapes
    give and no vocabulary."""
    if not gin_files:
        flat = {name: checkpoint_reader.flat_layout_shape(name, s) for name, s in shapes.items()}
        config = checkpoint_reader.config_from_flat_shapes(flat)
        print(f"no model gin file: assuming {assumptions(config)}; no vocabulary", flush=True)
        return ModelDescription(config, None, ())
    try:
        # Read apart from the caller's gin config, which is left as it was.
        with checkpoint_gin.parsed(gin_files):
            model = _gin_model()
    except (OSError, ValueError, SyntaxError) as e:
        raise UserError(f"cannot read the model from {', '.join(gin_files)}: {e}") from None
    differences = shapes is not None and checkpoints.geometry_differences(shapes, model.shapes)
    if differences:
        raise UserError(
            f"{', '.join(gin_files)} describe another model than the checkpoint ({differences}); "
            "pass --gin_file with the checkpoint's model gin file"
        )
    return ModelDescription(model.config, model.vocabulary, tuple(gin_files))
