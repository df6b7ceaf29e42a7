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

One run writes a MODEL_DIR at a time: process 0 holds its lock file from the end of the input
checks to the exit (storage/writer_lock.py), so a second train there is refused at once, and a
MODEL_DIR that cannot be written is refused before any work. A checkpoint that cannot be read is
skipped with a warning (the newest readable one is resumed) and moved aside when its step is
saved again.

On SIGTERM (a TPU VM about to be preempted) the loop saves a checkpoint at the current step and
exits 0; rerunning the same command continues. A NaN or Inf loss stops training before anything
is saved, so the last checkpoint on disk is the last good one.

With PREPARED_DATA (a `t5tpu prepare-data` file, data/prepared.py) the batches and the eval
examples come from that file, and neither seqio nor TensorFlow is imported: the scalars go to
train/scalars.jsonl (storage/scalar_log.py) instead of TensorBoard's event files.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath
from jax.experimental import multihost_utils

from t5tpu.config import gin_setup, runner_settings
from t5tpu.data import availability, pipeline, prepared
from t5tpu.errors import UserError
from t5tpu.model import decoding_settings
from t5tpu.model.encoder_decoder import EncoderDecoderModel
from t5tpu.partitioning import Partitioner
from t5tpu.runners import lora_run, prepared_eval
from t5tpu.runners.evaluator import TaskEvaluator
from t5tpu.runners.step_setup import FullStepSetup, StartPoint, StepParts, StepSetup
from t5tpu.runners.train_loop import Checkpointer, Periods, TrainConfig, TrainLoop
from t5tpu.storage import checkpoints, locations, remote, scalar_log
from t5tpu.storage import model_dir as paths
from t5tpu.storage.run_record import RunRecord
from t5tpu.storage.writer_lock import WriterLock
from t5tpu.tasks import registry, shaping
from t5tpu.training import trainer
from t5tpu.training.preemption import PreemptionWatch
from t5tpu.training.progress import Progress

if TYPE_CHECKING:  # the loader imports TensorFlow (Mesh TF's reader): not at gin parsing
    from t5tpu.formats.loader import Checkpoint


@dataclasses.dataclass(frozen=True)
class InputSettings:
    """The training input stream: a seeded order over the task's train split, or its batches
    from a prepared file (`prepared`, PREPARED_DATA's)."""

    task_name: str
    task_feature_lengths: dict
    batch_size: int
    seed: int
    use_packing: bool
    prepared: prepared.PreparedData | None = None


@dataclasses.dataclass(frozen=True)
class EvalSettings:
    """Evaluation between steps (EVAL_PERIOD), greedy as `t5tpu eval` decodes by default."""

    split: str
    batch_size: int
    num_examples: int | None


def _create_dir(model_dir: str) -> bool:
    """Creates MODEL_DIR if missing (the lock file goes there); True if it was created."""
    # First: on gs:// a missing bucket would be created, and a dead endpoint retried for minutes.
    remote.check_storage(model_dir, "MODEL_DIR")
    path = epath.Path(model_dir)
    if path.is_dir():
        return False
    if path.exists():
        raise UserError(f"MODEL_DIR {model_dir} is a file; give a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        if e.errno not in WriterLock.NOT_WRITABLE | {errno.EEXIST}:
            raise  # a full disk, a failing device: the machine's fault, not the input's
        raise UserError(
            f"cannot create MODEL_DIR {model_dir} ({e.strerror or e}); give a writable directory"
        ) from None
    return True


@contextlib.contextmanager
def _sole_writer(model_dir: str):
    """Holds MODEL_DIR's writer lock on process 0 for the block. Every process learns whether
    it was taken, so on a refusal the others stop too rather than wait for process 0 in a
    collective forever. A MODEL_DIR this run created and left empty (it failed before writing
    anything) is removed again."""
    lock, error, created = None, None, False
    if jax.process_index() == 0:
        try:
            created = _create_dir(model_dir)
            lock = WriterLock(paths.train_lock(model_dir))
            lock.acquire()
        except UserError as e:
            lock, error = None, e
    if not bool(multihost_utils.broadcast_one_to_all(np.bool_(error is None))):
        raise error or UserError(f"process 0 could not lock MODEL_DIR {model_dir}; see its error")
    try:
        yield
    finally:
        if lock:
            lock.release()
        if created and not locations.is_remote(model_dir) and not os.listdir(model_dir):
            os.rmdir(model_dir)


def _check_data(data: InputSettings, task_module: str | None, evals: EvalSettings | None) -> None:
    """The task exists and its splits can be read, before any work."""
    registry.get_task(data.task_name, task_module)
    availability.check_readable(data.task_name, "train")
    if evals:
        availability.check_readable(data.task_name, evals.split, "EVAL_SPLIT")


def _checked_inputs(
    data: InputSettings, task_module: str | None, evals: EvalSettings | None, path: str | None
) -> InputSettings:
    """`data` with the prepared file's data when PREPARED_DATA names one (the run's settings
    checked against it); else as it is, once the task's splits are found readable."""
    if not path:
        _check_data(data, task_module, evals)
        return data
    if jax.process_count() > 1:
        raise UserError("PREPARED_DATA holds one host's batches; train from it on one host")
    found = prepared.read(path)
    prepared.check_settings(
        found,
        prepared.BatchSettings(
            task=data.task_name,
            lengths=data.task_feature_lengths,
            batch_size=data.batch_size,
            seed=data.seed,
            packing=data.use_packing,
        ),
    )
    if evals:
        prepared.check_eval(found, split=evals.split, num_examples=evals.num_examples)
    return dataclasses.replace(data, prepared=found)


def _run_record(data: InputSettings) -> RunRecord:
    """What this run decides about its model's inputs and outputs, saved with every checkpoint
    for the front ends: the task, its lengths and input shaping, and the decoding eval and
    infer use (runner_settings.infer_decoding)."""
    # n-best is what one infer asks for, not how the model answers everywhere.
    defaults = dataclasses.replace(runner_settings.infer_decoding(), num_return_sequences=1)
    lengths = pipeline.model_lengths(data.task_feature_lengths)
    # A prepared file names the tasks: looking up another task's would import seqio.
    tasks = data.prepared.tasks if data.prepared else None
    return shaping.record_for_run(data.task_name, lengths, defaults, tasks=tasks)


def _initial_checkpoint(
    resume: checkpoints.ResumePoint | None, initial_path: str | None
) -> Checkpoint | None:
    """INITIAL_CHECKPOINT_PATH opened once, where the run reads it: for a fresh run's parameters
    and step, or for the step of a resume whose checkpoint did not record its input's start."""
    if not initial_path or (resume and resume.input_start_step is not None):
        return None
    from t5tpu.formats import loader  # imports TensorFlow: not at gin parsing (t5tpu plan)

    return loader.open_checkpoint(initial_path)


def _input_start_step(resume: checkpoints.ResumePoint | None, initial: Checkpoint | None) -> int:
    """The step before the input stream's first batch: a resume's recorded one, else the
    pretrained checkpoint's step (T5 1.1's is 1,000,000), else 0."""
    if resume and resume.input_start_step is not None:
        return resume.input_start_step
    return initial.step if initial else 0


def _start_point(
    model_dir: str, initial_checkpoint_path: str | None, train_steps: int, relative_steps: bool
) -> StartPoint:
    # Steps count on from a pretrained checkpoint's step; the input stream starts at its first
    # batch there, and a resume skips only the batches used since.
    remote.check_storage(initial_checkpoint_path, "INITIAL_CHECKPOINT_PATH")
    resume = checkpoints.resume_point(model_dir)
    initial = _initial_checkpoint(resume, initial_checkpoint_path)
    input_start_step = _input_start_step(resume, initial)
    last_step = train_steps + (input_start_step if relative_steps else 0)
    if not resume and input_start_step >= last_step > 0:
        raise UserError(
            f"INITIAL_CHECKPOINT_PATH is at step {input_start_step}, not before TRAIN_STEPS="
            f"{train_steps}: steps count on from it as in T5X; set TRAIN_STEPS="
            f"{input_start_step + train_steps}, or train.relative_steps = True for {train_steps} "
            "more"
        )
    return StartPoint(resume, initial, input_start_step, last_step)


def _resumed_state(*, setup: StepSetup, mngr, step: int) -> trainer.TrainState:
    abstract, shardings = setup.abstract, setup.shardings
    params, opt_state = checkpoints.restore_state(
        mngr, step, abstract.params, abstract.opt_state, shardings.params, shardings.opt_state
    )
    print(f"resuming from {paths.checkpoint_dir(str(mngr.directory), step)}", flush=True)
    state = trainer.TrainState(jnp.int32(step), params, opt_state)
    # Restored buffers are laid out by the host-side reader; a jitted copy gives them XLA's
    # own allocation, as in a run that never stopped, so the next steps are bitwise equal.
    copy = jax.jit(lambda s: jax.tree_util.tree_map(jnp.copy, s), out_shardings=shardings)
    return copy(state)


def _start_state(*, setup: StepSetup, mngr, seed: int, start: StartPoint) -> trainer.TrainState:
    """The state to start from, placed on the mesh (see the module docstring for the order)."""
    if start.resume:
        return _resumed_state(setup=setup, mngr=mngr, step=start.resume.step)
    return setup.fresh_state(seed=seed, start=start)


def _warn_unused_rows(model: EncoderDecoderModel, start: StartPoint) -> None:
    """A pretrained embedding far larger than the vocabulary bound here (T5X's 32,128 rows with
    the bundled 1,024 pieces): its rows were learned for another vocabulary's pieces, so the
    fine-tuning starts from ids that mean other words. Published vocabularies are padded to a
    multiple of 128 rows, which is no mismatch."""
    rows, ids = model.config.vocab_size, model.vocabulary.vocab_size
    if start.initial_checkpoint is None or rows <= -(-ids // 128) * 128:
        return
    print(
        f"t5tpu: warning: INITIAL_CHECKPOINT_PATH's embedding has {rows:,} rows but the "
        f"vocabulary bound here has {ids:,} ids: the pretrained rows belong to another "
        "vocabulary's pieces; bind the checkpoint's own (default_vocabulary."
        "sentencepiece_model_file) unless you mean to train new embeddings",
        file=sys.stderr,
        flush=True,
    )


def _step_setup(*, settings, mngr, start: StartPoint, parts: StepParts) -> StepSetup:
    """The StepSetup of a full fine-tuning run, or of a LoRA run (`settings`)."""
    _warn_unused_rows(parts.model, start)
    lora_run.check_resumable(mngr, start.resume, settings)
    if settings is None:
        return FullStepSetup.build(parts)
    return lora_run.LoraStepSetup.build(parts, settings=settings, mngr=mngr, start=start)


def _evaluator(
    evals: EvalSettings,
    *,
    data: InputSettings,
    setup: StepSetup,
    model_dir: str,
) -> Callable:
    """Evaluation during training, on the parameters the setup evaluates (a LoRA run's: its
    adapters merged into the base); of the prepared file's examples when there is one."""
    if data.prepared:
        evaluator = prepared_eval.PreparedEvaluator(
            model=setup.eval_model,
            data=data.prepared,
            batch_size=evals.batch_size,
            partitioner=setup.partitioner,
            param_shardings=setup.eval_shardings,
            model_dir=model_dir,
            settings=decoding_settings.DecodingSettings(),
        )
        return lambda params, step: evaluator(setup.eval_params(params), step)
    evaluator = TaskEvaluator(
        model=setup.eval_model,
        task_name=data.task_name,
        task_feature_lengths=data.task_feature_lengths,
        split=evals.split,
        batch_size=evals.batch_size,
        partitioner=setup.partitioner,
        param_shardings=setup.eval_shardings,
        model_dir=model_dir,
        num_examples=evals.num_examples,
        settings=decoding_settings.DecodingSettings(),
    )
    return lambda params, step: evaluator(setup.eval_params(params), step)


def _train_steps(
    *,
    model_dir: str,
    setup: StepSetup,
    mngr,
    start: StartPoint,
    data: InputSettings,
    evals: EvalSettings | None,
    periods: Periods,
    checkpoint_dtype: str,
) -> trainer.TrainState:
    """Trains the steps left after the start state's: the input stream and the evaluator first,
    so that bad input is refused before the run is recorded as started."""
    state = _start_state(setup=setup, mngr=mngr, seed=data.seed, start=start)
    first_step = int(state.step)
    batches_used = max(first_step - start.input_start_step, 0)
    if first_step >= start.last_step:
        print(f"already at step {first_step} >= {start.last_step}; nothing to do")
        return state
    layout = setup.partitioner.data_layout(data.batch_size)
    if data.prepared:
        needed = start.last_step - start.input_start_step
        stream = prepared.stream(data.prepared, skip=batches_used, needed=needed)
    else:
        stream = pipeline.train_batches(
            data.task_name,
            data.task_feature_lengths,
            data.batch_size,
            data.seed,
            data.use_packing,
            skip_batches=batches_used,
            layout=layout,
            saved_position=checkpoints.input_position_path(mngr, first_step),
        )
    evaluator = None
    if evals:
        evaluator = _evaluator(evals, data=data, setup=setup, model_dir=model_dir)
    return _run_loop(
        state,
        model_dir=model_dir,
        setup=setup,
        mngr=mngr,
        start=start,
        stream=stream,
        layout=layout,
        evaluator=evaluator,
        dropout_seed=data.seed + 1,
        periods=periods,
        checkpoint_dtype=checkpoint_dtype,
        record=_run_record(data),
        writer=_train_writer(model_dir, tensorflow=data.prepared is None),
    )


def _run_loop(
    state: trainer.TrainState,
    *,
    model_dir: str,
    setup: StepSetup,
    mngr,
    start: StartPoint,
    stream: pipeline.InputStream | prepared.PreparedStream,
    layout,
    evaluator: Callable | None,
    dropout_seed: int,
    periods: Periods,
    checkpoint_dtype: str,
    record: RunRecord,
    writer,
) -> trainer.TrainState:
    """Records the run as started, then trains from `state` on inputs already built."""
    first_step = int(state.step)
    # Only now that the pipeline and evaluator are built: bad input or a finished run must not
    # replace the config of the run already in MODEL_DIR.
    config = TrainConfig(model_dir, first_step=first_step, resumed=bool(start.resume))
    config.run_started()
    checkpointer = Checkpointer(
        mngr=mngr,
        dtype=checkpoint_dtype,
        input_start_step=start.input_start_step,
        stream=stream,
        config=config,
        # Found unreadable by resume_point: replaced when their steps are saved again.
        damaged_steps=start.resume.damaged_steps if start.resume else (),
        metadata={**setup.checkpoint_metadata(), **record.metadata()},
    )
    loop = TrainLoop(
        model_dir=model_dir,
        step_fn=setup.compiled_step(),
        stream=stream,
        batch_sharding=setup.partitioner.batch_sharding(),
        dropout_seed=jax.random.PRNGKey(dropout_seed),
        periods=periods,
        last_step=start.last_step,
        progress=Progress(first_step, start.last_step, layout.num_shards),
        writer=writer,
        checkpointer=checkpointer,
        evaluator=evaluator,
        preemption=PreemptionWatch(),
    )
    _announce(first_step, start=start, setup=setup, record=record)
    return loop.run(state)


def _train_writer(model_dir: str, *, tensorflow: bool):
    """TensorBoard's writer of train/, or without TensorFlow its scalars.jsonl."""
    logdir, just_logging = paths.train_summaries(model_dir), jax.process_index() > 0
    if not tensorflow:
        return scalar_log.writer(logdir, just_logging=just_logging)
    from t5tpu.storage import summaries  # clu's writers import TensorFlow: not at gin parsing

    return summaries.writer(logdir, just_logging=just_logging)


def _announce(first_step: int, *, start: StartPoint, setup: StepSetup, record: RunRecord) -> None:
    print(
        f"training steps {first_step}..{start.last_step} on {jax.device_count()} device(s), mesh "
        f"{dict(setup.partitioner.mesh.shape)}, input from batch "
        f"{max(first_step - start.input_start_step, 0)}",
        flush=True,
    )
    print(
        f"the run record, saved with each checkpoint for infer, t5tpu.load and serve: inputs of "
        f"up to {record.input_length} tokens, {shaping.describe(record.shaping)}; outputs of up "
        f"to {record.target_length}",
        flush=True,
    )


def _checked_partitioner(
    partitioner: Partitioner | None, batch_size: int, eval_batch_size: int, microbatches: int
) -> Partitioner:
    """The partitioner (default: every device, data-parallel), the batch sizes checked on it."""
    partitioner = partitioner or Partitioner()
    partitioner.check_batch_size("BATCH_SIZE", batch_size, microbatches)
    partitioner.check_batch_size("EVAL_BATCH_SIZE", eval_batch_size)
    return partitioner


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
    method=None,
    prepared_data: str | None = None,
) -> trainer.TrainState:
    """Trains until step TRAIN_STEPS (see the module docstring); `method`: 'full' (None), or
    'lora' / @lora(): adapters on the frozen INITIAL_CHECKPOINT_PATH (runners/lora_run.py)."""
    settings = lora_run.settings_of(method)
    evals = EvalSettings(eval_split, eval_batch_size or batch_size, eval_num_examples)
    partitioner = _checked_partitioner(partitioner, batch_size, evals.batch_size, num_microbatches)
    checkpoints.check_save_dtype(checkpoint_dtype)
    data = InputSettings(
        mixture_or_task_name, task_feature_lengths, batch_size, random_seed, use_packing
    )
    evals_between = evals if eval_period else None
    data = _checked_inputs(data, mixture_or_task_module, evals_between, prepared_data)
    lengths = pipeline.model_lengths(task_feature_lengths)
    parts = StepParts(model, optimizer, partitioner, lengths, num_microbatches)
    with _sole_writer(model_dir):
        start = _start_point(model_dir, initial_checkpoint_path, train_steps, relative_steps)
        mngr = checkpoints.manager(model_dir, keep=keep_checkpoints, keep_period=keep_period)
        setup = _step_setup(settings=settings, mngr=mngr, start=start, parts=parts)
        return _train_steps(
            model_dir=model_dir,
            setup=setup,
            mngr=mngr,
            start=start,
            data=data,
            evals=evals_between,
            periods=Periods(log=log_period, save=save_period, eval=eval_period),
            checkpoint_dtype=checkpoint_dtype,
        )
