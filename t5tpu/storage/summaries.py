"""TensorBoard writers for MODEL_DIR's train/ and eval/ folders, local or gs://.

clu's writer writes event files through TensorFlow's filesystems. For a remote folder the
events are written to a local folder and copied with etils' epath (the client that writes the
rest of MODEL_DIR), so MODEL_DIR needs one storage client, not two, and a test's GCS emulator
sees every file. An event file holds scalars only (kilobytes); it is copied after a write at
most every UPLOAD_SECONDS, and always on flush and close, so `tensorboard --logdir gs://...`
follows a run as it goes without a storage round trip every few steps.

A write that fails (a full disk, a read-only folder, a file where the folder should be) is one
of t5tpu's errors naming the folder (storage.atomic_files), not TensorFlow's; the event files
written before stay as they were (each writer starts a file of its own).
"""

from __future__ import annotations

import shutil
import tempfile
import time
import weakref

from clu import metric_writers
from etils import epath

from t5tpu.storage import atomic_files, locations

# Upload period of a remote writer between flushes: every log period (10 steps by default,
# seconds on a TPU) would add a storage round trip to the train loop each time.
UPLOAD_SECONDS = 30.0


def writer(
    logdir: str, *, just_logging: bool = False, setting: str = "MODEL_DIR"
) -> metric_writers.MetricWriter:
    """The metric writer for `logdir`; `just_logging` (processes other than 0) writes no file.
    `setting` is what moves `logdir` elsewhere, named when it cannot be written."""
    if not just_logging:  # Python's error first: TensorFlow's C++ writer logs its own lines
        atomic_files.check_room(logdir, setting)
    with atomic_files.write_faults(logdir, setting):  # the event file is made at once
        if just_logging or not locations.is_remote(logdir):
            made = metric_writers.create_default_writer(logdir, just_logging=just_logging)
        else:
            made = _MirroredWriter(epath.Path(logdir))
    return _FaultsReported(made, logdir, setting)


class _FaultsReported(metric_writers.MetricWriter):
    """`inner`, whose failed writes are atomic_files.write_faults' errors. clu's asynchronous
    writer reports a failure on the call after it, as an AsyncError around TensorFlow's."""

    def __init__(self, inner: metric_writers.MetricWriter, logdir: str, setting: str):
        self._inner, self._logdir, self._setting = inner, logdir, setting

    def _call(self, name: str, *args, **kwargs):
        with atomic_files.write_faults(self._logdir, self._setting):
            return getattr(self._inner, name)(*args, **kwargs)

    def write_summaries(self, step, values, metadata=None):
        return self._call("write_summaries", step, values, metadata)

    def write_scalars(self, step, scalars):
        return self._call("write_scalars", step, scalars)

    def write_images(self, step, images):
        return self._call("write_images", step, images)

    def write_videos(self, step, videos):
        return self._call("write_videos", step, videos)

    def write_audios(self, step, audios, *, sample_rate):
        return self._call("write_audios", step, audios, sample_rate=sample_rate)

    def write_texts(self, step, texts):
        return self._call("write_texts", step, texts)

    def write_histograms(self, step, arrays, num_buckets=None):
        return self._call("write_histograms", step, arrays, num_buckets)

    def write_hparams(self, hparams):
        return self._call("write_hparams", hparams)

    def flush(self):
        return self._call("flush")

    def close(self):
        return self._call("close")


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
