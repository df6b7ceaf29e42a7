"""Noticing that the machine is about to go away (SIGTERM, what a TPU VM gets before preemption),
so the train loop can save a checkpoint at the current step and exit cleanly."""

from __future__ import annotations

import signal

import jax
from jax.experimental import multihost_utils


class PreemptionWatch:
    """Says whether to save and stop after a step because SIGTERM arrived.

    With several processes every host must stop at the same step (orbax saves collectively), so
    there the decision comes from jax's preemption sync point, which the hosts agree on. Its
    SIGTERM handler is installed by jax.distributed.initialize; a Python handler would replace
    it and the hosts would never hear of the signal, so one is installed only for one process.
    """

    def __init__(self):
        self._signalled = False
        self._previous = None
        if jax.process_count() == 1:
            self._previous = signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum, frame):
        del signum, frame
        self._signalled = True

    def requested(self, step: int) -> bool:
        if jax.process_count() > 1:
            return multihost_utils.reached_preemption_sync_point(step)
        return self._signalled

    def close(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
