"""TensorFlow and seqio, imported when first used.

Importing them is a large part of a command's start (seqio imports TensorFlow; see
docs/PERFORMANCE.md, "First answer"), yet parsing gin files, `t5tpu plan`, the tools and
decoding inputs given on the command line need neither. The modules that use them for tasks,
input pipelines and file checks write

    from t5tpu.runtime.lazy_imports import seqio, tf

instead of importing them: the names are bound at once, and the real import happens on the
first attribute read (`tf.data`, `seqio.get_mixture_or_task`). Annotations only (with
`from __future__ import annotations`) read nothing.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from types import ModuleType


def import_tensorflow_quietly() -> ModuleType:
    """TensorFlow, imported with file descriptor 2 muted: it prints CUDA-probing lines from C++
    at import, which TF_CPP_MIN_LOG_LEVEL no longer silences. An import error still raises
    normally once stderr is back. Kept off accelerators, which jax owns. Once imported (by
    this or by the caller's own code), it is returned as it is: its devices can be set only
    before it first runs."""
    if "tensorflow" in sys.modules:
        return sys.modules["tensorflow"]
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        import tensorflow

        tensorflow.config.set_visible_devices([], "GPU")
    finally:
        os.dup2(saved, 2)
        os.close(devnull)
        os.close(saved)
    return tensorflow


def _import_seqio() -> ModuleType:
    import_tensorflow_quietly()  # seqio imports it: quietly, first
    import seqio

    return seqio


class _Deferred:
    """Stands for a module until an attribute of it is read; then imports it with `load`."""

    def __init__(self, load: Callable[[], ModuleType]):
        self._load = load
        self._module: ModuleType | None = None

    def __getattr__(self, name: str):
        # Called only for names the instance lacks: every module attribute.
        if name.startswith("__"):  # copy, pickle and inspect probing: not a use
            raise AttributeError(name)
        if self._module is None:
            self._module = self._load()
        return getattr(self._module, name)


tf = _Deferred(import_tensorflow_quietly)
seqio = _Deferred(_import_seqio)
