"""TensorBoard writers for MODEL_DIR's train/ and eval/ folders, local or gs://.

clu's writer writes event files through TensorFlow's filesystems. For a remote folder the
events are written to a local folder and copied with etils' epath (the client that writes the
rest of MODEL_DIR), so MODEL_DIR needs one storage client, not two, and a test's GCS emulator
sees every file. An event file holds scalars only (kilobytes); it is copied after a write at
most every UPLOAD_SECONDS, and always on flush and close, so `tensorboard --logdir gs://...`
follows a run as it goes without a storage round trip every few steps.
"""

from __future__ import annotations

import shutil
import tempfile
import time
import weakref

from clu import metric_writers
from etils import epath

# Upload period of a remote writer between flushes: every log period (10 steps by default,
# seconds on a TPU) would add a storage round trip to the train loop each time.
UPLOAD_SECONDS = 30.0


def writer(logdir: str, *, just_logging: bool = False) -> metric_writers.MetricWriter:
    """The metric writer for `logdir`; `just_logging` (processes other than 0) writes no file."""
    if just_logging or "://" not in logdir:
        return metric_writers.create_default_writer(logdir, just_logging=just_logging)
    return _MirroredWriter(epath.Path(logdir))


class _MirroredWriter(metric_writers.MultiWriter):
    """Writes events locally and copies them to `destination` (see the module docstring)."""

    def __init__(self, destination: epath.Path):
        self._local = tempfile.mkdtemp(prefix="t5tpu-events-")
        # The runners flush but never close their writers: the local copy goes at exit.
        weakref.finalize(self, shutil.rmtree, self._local, ignore_errors=True)
        self._destination = destination
        self._uploaded_at = float("-inf")
        super().__init__([metric_writers.create_default_writer(self._local, asynchronous=False)])

    def write_scalars(self, step, scalars) -> None:
        super().write_scalars(step, scalars)
        self._upload(force=False)

    def write_summaries(self, step, values, metadata=None) -> None:
        super().write_summaries(step, values, metadata)
        self._upload(force=False)

    def flush(self) -> None:
        self._upload(force=True)

    def close(self) -> None:
        self._upload(force=True)
        super().close()
        shutil.rmtree(self._local, ignore_errors=True)

    def _upload(self, force: bool) -> None:
        if not force and time.monotonic() - self._uploaded_at < UPLOAD_SECONDS:
            return
        super().flush()
        self._destination.mkdir(parents=True, exist_ok=True)
        for event_file in epath.Path(self._local).iterdir():
            # One upload per file: epath's copy asks whether the target is a directory first.
            (self._destination / event_file.name).write_bytes(event_file.read_bytes())
        self._uploaded_at = time.monotonic()
