"""How many programs this process has lowered for XLA (each a miss of jax's in-memory jit
cache, whether or not the on-disk cache then spares the compile): for /metrics, and for the
tests that check nothing compiles on a server's request path."""

from __future__ import annotations

import threading

import jax

# Recorded once per program jax lowers to MLIR, before the backend compiles it.
_LOWERED = "/jax/core/compile/jaxpr_to_mlir_module_duration"

_lock = threading.Lock()
_count = 0
_listening = False


def _on_event(event: str, duration: float, **_) -> None:
    global _count
    if event == _LOWERED:
        with _lock:
            _count += 1


def lowered() -> int:
    """Programs lowered since the first call of this function in this process."""
    global _listening
    with _lock:
        if not _listening:
            jax.monitoring.register_event_duration_secs_listener(_on_event)
            _listening = True
        return _count
