"""seqio task registrations.

Nothing registers at import time: the runner calls `register_builtin_tasks` after gin has been
parsed, so every task is built with the vocabulary that the run's gin files bind.
"""

import importlib

from t5tpu.data import vocab
from t5tpu.runtime.lazy_imports import seqio

# Each module here exposes register(vocabulary) returning what it registered: one seqio Task or
# Mixture, or a list of them or of their names.
_TASK_MODULES = ("quora", "squad", "text_to_text")


def register_builtin_tasks() -> list[str]:
    """(Re-)registers every built-in task and mixture with `vocab.default_vocabulary()`;
    returns their names."""
    vocabulary = vocab.default_vocabulary()
    names = []
    for module in _TASK_MODULES:
        registered = importlib.import_module(f"{__name__}.{module}").register(vocabulary)
        names.extend(_names(registered))
    return names


def _names(registered) -> list[str]:
    if isinstance(registered, (seqio.Task, seqio.Mixture)):
        return [registered.name]
    return [item if isinstance(item, str) else item.name for item in registered]
