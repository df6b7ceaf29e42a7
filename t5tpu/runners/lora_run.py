"""The LoRA side of `t5tpu train` (train.method = @lora(), or FINETUNE_METHOD = 'lora'): what a
step is made of, the base it adapts, and where the adapters start.

The base is INITIAL_CHECKPOINT_PATH on a fresh run (any format it takes), fingerprinted and
named in every checkpoint; a resume reads the base its newest checkpoint names, refused in one
line if it is gone or changed, so the adapters are never trained on another base. Evaluation
between steps decodes with the adapters merged into the base (a plain model).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from t5tpu.errors import UserError
from t5tpu.model import encoder_decoder, lora, param_shapes
from t5tpu.model.encoder_decoder import EncoderDecoderModel
from t5tpu.partitioning import Partitioner
from t5tpu.runners.step_setup import StepParts
from t5tpu.storage import checkpoints, lora_checkpoints
from t5tpu.storage import model_dir as paths
from t5tpu.storage.lora_base_fingerprint import BaseReference
from t5tpu.storage.lora_checkpoints import AdapterRecord
from t5tpu.training import lora_base, trainer

METHODS = ("full", "lora")


def settings_of(method) -> lora.LoraSettings | None:
    """train.method: None or 'full' (every weight trained), 'lora' (lora()'s bindings) or
    @lora() itself."""
    if method is None or method == "full":
        return None
    if method == "lora":
        return lora.lora()
    if isinstance(method, lora.LoraSettings):
        return method
    raise UserError(f"FINETUNE_METHOD = {method!r}; use 'full' or 'lora' (see lora.rank etc.)")


def check_resumable(mngr, resume: checkpoints.ResumePoint | None, settings) -> None:
    """Refuses to continue a run with another method, or with other LoRA settings."""
    if resume is None:
        return
    record = lora_checkpoints.record_of(mngr, resume.step)
    where = paths.checkpoint_dir(str(mngr.directory), resume.step)
    if record is None and settings is not None:
        raise UserError(
            f"{where} is of a full fine-tuning run; train LoRA adapters in another MODEL_DIR, "
            "with INITIAL_CHECKPOINT_PATH naming the base"
        )
    if record is not None and settings is None:
        raise UserError(f"{where} holds LoRA adapters; resume it with FINETUNE_METHOD = 'lora'")
    if record is not None and record.settings != settings:
        raise UserError(
            f"{where} was trained with {record.settings}, not {settings}; resume with its "
            f"settings (its {paths.TRAIN_CONFIG}), or use another MODEL_DIR"
        )


def _base_reference(mngr, start) -> BaseReference:
    if start.resume:
        record = lora_checkpoints.record_of(mngr, start.resume.step)
        record.base.check(paths.checkpoint_dir(str(mngr.directory), start.resume.step))
        return record.base
    if not start.initial_checkpoint:
        raise UserError(
            "FINETUNE_METHOD = 'lora' adapts a trained model: set INITIAL_CHECKPOINT_PATH to "
            "the base checkpoint"
        )
    return BaseReference.of(start.initial_checkpoint.path)


@dataclasses.dataclass(frozen=True)
class LoraStepSetup:
    """runners/step_setup.py's StepSetup of a LoRA run: the step trains the adapters of
    `adapted` (its loss runs base and adapters; `abstract` and `shardings` are the adapters'
    train state's) on `base`, which is loaded once; evaluation runs the parts' plain model on
    the merged parameters."""

    parts: StepParts
    adapted: EncoderDecoderModel
    abstract: trainer.TrainState
    shardings: trainer.TrainState
    shapes: lora_base.LoraBaseShapes
    eval_shardings: object
    record: AdapterRecord
    base: object

    @classmethod
    def build(cls, parts: StepParts, *, settings, mngr, start) -> LoraStepSetup:
        reference = _base_reference(mngr, start)
        adapted = encoder_decoder.adapted_model(parts.model, settings)
        shapes = lora_base.state_shardings(adapted, parts.optimizer, parts.partitioner)
        abstract, eval_shardings = param_shapes.sharded_abstract_params(
            parts.model.config, parts.partitioner
        )
        from t5tpu.formats import loader  # as runners/train.py: TensorFlow on first use

        if start.resume:
            opened = loader.open_checkpoint(reference.path, setting=loader.BASE_SETTING)
        else:  # INITIAL_CHECKPOINT_PATH, already opened by train.py
            opened = start.initial_checkpoint
        loaded = opened.load(abstract, eval_shardings)
        dtype = settings.base_dtype

        def as_trained(params):
            # Held in the base dtype (half the memory in bfloat16), as loading and serving
            # round it (model/lora.py).
            return lora.cast(lora.base_as_trained(params, dtype), dtype)

        base = jax.jit(as_trained, out_shardings=shapes.base_shardings, donate_argnums=(0,))(loaded)
        print(f"LoRA on the frozen base {reference.path} ({settings})", flush=True)
        return cls(
            parts=parts,
            adapted=adapted,
            abstract=shapes.abstract,
            shardings=shapes.shardings,
            shapes=shapes,
            eval_shardings=eval_shardings,
            record=AdapterRecord(settings, reference),
            base=base,
        )

    @property
    def partitioner(self) -> Partitioner:
        return self.parts.partitioner

    @property
    def eval_model(self) -> EncoderDecoderModel:
        return self.parts.model

    def compiled_step(self):
        p = self.parts
        step = lora_base.compile_train_step(
            self.adapted, p.optimizer, self.shapes, p.partitioner, p.num_microbatches
        )
        return lambda state, batch, dropout_seed: step(state, self.base, batch, dropout_seed)

    def checkpoint_metadata(self) -> dict:
        return self.record.metadata()

    def eval_params(self, adapters):
        return self._merge(self.base, adapters)

    @functools.cached_property
    def _merge(self):
        # Compiled once for the run's evaluations.
        merge = lambda base, adapters: lora.merge(base, adapters, self.record.settings)
        return jax.jit(merge, out_shardings=self.eval_shardings)

    def fresh_state(self, *, seed: int, start) -> trainer.TrainState:
        """Fresh adapters at the start point's step (the base is INITIAL_CHECKPOINT_PATH)."""

        def init(rng):
            p = self.parts
            state = lora_base.initial_state(self.adapted, p.optimizer, rng, *p.lengths)
            return state.replace(step=jnp.int32(start.input_start_step))

        return jax.jit(init, out_shardings=self.shardings)(jax.random.PRNGKey(seed))
