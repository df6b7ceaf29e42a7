"""The steps of a `t5tpu train` run and the periodic work between them: log, save a checkpoint
(with the input position and, on a resume, the run's config), evaluate, and stop after saving
when SIGTERM arrived. runners/train.py decides where the run starts and builds these."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from t5tpu import validators
from t5tpu.config import gin_setup
from t5tpu.data import batches
from t5tpu.errors import UserError
from t5tpu.runners.evaluator import TaskEvaluator
from t5tpu.storage import checkpoints
from t5tpu.storage import model_dir as paths
from t5tpu.training import trainer
from t5tpu.training.preemption import CtrlCBetweenSteps, PreemptionWatch
from t5tpu.training.progress import Progress


@dataclasses.dataclass(frozen=True)
class Periods:
    """Steps between the loop's periodic work (eval 0: never); the last step always logs, saves
    and evaluates."""

    log: int
    save: int
    eval: int

    def __post_init__(self):
        for name, period in (("SAVE_PERIOD", self.save), ("train.log_period", self.log)):
            validators.whole(low=1).check(name, period, example="1000 (steps between them)")

    def saves(self, step: int, last_step: int) -> bool:
        return step % self.save == 0 or step == last_step

    def logs(self, step: int) -> bool:
        return step % self.log == 0

    def evaluates(self, step: int, last_step: int) -> bool:
        return self.eval != 0 and (step % self.eval == 0 or step == last_step)


class TrainConfig:
    """MODEL_DIR's config.gin, the operative config of the training run. A new run writes it
    before its first step; a resume writes it with its first checkpoint, when steps trained with
    it are kept (a NaN or a crash before it keeps nothing), keeping one with other settings as
    config_to_step_N.gin."""

    def __init__(self, model_dir: str, *, first_step: int, resumed: bool):
        self.path = paths.train_config(model_dir)
        self.earlier_path = paths.kept_train_config_path(model_dir, first_step)
        self._pending = resumed

    def run_started(self) -> None:
        if not self._pending:
            gin_setup.write_operative_config(self.path)

    def checkpoint_saved(self) -> None:
        if self._pending:
            gin_setup.write_operative_config(self.path, self.earlier_path)
            self._pending = False


class Checkpointer:
    """Saves what an exact resume needs: parameters, optimizer state, the step before the input
    stream's first batch (in the checkpoint's metadata) and the stream's position."""

    def __init__(
        self,
        *,
        mngr,
        dtype: str,
        input_start_step: int,
        stream,
        config: TrainConfig,
        damaged_steps: tuple[int, ...] = (),
        metadata: dict | None = None,
    ):
        self.mngr = mngr
        self.dtype = dtype
        self.input_start_step = input_start_step
        self.stream = stream
        self.config = config
        # Steps found unreadable when the run started: replaced when saved (checkpoints.save).
        self.damaged_steps = damaged_steps
        # Saved with every checkpoint (a LoRA run's adapter record).
        self.metadata = metadata

    def save(self, step: int, state: trainer.TrainState) -> None:
        checkpoints.save(
            self.mngr,
            step,
            state.params,
            state.opt_state,
            self.dtype,
            self.input_start_step,
            damaged_steps=self.damaged_steps,
            metadata=self.metadata,
        )
        self.stream.save(checkpoints.input_position_path(self.mngr, step))
        self.config.checkpoint_saved()


def _checked_metrics(metrics, step: int) -> dict:
    metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
    if not np.isfinite(metrics["loss"]):
        raise UserError(
            f"loss is {metrics['loss']} at step {step}; stopped without saving, so the newest "
            "checkpoint in MODEL_DIR is the last good one. Lower the learning rate or check data"
        )
    return metrics


class TrainLoop:
    """Runs the train steps up to `last_step` and the periodic work between them."""

    def __init__(
        self,
        *,
        model_dir: str,
        step_fn,
        stream,
        batch_sharding,
        dropout_seed,
        periods: Periods,
        last_step: int,
        progress: Progress,
        writer,
        checkpointer: Checkpointer,
        evaluator: TaskEvaluator | None,
        preemption: PreemptionWatch,
    ):
        self.model_dir = model_dir
        self.step_fn = step_fn
        self.stream = stream
        self.batch_sharding = batch_sharding
        self.dropout_seed = dropout_seed
        self.periods = periods
        self.last_step = last_step
        self.progress = progress
        self.writer = writer
        self.checkpointer = checkpointer
        self.evaluator = evaluator
        self.preemption = preemption

    def run(self, state: trainer.TrainState) -> trainer.TrainState:
        """Trains from `state`'s step to the last one, or until SIGTERM (saved at that step) or
        Ctrl-C (KeyboardInterrupt once the step's work is done)."""
        ctrl_c = CtrlCBetweenSteps()
        try:
            for step in range(int(state.step) + 1, self.last_step + 1):
                state, metrics = self._train_step(state)
                preempted = self.preemption.requested(step)
                save = self.periods.saves(step, self.last_step) or preempted
                if self.periods.logs(step) or save:
                    self._log(step, metrics)
                if save:
                    self.checkpointer.save(step, state)
                if preempted:
                    name = paths.checkpoint_name(step)
                    print(f"SIGTERM: saved {name}; rerun the same command to continue")
                    return state
                if self.evaluator and self.periods.evaluates(step, self.last_step):
                    self.evaluator(state.params, step)
                ctrl_c.check()
        finally:
            ctrl_c.close()
            self.preemption.close()
            self.writer.flush()
        print(f"done: step {self.last_step}, checkpoints in {self.model_dir}", flush=True)
        return state

    def _train_step(self, state: trainer.TrainState):
        host_batch = next(self.stream)
        self.progress.add_examples(host_batch)
        batch = batches.to_global(host_batch, self.batch_sharding)
        return self.step_fn(state, batch, self.dropout_seed)

    def _log(self, step: int, metrics) -> None:
        """Prints the progress line and writes the metrics to TensorBoard; a NaN or Inf loss
        stops the run here, before anything is saved."""
        metrics = _checked_metrics(metrics, step)
        metrics.update(self.progress.report(step, metrics))
        self.writer.write_scalars(step, metrics)
