"""TensorBoard writers for MODEL_DIR's train/ and eval/ folders, local or gs://.

clu's writer writes event files through TensorFlow's filesystems. For a remote folder the
events are written to a local folder and copied with etils' epath (the client that writes the
rest of MODEL_DIR) after every write, so `tensorboard --logdir gs://...` follows a run as it
goes, and MODEL_DIR needs one storage client, not two. An event file holds scalars only: a few
kilobytes copied every log period.
"""

from __future__ import annotations

import shutil
import tempfile

from clu import metric_writers
from etils import epath


def writer(logdir: str, *, just_logging: bool = False) -> metric_writers.MetricWriter:
    """The metric writer for `logdir`; `just_logging` (processes other than 0) writes no file."""
    if just_logging or "://" not in logdir:
        return metric_writers.create_default_writer(logdir, just_logging=just_logging)
    return _MirroredWriter(epath.Path(logdir))


class _MirroredWriter(metric_writers.MultiWriter):
    """Writes events locally and copies them to `destination` after each write."""

    def __init__(self, destination: epath.Path):
        self._local = tempfile.mkdtemp(prefix="t5tpu-events-")
        self._destination = destination
        super().__init__([metric_writers.create_default_writer(self._local, asynchronous=False)])

    def write_scalars(self, step, scalars) -> None:
        super().write_scalars(step, scalars)
        self.flush()

    def write_summaries(self, step, values, metadata=None) -> None:
        super().write_summaries(step, values, metadata)
        self.flush()

    def flush(self) -> None:
        super().flush()
        self._destination.mkdir(parents=True, exist_ok=True)
        for event_file in epath.Path(self._local).iterdir():
            event_file.copy(self._destination / event_file.name, overwrite=True)

    def close(self) -> None:
        self.flush()
        super().close()
        shutil.rmtree(self._local, ignore_errors=True)
