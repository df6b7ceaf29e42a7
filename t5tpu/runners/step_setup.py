"""What a train step is made of, the one interface of both kinds of `t5tpu train` run: the
parts every run has (StepParts), where its steps start (StartPoint), the StepSetup protocol
the run reads, and FullStepSetup (every weight trained). runners/lora_run.py holds the other
kind, LoraStepSetup (adapters on a frozen base), built from the same parts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import jax
import jax.numpy as jnp

from t5tpu.model.encoder_decoder import EncoderDecoderModel
from t5tpu.partitioning import Partitioner
from t5tpu.storage import checkpoints
from t5tpu.training import trainer

if TYPE_CHECKING:  # the loader imports TensorFlow (Mesh TF's reader): not at gin parsing
    from t5tpu.formats.loader import Checkpoint


@dataclasses.dataclass(frozen=True)
class StartPoint:
    """Where a run's steps and its input stream start (runners/train.py's docstring)."""

    resume: checkpoints.ResumePoint | None
    # INITIAL_CHECKPOINT_PATH, opened where the run reads it (train.py's _initial_checkpoint).
    initial_checkpoint: Checkpoint | None
    # The step before the input stream's first batch; also the first step of a run that does
    # not resume (a pretrained checkpoint's, else 0).
    input_start_step: int
    last_step: int


@dataclasses.dataclass(frozen=True)
class StepParts:
    """What the gin config gives every run's step: the plain model, its optimizer, the
    partitioner whose mesh the state lives on, the model's (input, target) lengths and the
    microbatches a batch is split into."""

    model: EncoderDecoderModel
    optimizer: object
    partitioner: Partitioner
    lengths: tuple[int, int]
    num_microbatches: int


class StepSetup(Protocol):
    """What a train step is made of and where its state lives, the one interface of both kinds
    of run: FullStepSetup (every weight trained) and lora_run.LoraStepSetup (adapters on a
    frozen base). The run reads nothing else of a setup."""

    partitioner: Partitioner  # whose mesh the state lives on
    abstract: trainer.TrainState  # the trained state's shapes
    shardings: trainer.TrainState  # and their shardings

    @property
    def eval_model(self) -> EncoderDecoderModel:
        """The plain model evaluation decodes with, on `eval_params(state.params)`."""

    @property
    def eval_shardings(self):
        """The shardings of `eval_params`' parameters."""

    def eval_params(self, params):
        """The plain parameters to evaluate from the trained ones."""

    def compiled_step(self) -> Callable:
        """The jitted step: (state, batch, dropout_seed) -> (state, metrics)."""

    def fresh_state(self, *, seed: int, start: StartPoint) -> trainer.TrainState:
        """The state of a run that does not resume, at the start point's step."""

    def checkpoint_metadata(self) -> dict:
        """What every checkpoint records of the setup besides the state."""


@dataclasses.dataclass(frozen=True)
class FullStepSetup:
    """StepSetup of a full fine-tuning (or a training from scratch): every weight of the parts'
    model trained by their optimizer."""

    parts: StepParts
    abstract: trainer.TrainState
    shardings: trainer.TrainState

    @classmethod
    def build(cls, parts: StepParts) -> FullStepSetup:
        abstract, shardings = trainer.state_shardings(
            parts.model, parts.optimizer, parts.partitioner
        )
        return cls(parts, abstract, shardings)

    @property
    def partitioner(self) -> Partitioner:
        return self.parts.partitioner

    def compiled_step(self):
        p = self.parts
        return trainer.compile_train_step(
            p.model, p.optimizer, self.shardings, p.partitioner, p.num_microbatches
        )

    # A LoRA run's (lora_run.py) merges its adapters into the base for evaluation and names
    # the base in every checkpoint.
    @property
    def eval_model(self) -> EncoderDecoderModel:
        return self.parts.model

    @property
    def eval_shardings(self):
        return self.shardings.params

    def eval_params(self, params):
        return params

    def checkpoint_metadata(self) -> dict:
        return {}

    def fresh_state(self, *, seed: int, start: StartPoint) -> trainer.TrainState:
        """Random, or with INITIAL_CHECKPOINT_PATH's parameters."""
        params = None
        initial = start.initial_checkpoint
        if initial:
            # A t5tpu checkpoint_N, a Hugging Face directory, a T5X or a Mesh TF checkpoint.
            params = initial.load(self.abstract.params, self.shardings.params)
            print(
                f"initialized parameters from {initial.path} (step {start.input_start_step})",
                flush=True,
            )

        def init(rng, params):
            p = self.parts
            state = trainer.initial_state(p.model, p.optimizer, rng, *p.lengths, params)
            return state.replace(step=jnp.int32(start.input_start_step))

        return jax.jit(init, out_shardings=self.shardings)(jax.random.PRNGKey(seed), params)
