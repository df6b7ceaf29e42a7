"""How t5tpu writes every file that is not a checkpoint (checkpoints are orbax's: save_guards.py).

A file is written under a temporary name beside it and renamed into place, so a reader (or a
rerun) finds the previous file or the new one, never half of one; on a failure the temporary
file is removed and the previous file is untouched. A failed write becomes one of t5tpu's
errors naming the path, whichever client wrote (Python, epath, TensorFlow's gfile, TensorBoard):

- a full disk, a quota, a failing device: EnvironmentFault (exit 1; the same command succeeds
  once there is room);
- a read-only or not permitted folder: UserError naming the setting that moves the output;
- a folder where the file should be, or a file where a folder should be: UserError naming it.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator

from etils import epath

from t5tpu.errors import EnvironmentFault, UserError, environment_fault
from t5tpu.storage import locations

_NOT_WRITABLE = frozenset({errno.EROFS, errno.EACCES, errno.EPERM})
# Replacing a folder that holds files (a rename onto it, an unlink of it) says ENOTEMPTY.
_FOLDER_FOR_FILE = frozenset({errno.EISDIR, errno.ENOTEMPTY})
_FILE_FOR_FOLDER = frozenset({errno.ENOTDIR, errno.EEXIST})
# What a write can fail with that t5tpu explains; the machine's ones are errors.py's.
_EXPLAINED = (
    errno.ENOSPC,
    errno.EDQUOT,
    errno.EIO,
    *_NOT_WRITABLE,
    *_FOLDER_FOR_FILE,
    *_FILE_FOR_FOLDER,
)


def _os_error_code(error: BaseException) -> int | None:
    """The errno behind a failed write: an OSError's own, else the one whose text the message
    carries (TensorFlow's errors end in '; No space left on device', TensorStore's and clu's
    wrap the same words), following the exceptions it was raised from."""
    seen = 0
    while error is not None and seen < 8:
        if isinstance(error, OSError) and error.errno:
            return error.errno
        text = str(error).lower()
        for code in _EXPLAINED:
            if os.strerror(code).lower() in text:
                return code
        error, seen = error.__cause__ or error.__context__, seen + 1
    return None


def _file_in_the_way(path: str) -> str:
    """The nearest existing ancestor of `path` (or `path` itself) that is not a folder."""
    if locations.is_remote(path):
        return path
    candidate = os.path.abspath(path)
    while candidate != os.path.dirname(candidate):
        if os.path.exists(candidate) and not os.path.isdir(candidate):
            return candidate
        candidate = os.path.dirname(candidate)
    return path


def write_error(error: BaseException, path: str, setting: str) -> Exception | None:
    """`error`, raised while writing `path`, as t5tpu's error (see the module docstring), or None
    when it is none of those. `setting` is what moves the output elsewhere (MODEL_DIR,
    EVAL_OUTPUT_DIR, --output_dir)."""
    if isinstance(error, (UserError, EnvironmentFault)):
        return None  # already said
    code = _os_error_code(error)
    if code is None:
        return None
    why = os.strerror(code)
    fault = environment_fault(OSError(code, why, path))
    if fault is not None:
        return fault
    if code in _NOT_WRITABLE:
        return UserError(f"{path} is not writable ({why}); give a writable folder ({setting})")
    if code in _FOLDER_FOR_FILE:
        return UserError(
            f"{path} is a folder where a file should be; move it away or give another folder "
            f"({setting})"
        )
    if code in _FILE_FOR_FOLDER:
        return UserError(
            f"{_file_in_the_way(path)} is a file where a folder should be; move it away or give "
            f"another folder ({setting})"
        )
    return None


@contextlib.contextmanager
def write_faults(path: str, setting: str) -> Iterator[None]:
    """Turns a failed write inside the block into write_error's error: for writes that another
    library makes (TensorBoard's event files, TFRecords, a folder made)."""
    try:
        yield
    except Exception as e:
        error = write_error(e, str(path), setting)
        if error is None:
            raise
        raise error from None


def check_room(folder: str, setting: str) -> None:
    """Makes `folder` (local) and writes and removes a block-sized file there, raising
    write_error's error: for a library whose writer, when it fails itself, logs lines of its
    own besides raising (TensorFlow's event files). A bucket is not checked."""
    if locations.is_remote(folder):
        return
    probe = os.path.join(folder, f".t5tpu-room-check-{os.getpid()}")
    with write_faults(folder, setting):
        os.makedirs(folder, exist_ok=True)
        try:
            with open(probe, "wb") as f:
                f.write(b"\0" * 4096)
        finally:
            with contextlib.suppress(OSError):
                os.remove(probe)


def refuse_a_folder(path, setting: str) -> None:
    """write_error's error if `path`, where a file is to go, is a folder: for a set of files
    that replace the ones there together, checked before any is replaced."""
    if epath.Path(path).is_dir():
        in_the_way = IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
        raise write_error(in_the_way, str(path), setting)


def _temporary(path: epath.Path) -> epath.Path:
    # Hidden and this process's own: the processes of a multi-host run may write one name.
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


@contextlib.contextmanager
def atomic_file(path, *, setting: str, mode: str = "w") -> Iterator:
    """An open file whose content replaces `path` when the block completes, under write_faults;
    if anything in the block fails, the temporary file goes and `path` is as it was. Its
    folder is made where missing."""
    target = epath.Path(path)
    tmp = _temporary(target)
    with write_faults(str(path), setting):
        if not locations.is_remote(path):  # a bucket has no folders to make
            target.parent.mkdir(parents=True, exist_ok=True)
        try:
            with tmp.open(mode) as f:
                yield f
            tmp.replace(target)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            raise


def write_atomically(path, data: str | bytes, *, setting: str) -> None:
    """`data` (text or bytes) as the new content of `path` (see atomic_file)."""
    with atomic_file(path, setting=setting, mode="wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)
