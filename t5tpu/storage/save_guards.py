"""What stands around a checkpoint save (checkpoints.save): Ctrl-C is held until the save is
complete, and a save that fails writing (a full disk, a failing device) removes what it wrote
and raises EnvironmentFault naming MODEL_DIR, so the checkpoints before it are all that is left
and no temporary the size of a checkpoint stays behind."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import signal
import sys
import threading

import orbax.checkpoint as ocp
from etils import epath

from t5tpu.errors import EnvironmentFault
from t5tpu.storage import checkpoint_damage
from t5tpu.storage import model_dir as paths

# orbax's temporary name of a step being saved: checkpoint_N.orbax-checkpoint-tmp[-<time>].
ORBAX_TMP = ".orbax-checkpoint-tmp"
# TensorStore reports a failed write as a ValueError whose message ends in the OS error code.
_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)")


@contextlib.contextmanager
def ctrl_c_after_the_save():
    """Holds Ctrl-C until the save is complete, then hands it to the handler that was there
    (Python's raises KeyboardInterrupt; the train loop's waits for the step's end). orbax's
    wait_until_finished catches any exception while it waits, KeyboardInterrupt included: it
    logs it, forgets the step being saved and returns, and training went on as if Ctrl-C was
    never pressed."""
    if threading.current_thread() is not threading.main_thread() or (
        signal.getsignal(signal.SIGINT) == signal.SIG_IGN  # a background job: Ctrl-C is not ours
    ):
        yield
        return
    pressed = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: pressed.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if pressed and callable(previous):
        previous(signal.SIGINT, None)  # Python's own handler raises; the train loop's defers
    elif pressed:
        raise KeyboardInterrupt


def _os_error_code(error: BaseException) -> int | None:
    """The errno of a failed write: an OSError's, or the one TensorStore names in its message."""
    if isinstance(error, OSError):
        return error.errno
    match = _OS_ERROR_CODE.search(str(error))
    return int(match.group(1)) if match else None


@contextlib.contextmanager
def disk_faults(mngr: ocp.CheckpointManager, step: int):
    """A save that fails writing (a full disk, a failing device) removes what it wrote of
    `step` and raises EnvironmentFault naming MODEL_DIR; the checkpoints before stay as they
    were. orbax would leave its temporary directory, the size of a checkpoint, behind."""
    previous_hook = sys.unraisablehook
    sys.unraisablehook = _quiet_after_a_failed_write(previous_hook)
    try:
        yield
    except Exception as e:
        code = _os_error_code(e)
        if code is None:
            raise
        _remove_partial_save(mngr, step)
        cause = os.strerror(code) if code in errno.errorcode else checkpoint_damage.short(e)
        raise EnvironmentFault(
            str(mngr.directory),
            f"{cause}; checkpoint_{step} not saved, the checkpoints before it are intact",
        ) from None
    # Kept after a failure: writes still in flight keep reporting until the process exits.
    sys.unraisablehook = previous_hook


def _quiet_after_a_failed_write(previous_hook):
    """An unraisable-exception hook that drops 'Event loop is closed'. When one write of a save
    fails, orbax closes the event loop it was waiting on; TensorStore's other writes still in
    flight then report to that loop, and each would print a traceback (hundreds, for one full
    disk). Anything else goes to `previous_hook`."""

    def hook(unraisable):
        error = unraisable.exc_value
        if isinstance(error, RuntimeError) and str(error) == "Event loop is closed":
            return
        previous_hook(unraisable)

    return hook


def _remove_partial_save(mngr: ocp.CheckpointManager, step: int) -> None:
    """Deletes orbax's temporary directory of `step`, and the step's own directory if the
    failure came after orbax renamed it into place (or wrote it in place, as on gs://): save()
    runs only for a step that is not there (a damaged one was moved aside first)."""
    directory = epath.Path(mngr.directory)
    name = paths.checkpoint_name(step)
    for leftover in directory.glob(f"{name}{ORBAX_TMP}*"):
        leftover.rmtree(missing_ok=True)
    (directory / name).rmtree(missing_ok=True)
    with contextlib.suppress(Exception):
        mngr.reload()  # forget the step orbax may have listed
