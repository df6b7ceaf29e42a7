"""gs:// (any `scheme://`) storage answered within a deadline, through etils' epath: the client
that reads and writes MODEL_DIR's files, and the one a local GCS emulator can stand in for.

Storage clients retry a refused connection for half a minute or more and then raise deep inside
a run; a missing bucket surfaces as a client's traceback, or is created by gcsfs when orbax makes
MODEL_DIR. Every question asked of remote storage before work starts goes through `answered`,
so the user waits at most answer_seconds() for one line naming what could not be reached.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import TypeVar

from etils import epath

from t5tpu.errors import UserError, one_line_message
from t5tpu.runtime import lazy_imports
from t5tpu.storage.locations import bucket_of, is_remote


def answer_seconds() -> float:
    """How long storage may take to answer one question before it counts as unreachable
    (T5TPU_STORAGE_ANSWER_SECONDS, read when asked)."""
    value = os.environ.get("T5TPU_STORAGE_ANSWER_SECONDS", "20")
    try:
        return float(value)
    except ValueError:
        raise UserError(
            f"T5TPU_STORAGE_ANSWER_SECONDS={value!r} is not a number of seconds; set it to one "
            "(20 when unset) or unset it"
        ) from None


T = TypeVar("T")
# Answers about the file itself, passed on as they are for the caller to word; any other error
# (aiohttp's connection errors are OSErrors too) means the storage could not be reached.
_THE_FILES_OWN = (UserError, FileNotFoundError, IsADirectoryError, NotADirectoryError)


def _epath_uses_tensorflow() -> bool:
    """Whether epath asks remote storage through TensorFlow: unless etils' own switch,
    EPATH_USE_TF, says no (then through fsspec's gcsfs)."""
    return os.environ.get("EPATH_USE_TF", "").lower() not in ("false", "no", "f", "0")


def answered(ask: Callable[[], T], *, path: str, setting: str) -> T:
    """`ask()`, run in a daemon thread for a remote `path` so that a client that keeps retrying
    is abandoned after answer_seconds() with one line; local paths are asked directly.
    Errors of the client other than a missing file come back as one UserError naming `path`."""
    if not is_remote(path):
        return ask()
    if _epath_uses_tensorflow():
        # Imported here, not in the thread: its quiet import mutes stderr, and an import slower
        # than the deadline would mute the line that says so.
        lazy_imports.import_tensorflow_quietly()
    answer: dict = {}

    def run() -> None:
        try:
            answer["value"] = ask()
        except BaseException as e:  # handed to the caller's thread
            answer["error"] = e

    thread = threading.Thread(target=run, name="t5tpu-storage", daemon=True)
    seconds = answer_seconds()  # a bad setting refused before anything is asked
    thread.start()
    thread.join(seconds)
    if thread.is_alive():
        raise UserError(
            f"{setting}={path}: the storage of {bucket_of(path)} did not answer in "
            f"{seconds:g} s; check the network (or STORAGE_EMULATOR_HOST)"
        )
    error = answer.get("error")
    if error is None:
        return answer["value"]
    if isinstance(error, _THE_FILES_OWN):
        raise error
    raise UserError(
        f"{setting}={path}: cannot reach {bucket_of(path)} ({type(error).__name__}: "
        f"{one_line_message(error)[:200]}); check the network and credentials"
    ) from None


# Buckets found to exist: a run that checks several paths in one bucket asks once.
_FOUND_BUCKETS: set[str] = set()


def check_storage(path: str | None, setting: str) -> None:
    """Refuses, in one line and within answer_seconds(), a remote `path` whose bucket does
    not exist or whose storage does not answer; local paths and None pass. `setting` names what
    the user set (MODEL_DIR, --input, ...)."""
    if not is_remote(path):
        return
    bucket = bucket_of(path)
    if bucket in _FOUND_BUCKETS:
        return
    if not answered(lambda: epath.Path(bucket).exists(), path=path, setting=setting):
        raise UserError(
            f"{setting}={path}: bucket {bucket} does not exist (or these credentials cannot "
            "see it); create it or fix the path"
        )
    _FOUND_BUCKETS.add(bucket)


def is_file(path: str, setting: str) -> bool:
    """Whether `path` is a file, asked through epath: a remote path's bucket is checked first
    (check_storage) and the answer bounded by answer_seconds(). For what TensorFlow's own
    client reads later (tf.data, seqio), so a missing object is found here, not in its retries."""
    check_storage(path, setting)
    return answered(lambda: epath.Path(path).is_file(), path=path, setting=setting)
