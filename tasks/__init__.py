"""seqio task registrations.

Nothing registers at import time: the runner calls `register_builtin_tasks` after gin has been
parsed, so every task is built with the vocabulary that the run's gin files bind.
`served_routes` lists what the tasks offer `t5tpu serve` (tasks/serving.py).
"""

import importlib

from t5tpu.data import vocab
from t5tpu.runtime.lazy_imports import seqio

# Each module here exposes register(vocabulary) returning what it registered: one seqio Task or
# Mixture, or a list of them or of their names; and routes(), what it offers `t5tpu serve`.
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


def served_routes(module: str | None = None) -> list:
    """The serving.Routes of the built-in tasks (the text-to-text one as gin describes it),
    then those that the user's `module` (MIXTURE_OR_TASK_MODULE) adds when imported. Registers
    no seqio task, so it reads no data."""
    from t5tpu.tasks import registry, serving

    if module:
        registry.import_task_module(module)
    routes = []
    for name in _TASK_MODULES:
        routes.extend(importlib.import_module(f"{__name__}.{name}").routes())
    return [*routes, *serving.added_routes()]
