"""The train loop's console progress line: step, loss, learning rate, examples/s and ETA."""

from __future__ import annotations

import datetime
import time

from t5tpu.data import batches


class Progress:
    """Console progress: step, loss, learning rate, examples/s and ETA. Examples are counted as
    they are read (packed rows hold several); a host reads one of `num_shards` shards of each
    global batch, so its count is scaled by that number."""

    def __init__(self, first_step: int, last_step: int, num_shards: int = 1):
        self.last_step = last_step
        self.num_shards = num_shards
        self._mark = (first_step, time.time())
        self._examples = 0

    def add_examples(self, host_batch: dict) -> None:
        self._examples += batches.examples_in(host_batch) * self.num_shards

    def report(self, step: int, metrics: dict) -> dict:
        """Prints the line for `step` and returns the rates since the previous report."""
        mark_step, mark_time = self._mark
        now = time.time()
        seconds = max(now - mark_time, 1e-9)
        steps_per_s = (step - mark_step) / seconds
        examples_per_s = self._examples / seconds
        self._mark, self._examples = (step, now), 0
        eta = (self.last_step - step) / max(steps_per_s, 1e-9)
        rate = f"lr {metrics['learning_rate']:.3g}  " if "learning_rate" in metrics else ""
        print(
            f"step {step}/{self.last_step}  loss {metrics['loss']:.4f}  "
            f"token_acc {metrics['token_accuracy']:.3f}  {rate}"
            f"{examples_per_s:.1f} examples/s  "
            f"ETA {datetime.timedelta(seconds=round(eta))}",
            flush=True,
        )
        return {"steps_per_sec": steps_per_s, "examples_per_sec": examples_per_s}
