"""Checkpoints in MODEL_DIR with orbax: MODEL_DIR/checkpoint_<step>/{params,opt_state}.

Parameters and optimizer state are separate items, so eval and infer restore parameters alone
without knowing the optimizer; input_position/ holds each training process's place in its input
stream. Orbax writes to a temporary directory and renames it when the
save is complete, so a crash mid-save never leaves a checkpoint that restore would pick; a
checkpoint_N directory damaged some other way (a partial copy, a lost or cut file) is skipped
with a warning (checkpoint_damage.py), and renamed checkpoint_N.incomplete when a run saves step N
again. A save that fails for want of disk space removes what it wrote and raises
EnvironmentFault, so the checkpoints before it are all that is left.

On disk layers are always unrolled (layers_N), whatever T5Config.scan_layers: a run with scanned
layers unstacks its parameters and optimizer state to save them and stacks them again on restore
(layer_stacking.py), so checkpoints move freely between scanned and unscanned runs and the
importers and exporters see one layout.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

from t5tpu.errors import UserError
from t5tpu.model import layer_stacking
from t5tpu.storage import checkpoint_damage, locations, save_guards
from t5tpu.storage import model_dir as paths

ITEMS = ("params", "opt_state")
# Saved in each checkpoint's metadata: the step before the run read its first input batch (a
# pretrained checkpoint's step when it fine-tunes one, else 0).
INPUT_START_STEP = "input_start_step"
SAVE_DTYPES = ("float32", "bfloat16")


def manager(
    model_dir: str, keep: int | None = None, keep_period: int | None = None, read_only: bool = False
) -> ocp.CheckpointManager:
    if epath.Path(model_dir).exists() and not epath.Path(model_dir).is_dir():
        raise UserError(f"MODEL_DIR {model_dir} is a file; give a directory")
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep,
        keep_period=keep_period,
        step_prefix=paths.STEP_PREFIX,
        create=not read_only,
        read_only=read_only,
        enable_async_checkpointing=False,
        # Leftovers of a save that was killed; orbax never lists them, this deletes them. Not on
        # gs://: there orbax takes every folder without its commit marker for one (train/,
        # eval/, inference/ too) and deletes it.
        cleanup_tmp_directories=not read_only and not locations.is_remote(model_dir),
    )
    handlers = {name: ocp.StandardCheckpointHandler() for name in ITEMS}
    return ocp.CheckpointManager(epath.Path(model_dir), options=options, item_handlers=handlers)


# One compiled program slices every layer; XLA places the slices like the stacked arrays
# (whose layer axis is never sharded).
_unstack_layers = jax.jit(layer_stacking.unstack_layers)


def _unrolled(tree):
    return _unstack_layers(tree) if layer_stacking.is_stacked(tree) else tree


def _step_path(mngr: ocp.CheckpointManager, step: int) -> str:
    return paths.checkpoint_dir(str(mngr.directory), step)


def _step_dir(mngr: ocp.CheckpointManager, step: int) -> epath.Path:
    return epath.Path(_step_path(mngr, step))


def input_position_path(mngr: ocp.CheckpointManager, step: int) -> str:
    """Where this process keeps the input stream's position at `step` (data.InputStream.save)."""
    return paths.input_position(_step_path(mngr, step), jax.process_index())


def check_save_dtype(dtype: str) -> None:
    if dtype not in SAVE_DTYPES:
        raise UserError(f"CHECKPOINT_DTYPE={dtype!r}; use one of {', '.join(SAVE_DTYPES)}")


def save(
    mngr: ocp.CheckpointManager,
    step: int,
    params,
    opt_state,
    dtype: str = "float32",
    input_start_step: int = 0,
    damaged_steps=(),
    metadata: dict | None = None,
) -> None:
    """Saves parameters (cast to `dtype`: 'bfloat16' halves the size, and makes resume inexact)
    and optimizer state, and `input_start_step` (see INPUT_START_STEP) in the checkpoint's
    metadata; blocks until the checkpoint is complete on disk. `damaged_steps`: steps found
    unreadable when the run started (ResumePoint), whose directories look complete but are
    replaced, not taken as already saved. `metadata`: more of the checkpoint's own (a LoRA
    run's adapter record). A full disk raises EnvironmentFault."""
    check_save_dtype(dtype)
    if step in mngr.all_steps():
        step_dir = _step_dir(mngr, step)
        damaged = step in damaged_steps
        if not damaged and checkpoint_damage.incomplete_reason(step_dir, ITEMS) is None:
            return  # already saved at this step (e.g. the final save right after a periodic one)
        # Damaged, so skipped on restore; kept under another name, since it may be worth a look.
        aside = checkpoint_damage.move_aside(step_dir)
        print(f"t5tpu: warning: moved {step_dir} aside to {aside}")
        mngr.reload()
    # Together: the parameters tell the depth of stacks whose moments are all placeholders.
    params, opt_state = _unrolled((params, opt_state))
    if dtype != "float32":
        params = jax.tree_util.tree_map(lambda x: x.astype(jnp.dtype(dtype)), params)
    with save_guards.ctrl_c_after_the_save(), save_guards.disk_faults(mngr, step):
        mngr.save(
            step,
            args=ocp.args.Composite(
                params=ocp.args.StandardSave(params),
                opt_state=ocp.args.StandardSave(opt_state),
            ),
            custom_metadata={**(metadata or {}), INPUT_START_STEP: input_start_step},
            force=True,
        )
        mngr.wait_until_finished()


def custom_metadata(mngr, step: int) -> dict:
    """What checkpoint `step` saved beside its arrays (save()'s `metadata`, INPUT_START_STEP)."""
    return mngr.metadata(step).custom_metadata or {}


def params_readable(model_dir: str, step: int) -> bool:
    """Whether checkpoint `step` still has its parameters; no manager, so no host sync."""
    step_dir = epath.Path(paths.checkpoint_dir(model_dir, step))
    return checkpoint_damage.incomplete_reason(step_dir, ("params",)) is None


def usable_steps(mngr: ocp.CheckpointManager, items=ITEMS) -> list[int]:
    """Steps whose checkpoint has every file restore needs, oldest first; others are skipped
    with a warning (they are never loaded, and never deleted: they may be worth a look)."""
    steps = []
    for step in sorted(mngr.all_steps()):
        step_dir = _step_dir(mngr, step)
        reason = checkpoint_damage.incomplete_reason(step_dir, items)
        if reason:
            print(f"t5tpu: warning: skipping incomplete {step_dir} ({reason})", file=sys.stderr)
        else:
            steps.append(step)
    return steps


def _first_step_after(model_dir: str, after: int | None) -> int | None:
    # All processes open a manager or none does: orbax syncs the hosts in its constructor, and
    # a directory just being created may show on one host before another.
    exists = epath.Path(model_dir).is_dir()
    if not bool(multihost_utils.broadcast_one_to_all(np.bool_(exists))):
        return None
    steps = usable_steps(manager(model_dir, read_only=True), items=("params",))
    return next((step for step in steps if after is None or step > after), None)


def follow_steps(
    model_dir: str,
    after: int | None,
    last_step: int | None,
    poll_seconds: float,
    wait_seconds: float,
) -> Iterator[int]:
    """Each checkpoint step in `model_dir` after `after`, oldest first, as training writes them
    (MODEL_DIR need not exist yet). Ends after `last_step`, or when none has appeared for
    `wait_seconds` since the last one was handed out (or since the start). Every host gets
    process 0's answer, so all evaluate the same steps."""
    waiting_since = time.time()
    while True:
        step = _first_step_after(model_dir, after)
        if step is None:  # -1: none yet, -2: stop
            step = -2 if time.time() - waiting_since >= wait_seconds else -1
        step = int(multihost_utils.broadcast_one_to_all(np.int32(step)))
        if step == -2:
            print(f"no new checkpoint in {model_dir} for {wait_seconds:g} s; stopping", flush=True)
            return
        if step == -1:
            time.sleep(poll_seconds)
            continue
        yield step
        after, waiting_since = step, time.time()
        if last_step is not None and step >= last_step:
            return


@dataclasses.dataclass(frozen=True)
class ResumePoint:
    """The newest readable checkpoint of a run, which training continues from."""

    step: int
    # See INPUT_START_STEP; None in checkpoints saved before t5tpu recorded it.
    input_start_step: int | None
    # Newer checkpoints that look complete but cannot be read: save() replaces them.
    damaged_steps: tuple[int, ...] = ()


def resume_point(model_dir: str) -> ResumePoint | None:
    """The newest readable checkpoint in `model_dir` (newer damaged ones are reported in one
    warning line each), None if there is none; creates nothing."""
    if not epath.Path(model_dir).is_dir():
        return None
    mngr = manager(model_dir, read_only=True)
    step, damaged = checkpoint_damage.newest_readable(model_dir, usable_steps(mngr), ITEMS)
    if step is None and damaged:
        # Starting afresh would bury the run's progress under new checkpoints and configs.
        raise UserError(
            f"no checkpoint in {model_dir} can be read; move the damaged ones away to train "
            "afresh there, or use another MODEL_DIR"
        )
    if step is None:
        return None
    metadata = mngr.metadata(step).custom_metadata
    return ResumePoint(step, metadata.get(INPUT_START_STEP), tuple(damaged))


def _with_shardings(abstract, shardings):
    return jax.tree_util.tree_map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
    )


def _key_name(key) -> str:
    # Dict keys, namedtuple fields (optax states; orbax's metadata has them as dict keys) and
    # list indices, so a tree and its checkpoint metadata give the same names.
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def flat_shapes(tree) -> dict[str, tuple]:
    """{'encoder/layers_0/attention/query/kernel': shape, ...} for a tree of arrays/metadata."""
    return {
        "/".join(_key_name(k) for k in path): tuple(leaf.shape)
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def geometry_differences(found: dict[str, tuple], expected: dict[str, tuple]) -> str:
    """A one-line list of the parameter names and shapes that differ ('' if none)."""
    problems = [
        f"{name}: found {found[name]} vs model {shape}"
        for name, shape in expected.items()
        if name in found and found[name] != shape
    ]
    problems += [f"{name}: missing" for name in expected if name not in found]
    problems += [f"{name}: not in the model" for name in found if name not in expected]
    more = f"; and {len(problems) - 4} more" if len(problems) > 4 else ""
    return "; ".join(problems[:4]) + more


def check_geometry(mngr, step: int, abstract_params) -> None:
    """Refuses a checkpoint whose parameter names or shapes differ from the model's (compared
    in the unrolled layout), listing the differences, before anything is read."""
    differences = geometry_differences(
        flat_shapes(mngr.item_metadata(step)["params"]),
        flat_shapes(layer_stacking.unstack_layers(abstract_params)),
    )
    if differences:
        raise UserError(
            f"checkpoint {_step_path(mngr, step)} has another geometry "
            f"({differences}); use the model gin file it was trained with"
        )


def _check_optimizer(mngr, step: int, unrolled_opt_state) -> None:
    """Refuses optimizer state of another optimizer or settings (AdamW's moments where the run
    has Adafactor's factored ones), which orbax would reject with a tree-structure dump."""
    found = flat_shapes(mngr.item_metadata(step)["opt_state"])
    expected = flat_shapes(unrolled_opt_state)
    differences = geometry_differences(found, expected)
    if differences:
        settings = f"those of its {paths.TRAIN_CONFIG}"
        if full_attention_moments(found, expected):
            settings += " and --gin.adafactor.join_heads=False (saved before 2026-11-29)"
        raise UserError(
            f"checkpoint {_step_path(mngr, step)} holds the state of another "
            f"optimizer or optimizer settings ({differences}); resume with {settings}, or "
            "fine-tune from its parameters in a new MODEL_DIR with INITIAL_CHECKPOINT_PATH"
        )


def full_attention_moments(found: dict[str, tuple], expected: dict[str, tuple]) -> bool:
    """Whether `found` holds the full Adafactor moments of attention kernels that `expected`
    factors (training/optim.py's join_heads, which t5tpu's Adafactor lacked before)."""
    return any(
        "/v/" in name and name.endswith("kernel") and len(found.get(name, ())) == 3
        for name, shape in expected.items()
        if shape == (1,)
    )


def check_readable(model_dir: str, step: int, items=("params",)) -> None:
    """Refuses checkpoint `step`, named explicitly, when it cannot be read (a UserError)."""
    checkpoint_damage.check_readable(paths.checkpoint_dir(model_dir, step), items)


def _restore(mngr, step, abstract: dict, shardings: dict):
    """Restores the items in `abstract` ({item: tree of shapes}) onto `shardings` ({item: tree
    of shardings}): read unrolled as on disk, then stacked where the model scans its layers. A
    checkpoint found damaged on the way is refused in one line, not a TensorStore traceback."""
    try:
        return _read(mngr, step, abstract, shardings)
    except (UserError, KeyboardInterrupt):
        raise
    except Exception:
        check_readable(str(mngr.directory), step, tuple(abstract))
        raise


def _read(mngr, step, abstract: dict, shardings: dict):
    check_geometry(mngr, step, abstract["params"])
    unrolled, unrolled_shardings = layer_stacking.unrolled_targets(abstract, shardings)
    if "opt_state" in unrolled:
        _check_optimizer(mngr, step, unrolled["opt_state"])
    restored = mngr.restore(
        step,
        args=ocp.args.Composite(
            **{
                name: ocp.args.StandardRestore(
                    _with_shardings(unrolled[name], unrolled_shardings[name])
                )
                for name in abstract
            }
        ),
    )
    return layer_stacking.stack_onto(
        {name: restored[name] for name in abstract}, abstract, shardings
    )


def restore_state(
    mngr, step: int, abstract_params, abstract_opt_state, param_shardings, opt_shardings
):
    restored = _restore(
        mngr,
        step,
        {"params": abstract_params, "opt_state": abstract_opt_state},
        {"params": param_shardings, "opt_state": opt_shardings},
    )
    return restored["params"], restored["opt_state"]


def restore_params(mngr, step: int, abstract_params, param_shardings):
    return _restore(mngr, step, {"params": abstract_params}, {"params": param_shardings})["params"]


def steps_to_restore(model_dir: str, checkpoint_step: int | str) -> list[int]:
    """'latest' -> [newest readable step]; 'all' -> every readable step, oldest first; an int
    -> [that step]. Damaged checkpoints are skipped with a warning, or refused when named."""
    mngr = manager(model_dir, read_only=True)
    available = usable_steps(mngr, items=("params",))
    if not available:
        raise UserError(
            f"no checkpoint in {model_dir}; train first, or point MODEL_DIR at a trained run"
        )
    if checkpoint_step == "latest":
        newest, _ = checkpoint_damage.newest_readable(model_dir, available, ("params",))
        if newest is None:
            raise UserError(f"no checkpoint in {model_dir} can be read; train again")
        return [newest]
    if checkpoint_step == "all":
        readable = checkpoint_damage.readable_steps(model_dir, available, ("params",))
        if not readable:
            raise UserError(f"no checkpoint in {model_dir} can be read; train again")
        return readable
    if isinstance(checkpoint_step, str) and checkpoint_step.isdigit():  # a quoted step, '8'
        checkpoint_step = int(checkpoint_step)
    if isinstance(checkpoint_step, int) and checkpoint_step in available:
        check_readable(model_dir, checkpoint_step)
        return [checkpoint_step]
    raise UserError(
        f"CHECKPOINT_STEP={checkpoint_step!r} not found in {model_dir} (have "
        f"{', '.join(map(str, available))}); use 'latest', 'all' or one of those steps (eval: "
        "also 'continuous')"
    )
