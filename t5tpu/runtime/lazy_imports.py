"""TensorFlow and seqio, imported when first used.

Importing them is a large part of a command's start (seqio imports TensorFlow), yet parsing
gin files, `t5tpu plan`, the tools and decoding inputs given on the command line need neither.
The modules that use them for tasks, input pipelines and file checks write

    from t5tpu.runtime.lazy_imports import seqio, tf

instead of importing them: the names are bound at once, and the real import happens on the
first attribute read (`tf.data`, `seqio.get_mixture_or_task`). Annotations only (with
`from __future__ import annotations`) read nothing.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import os
import sys
from collections.abc import Callable, Iterator
from types import ModuleType


def import_tensorflow_quietly() -> ModuleType:
    """TensorFlow, imported as quiet_tensorflow_imports() makes every first import of it. Once
    imported (by this or by the caller's own code), it is returned as it is."""
    quiet_tensorflow_imports()
    import tensorflow

    return tensorflow


def quiet_tensorflow_imports() -> None:
    """Makes the process's first `import tensorflow`, by anyone (seqio, tfds, etils' gs://
    client, the user), quiet: it runs with file descriptor 2 muted, since TensorFlow's C++ prints
    oneDNN and CUDA-probing lines at import before any log level is read, and then keeps
    TensorFlow off accelerators, which jax owns. An import error still raises normally once
    stderr is back. Called where a process starts (the CLI, load(), finetune()), never on
    import; does nothing once TensorFlow is."""
    # Its C++ logging below ERROR once running (GCS credential probes, tf.data notices) stays
    # off too. A user's own 0 or 3 wins; 1 is what importing jax sets when nobody has.
    if os.environ.get("TF_CPP_MIN_LOG_LEVEL", "1") == "1":
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    if "tensorflow" not in sys.modules and _QUIET_FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _QUIET_FINDER)


@contextlib.contextmanager
def _stderr_muted() -> Iterator[None]:
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(devnull)
        os.close(saved)


class _QuietTensorFlowFinder(importlib.abc.MetaPathFinder):
    """Finds `tensorflow` as the other finders do, with a loader that runs it quietly. It stays
    in place until TensorFlow is imported: a mere lookup (etils asks whether it is installed)
    must not use it up."""

    def find_spec(self, fullname, path, target=None):
        if fullname != "tensorflow":
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _QuietLoader(spec.loader)
                return spec
        return None


class _QuietLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader):
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        # TensorFlow sees its own loader, as if this one had never been there.
        module.__loader__ = module.__spec__.loader = self._loader
        with _stderr_muted():
            self._loader.exec_module(module)
            module.config.set_visible_devices([], "GPU")
        _trace_as_written()
        if _QUIET_FINDER in sys.meta_path:
            sys.meta_path.remove(_QUIET_FINDER)


_QUIET_FINDER = _QuietTensorFlowFinder()

# Packages whose tf.data functions are graph code as written (tf.cond, tf.while_loop): tf.data
# traces them without autograph, whose rewriting of their source took seconds of every start.
# `tasks` is this project's task modules (the import name is theirs in any process using them).
AS_WRITTEN = ("seqio", "t5tpu", "tasks")


def _trace_as_written() -> None:
    """Autograph's rules, with AS_WRITTEN's packages first as not to be converted. The rules
    are TensorFlow's internals: where they moved, everything is converted, as by default."""
    try:
        from tensorflow.python.autograph.core import config
    except ImportError:
        return
    rules = tuple(config.DoNotConvert(name) for name in AS_WRITTEN)
    config.CONVERSION_RULES = rules + tuple(config.CONVERSION_RULES)


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
