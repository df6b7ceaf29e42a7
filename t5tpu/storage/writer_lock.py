"""One writer per MODEL_DIR: `t5tpu train` holds a lock file there while it runs.

Two training runs on one MODEL_DIR would interleave checkpoints, input positions and configs
(the second failed mid-run on a FileExistsError from orbax). The lock file is created
exclusively and names its holder (host, pid, start time), so a second run fails at once in one
line saying who holds it. A holder that died without releasing (SIGKILL, a lost VM) leaves the
file behind: on the same host a dead pid is detected and the lock taken over; a lock of another
host cannot be checked from here, so the message says how to remove it when that run is gone.
eval and infer take no lock: they may run beside training. Taking it is also the first write of
a run, so a MODEL_DIR that cannot be written (read-only, no permission) is refused here in one
line, before any work.

On gs:// there is no exclusive create through these clients, so the check and the write are
two steps (another run starting in the same second may slip through); on a local or NFS disk
a hard link of the written file makes them one.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import socket
import time

from etils import epath

from t5tpu.errors import UserError
from t5tpu.storage import atomic_files, locations


@dataclasses.dataclass(frozen=True)
class Holder:
    """Who holds a lock: written into the lock file as JSON."""

    host: str
    pid: int
    started: float

    @classmethod
    def this_process(cls) -> Holder:
        return cls(host=socket.gethostname(), pid=os.getpid(), started=time.time())

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.started))
        return f"pid {self.pid} on {self.host}, since {when}"

    def is_dead(self) -> bool:
        """True only when the holder is known to be gone: a pid of this host that no longer
        runs. Another host's process cannot be checked, so it counts as alive."""
        if self.host != socket.gethostname():
            return False
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # alive, another user's
            return False
        return False


class WriterLock:
    """`with WriterLock(path):` holds the lock file `path` for the block's duration."""

    # Errors that say the directory is not one this user can write: the user's input to fix.
    NOT_WRITABLE = frozenset({errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOENT, errno.ENOTDIR})

    def __init__(self, path: str, *, holder: Holder | None = None):
        self.path = epath.Path(path)
        self.holder = holder or Holder.this_process()
        self._held = False

    def __enter__(self) -> WriterLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def acquire(self) -> None:
        # A full disk, or a folder where the lock file goes: atomic_files' one-line errors.
        with atomic_files.write_faults(str(self.path), "MODEL_DIR"):
            if self._try_create():
                return
            current = self._read_holder()
            if current is not None and not current.is_dead():
                raise UserError(
                    f"{self.path.parent} is being trained by {current.describe()}; wait for it, "
                    f"stop it, or use another MODEL_DIR (if that run is gone, delete {self.path})"
                )
            self._take_over(current)

    def release(self) -> None:
        if self._held and self._read_holder() == self.holder:
            self.path.unlink(missing_ok=True)
        self._held = False

    def _try_create(self) -> bool:
        text = json.dumps(dataclasses.asdict(self.holder))
        try:
            if locations.is_remote(self.path):
                if self.path.exists():
                    return False
                self.path.write_text(text)
            elif not self._link_into_place(text):
                return False
        except OSError as e:
            if e.errno not in self.NOT_WRITABLE:
                raise  # a full disk, a failing device: the machine's fault, not the input's
            raise UserError(
                f"cannot write to MODEL_DIR {self.path.parent} ({e.strerror or e}); give a "
                "writable directory"
            ) from None
        self._held = True
        return True

    def _link_into_place(self, text: str) -> bool:
        """Creates the lock with its content in one step: a hard link of a written temporary
        file fails if the lock exists, so no reader ever sees an empty lock file."""
        tmp = self.path.with_name(f"{self.path.name}.{self.holder.pid}.tmp")
        try:
            tmp.write_text(text)  # on a full disk, an empty file that goes in `finally`
            os.link(tmp, self.path)
            return True
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)

    def _take_over(self, stale: Holder | None) -> None:
        """Replaces a dead holder's (or an unreadable) lock. Deleting only the file that was
        read keeps two runs that both found it stale from both winning: the second one's
        exclusive create fails."""
        if self._read_holder() == stale:
            self.path.unlink(missing_ok=True)
        if not self._try_create():
            current = self._read_holder()
            who = current.describe() if current else "another run"
            raise UserError(f"{self.path.parent} was just taken by {who}; use another MODEL_DIR")
        gone = stale.describe() if stale else "an unreadable lock file"
        print(f"t5tpu: warning: took over {self.path} from {gone}, which is no longer running")

    def _read_holder(self) -> Holder | None:
        try:
            return Holder(**json.loads(self.path.read_text()))
        except (OSError, ValueError, TypeError):
            return None
