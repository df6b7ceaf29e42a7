"""`t5tpu train`: fine-tune (or train from scratch) with periodic logging, eval and checkpoints.

Where training starts, in order:
1. the newest complete checkpoint in MODEL_DIR — an exact resume: parameters, optimizer state
   and step come back, dropout randomness is derived from the step, and the input stream
   continues where it stood (its saved position, else by skipping the batches already used),
   so a killed and restarted run ends with the same parameters, bit for bit, as one that was
   never interrupted; INITIAL_CHECKPOINT_PATH is not read again (it may be gone);
2. else INITIAL_CHECKPOINT_PATH — parameters only, fresh optimizer state; step counting
   continues from that checkpoint's step as in T5X (TRAIN_STEPS is absolute), or starts from it
   with `train.relative_steps = True` (TRAIN_STEPS more steps); the input starts at its first
   batch;
3. else a fresh random initialization.

On SIGTERM (a TPU VM about to be preempted) the loop saves a checkpoint at the current step and
exits 0; rerunning the same command continues. A NaN or Inf loss stops training before anything
is saved, so the last checkpoint on disk is the last good one.
"""

from __future__ import annotations

import datetime
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from clu import metric_writers

from t5tpu import gin_setup
from t5tpu.data import availability, batches, pipeline, registry
from t5tpu.errors import UserError
from t5tpu.formats import convert
from t5tpu.model.encoder_decoder import EncoderDecoderModel
from t5tpu.partitioning import Partitioner
from t5tpu.runners.evaluate import TaskEvaluator
from t5tpu.storage import checkpoints
from t5tpu.training import trainer
from t5tpu.training.preemption import PreemptionWatch


class Progress:
    """Console progress: step, loss, learning rate, examples/s and ETA. Examples are counted as
    they are read (packed rows hold several); a host reads one of `num_shards` shards of each
    global batch, so its count is scaled by that number."""

    def __init__(self, first_step: int, last_step: int, num_shards: int = 1):
        self.last_step = last_step
        self.num_shards = num_shards
        self._mark = (first_step, time.time())
        self._examples = 0

    def add_examples(self, host_batch: dict) -> None:
        self._examples += batches.examples_in(host_batch) * self.num_shards

    def report(self, step: int, metrics: dict) -> dict:
        mark_step, mark_time = self._mark
        now = time.time()
        seconds = max(now - mark_time, 1e-9)
        steps_per_s = (step - mark_step) / seconds
        examples_per_s = self._examples / seconds
        self._mark, self._examples = (step, now), 0
        eta = (self.last_step - step) / max(steps_per_s, 1e-9)
        rate = f"lr {metrics['learning_rate']:.3g}  " if "learning_rate" in metrics else ""
        print(
            f"step {step}/{self.last_step}  loss {metrics['loss']:.4f}  "
            f"token_acc {metrics['token_accuracy']:.3f}  {rate}"
            f"{examples_per_s:.1f} examples/s  "
            f"ETA {datetime.timedelta(seconds=round(eta))}",
            flush=True,
        )
        return {"steps_per_sec": steps_per_s, "examples_per_sec": examples_per_s}


def _input_start_step(resume_point, initial_path: str | None) -> int:
    """The step before the input stream's first batch: a resume's recorded one, else the
    pretrained checkpoint's step (T5 1.1's is 1,000,000), else 0."""
    if resume_point and resume_point[1] is not None:
        return resume_point[1]
    return convert.pretrained_step(initial_path) if initial_path else 0


def _start_state(
    model, optimizer, abstract, shardings, mngr, lengths, seed, resume_point, initial_path, step
):
    """The state to start from, placed on the mesh (see the module docstring for the order);
    `step` is the pretrained checkpoint's, used when training does not resume."""
    if resume_point:
        step = resume_point[0]
        params, opt_state = checkpoints.restore_state(
            mngr, step, abstract.params, abstract.opt_state, shardings.params, shardings.opt_state
        )
        print(f"resuming from {mngr.directory}/{checkpoints.STEP_PREFIX}_{step}", flush=True)
        state = trainer.TrainState(jnp.int32(step), params, opt_state)
        # Restored buffers are laid out by the host-side reader; a jitted copy gives them XLA's
        # own allocation, as in a run that never stopped, so the next steps are bitwise equal.
        copy = jax.jit(lambda s: jax.tree_util.tree_map(jnp.copy, s), out_shardings=shardings)
        return copy(state)
    params = None
    if initial_path:
        # A t5tpu checkpoint_N, a Hugging Face directory, a T5X or a Mesh TF checkpoint.
        params = convert.load_pretrained(initial_path, abstract.params, shardings.params)
        print(f"initialized parameters from {initial_path} (step {step})", flush=True)

    def init(rng, params):
        state = trainer.initial_state(model, optimizer, rng, *lengths, params)
        return state.replace(step=jnp.int32(step))

    return jax.jit(init, out_shardings=shardings)(jax.random.PRNGKey(seed), params)


def _checked_metrics(metrics, step: int) -> dict:
    metrics = {k: float(v) for k, v in jax.device_get(metrics).items()}
    if not np.isfinite(metrics["loss"]):
        raise UserError(
            f"loss is {metrics['loss']} at step {step}; stopped without saving, so the newest "
            "checkpoint in MODEL_DIR is the last good one. Lower the learning rate or check data"
        )
    return metrics


@gin_setup.runner
def train(
    *,
    model_dir: str,
    model: EncoderDecoderModel,
    mixture_or_task_name: str,
    task_feature_lengths: dict,
    train_steps: int,
    batch_size: int,
    optimizer,
    mixture_or_task_module: str | None = None,
    partitioner: Partitioner | None = None,
    use_packing: bool = False,
    random_seed: int = 0,
    num_microbatches: int = 1,
    save_period: int = 1000,
    keep_checkpoints: int | None = None,
    keep_period: int | None = None,
    checkpoint_dtype: str = "float32",
    log_period: int = 10,
    eval_period: int = 0,
    eval_split: str = "validation",
    eval_batch_size: int | None = None,
    eval_num_examples: int | None = None,
    initial_checkpoint_path: str | None = None,
    relative_steps: bool = False,
) -> trainer.TrainState:
    """Trains until step TRAIN_STEPS (absolute unless relative_steps; see the module docstring)."""
    partitioner = partitioner or Partitioner()
    partitioner.check_batch_size("BATCH_SIZE", batch_size, num_microbatches)
    partitioner.check_batch_size("EVAL_BATCH_SIZE", eval_batch_size or batch_size)
    checkpoints.check_save_dtype(checkpoint_dtype)
    for name, period in (("SAVE_PERIOD", save_period), ("train.log_period", log_period)):
        if period < 1:
            raise UserError(f"{name}={period} must be at least 1 (steps between them)")
    registry.get_task(mixture_or_task_name, mixture_or_task_module)
    availability.check_readable(mixture_or_task_name, "train")
    if eval_period:
        availability.check_readable(mixture_or_task_name, eval_split, "EVAL_SPLIT")
    lengths = pipeline.model_lengths(task_feature_lengths)
    # Steps count on from a pretrained checkpoint's step; the input stream starts at its first
    # batch there, and a resume skips only the batches used since.
    resume_point = checkpoints.resume_point(model_dir)
    initial_step = _input_start_step(resume_point, initial_checkpoint_path)
    last_step = train_steps + (initial_step if relative_steps else 0)
    if not resume_point and initial_step >= last_step > 0:
        raise UserError(
            f"INITIAL_CHECKPOINT_PATH is at step {initial_step}, not before TRAIN_STEPS="
            f"{train_steps}: steps count on from it as in T5X; set TRAIN_STEPS="
            f"{initial_step + train_steps}, or train.relative_steps = True for {train_steps} more"
        )
    abstract, shardings = trainer.state_shardings(model, optimizer, partitioner, *lengths)
    mngr = checkpoints.manager(model_dir, keep=keep_checkpoints, keep_period=keep_period)
    state = _start_state(
        model,
        optimizer,
        abstract,
        shardings,
        mngr,
        lengths,
        random_seed,
        resume_point,
        initial_checkpoint_path,
        initial_step,
    )
    first_step = int(state.step)
    batches_used = max(first_step - initial_step, 0)
    if first_step >= last_step:
        print(f"already at step {first_step} >= {last_step}; nothing to do")
        return state

    step_fn = trainer.compile_train_step(model, optimizer, shardings, partitioner, num_microbatches)
    layout = partitioner.data_layout(batch_size)
    stream = pipeline.train_batches(
        mixture_or_task_name,
        task_feature_lengths,
        batch_size,
        random_seed,
        use_packing,
        skip_batches=batches_used,
        layout=layout,
        saved_position=checkpoints.input_position_path(mngr, first_step),
    )
    evaluator = None
    if eval_period:
        evaluator = TaskEvaluator(
            model,
            mixture_or_task_name,
            task_feature_lengths,
            eval_split,
            eval_batch_size or batch_size,
            partitioner,
            shardings.params,
            model_dir,
            eval_num_examples,
        )
    writer = metric_writers.create_default_writer(
        os.path.join(model_dir, "train"), just_logging=jax.process_index() > 0
    )
    # Only now that the pipeline and evaluator are built: bad input or a finished run must not
    # replace the config of the run already in MODEL_DIR. A resume writes its config with its
    # first checkpoint, when steps trained with it are kept (a NaN or a crash before it keeps
    # nothing), keeping one with other settings as config_to_step_N.gin.
    config_pending = bool(resume_point)
    if not config_pending:
        gin_setup.write_operative_config(model_dir, "config.gin")
    dropout_seed = jax.random.PRNGKey(random_seed + 1)
    progress = Progress(first_step, last_step, layout.num_shards)
    preemption = PreemptionWatch()
    print(
        f"training steps {first_step}..{last_step} on {jax.device_count()} device(s), mesh "
        f"{dict(partitioner.mesh.shape)}, input from batch {batches_used}",
        flush=True,
    )
    try:
        for step in range(first_step + 1, last_step + 1):
            host_batch = next(stream)
            progress.add_examples(host_batch)
            batch = batches.to_global(host_batch, partitioner.batch_sharding())
            state, metrics = step_fn(state, batch, dropout_seed)
            preempted = preemption.requested(step)
            save = step % save_period == 0 or step == last_step or preempted
            if step % log_period == 0 or save:
                metrics = _checked_metrics(metrics, step)
                metrics.update(progress.report(step, metrics))
                writer.write_scalars(step, metrics)
            if save:
                checkpoints.save(
                    mngr, step, state.params, state.opt_state, checkpoint_dtype, initial_step
                )
                stream.save(checkpoints.input_position_path(mngr, step))
                if config_pending:
                    keep = f"config_to_step_{first_step}.gin"
                    gin_setup.write_operative_config(model_dir, "config.gin", keep)
                    config_pending = False
            if preempted:
                print(f"SIGTERM: saved checkpoint_{step}; rerun the same command to continue")
                return state
            if evaluator and (step % eval_period == 0 or step == last_step):
                evaluator(state.params, step)
    finally:
        preemption.close()
        writer.flush()
    print(f"done: step {last_step}, checkpoints in {model_dir}", flush=True)
    return state
