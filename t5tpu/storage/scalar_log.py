"""Scalars written without TensorFlow: <logdir>/scalars.jsonl, one {"step": N, name: value, ...}
line per write, for the runs that must not import it (PREPARED_DATA: a GPU image without
TensorFlow, whose TensorBoard event writer, clu's, is TensorFlow's).

The lines of earlier runs stay; the file is replaced whole (storage.atomic_files) on each flush,
so a reader finds the previous file or the new one, never half of one. The train loop flushes
at its end (a SIGTERM's included) and evaluation after each step it evaluates.
"""

from __future__ import annotations

import json

from etils import epath

from t5tpu.storage import atomic_files, remote

FILE_NAME = "scalars.jsonl"


class ScalarLog:
    """The write_scalars/flush/close of clu's metric writers that the runners use."""

    def __init__(self, logdir: str, *, just_logging: bool = False, setting: str = "MODEL_DIR"):
        self.path = str(epath.Path(logdir) / FILE_NAME)
        self._setting = setting
        self._just_logging = just_logging  # processes other than 0 write no file
        self._lines: list[str] = []
        exists = not just_logging and remote.answered(
            epath.Path(self.path).exists, path=self.path, setting=setting
        )
        if exists:
            self._lines = epath.Path(self.path).read_text().splitlines(keepends=True)

    def write_scalars(self, step: int, scalars: dict) -> None:
        row = {"step": int(step)} | {name: float(value) for name, value in scalars.items()}
        self._lines.append(json.dumps(row) + "\n")

    def flush(self) -> None:
        if not self._just_logging:
            text = "".join(self._lines)
            atomic_files.write_atomically(self.path, text, setting=self._setting)

    def close(self) -> None:
        self.flush()


def writer(logdir: str, *, just_logging: bool = False, setting: str = "MODEL_DIR") -> ScalarLog:
    """summaries.writer's counterpart without TensorFlow."""
    return ScalarLog(logdir, just_logging=just_logging, setting=setting)
