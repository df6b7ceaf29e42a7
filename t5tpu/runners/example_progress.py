"""The progress line of a pass over many examples (infer, eval): done / total when known,
examples/s and ETA every few seconds, in the train loop's style, and the closing numbers."""

from __future__ import annotations

import dataclasses
import datetime
import os
import time


def _seconds_between_lines() -> float:
    """T5TPU_PROGRESS_SECONDS: how often a progress line is printed (0: after every chunk)."""
    return float(os.environ.get("T5TPU_PROGRESS_SECONDS", "5"))


@dataclasses.dataclass
class ExampleProgress:
    """Counts examples as they are finished. `already` were done by an earlier run (resumed
    chunks): they count towards done / total, not towards this run's rate."""

    label: str
    total: int | None = None
    already: int = 0
    every_seconds: float = dataclasses.field(default_factory=_seconds_between_lines)
    clock: object = time.monotonic

    def __post_init__(self):
        self.started = self._last_line = self.clock()
        self.count = 0

    def add(self, examples: int) -> None:
        self.count += examples
        now = self.clock()
        if now - self._last_line >= self.every_seconds:
            self._last_line = now
            print(self.line(), flush=True)

    @property
    def seconds(self) -> float:
        return max(self.clock() - self.started, 1e-9)

    @property
    def rate(self) -> float:
        return self.count / self.seconds

    def line(self) -> str:
        done = self.already + self.count
        if self.total is None:
            return f"{self.label}: {done:,} examples  {self.rate:.1f} examples/s"
        left = max(self.total - done, 0)
        eta = datetime.timedelta(seconds=round(left / max(self.rate, 1e-9)))
        return (
            f"{self.label}: {done:,}/{self.total:,} examples ({100 * done / self.total:.1f}%)  "
            f"{self.rate:.1f} examples/s  ETA {eta}"
        )
