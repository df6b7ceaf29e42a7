"""Signals the train loop answers between steps: SIGTERM (what a TPU VM gets before preemption)
saves a checkpoint at the current step and exits cleanly; Ctrl-C stops without saving."""

from __future__ import annotations

import signal
import threading

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


class CtrlCBetweenSteps:
    """Holds Ctrl-C until the step, save or evaluation under way is done; `check` then raises
    KeyboardInterrupt. Raised inside TensorFlow's writing of the input position, it was seen to
    corrupt the heap and abort the process. A second Ctrl-C raises at once."""

    def __init__(self):
        self._pressed = False
        self._previous = None
        if threading.current_thread() is threading.main_thread() and (
            signal.getsignal(signal.SIGINT) != signal.SIG_IGN  # a background job's stays ignored
        ):
            self._previous = signal.signal(signal.SIGINT, self._on_sigint)

    def _on_sigint(self, signum, frame):
        del signum, frame
        if self._pressed:
            raise KeyboardInterrupt
        self._pressed = True

    def check(self) -> None:
        if self._pressed:
            raise KeyboardInterrupt

    def close(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
