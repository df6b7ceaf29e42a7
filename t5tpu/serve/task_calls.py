"""The tasks' routes as the server sees them: whatever t5tpu.tasks lists (tasks/serving.py),
looked up once the model is loaded, and their prompts.

The list depends on gin (MIXTURE_OR_TASK_MODULE), which the model's loading parses: so it is
read on first use after that, or by `warm_up`. Prompts are the tasks' Python functions (the ones
their training calls too), pure and quick: built in each request's thread, with no lock. Their
decoding is batched with everyone else's.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from t5tpu.config import gin_setup
from t5tpu.serve import payloads
from t5tpu.tasks.serving import PREDICT, Route, placeholder

# Where the run's gin files name the user's task module (the one `t5tpu infer` imports).
TASK_MODULE_SETTING = "infer.mixture_or_task_module"


class TaskRoutes:
    """Route name -> the routes offering it (one per task, the default first)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._table: dict[str, tuple[Route, ...]] | None = None

    def table(self) -> dict[str, tuple[Route, ...]]:
        with self._lock:
            if self._table is None:
                self._table = _lookup()
            return self._table

    def offers(self, name: str, method: str) -> tuple[Route, ...]:
        """The routes named `name`, or a 404 naming the ones there are."""
        table = self.table()
        if name == PREDICT or name not in table:
            known = ", ".join(f"/v1/{other}" for other in table if other != PREDICT)
            raise payloads.PayloadError(
                f"Not Found: {method} /v1/{name} (the tasks' routes here: {known or 'none'})", 404
            )
        return table[name]

    def formatting(self, task: str | None, where: str) -> Route | None:
        """The route of `task` that formats /v1/predict's and /v1/score's input (None for
        none: the input goes to the model as it is)."""
        if task is None:
            return None
        return payloads.choose(self.table().get(PREDICT, ()), task, where)

    def prompts(self, route: Route, instances: Sequence[dict]) -> list[str]:
        """Each instance's input text, in the route's task's words."""
        return [route.prompt(**values) for values in instances]

    def warm_up(self) -> None:
        """Reads the routes (importing the task modules and the user's) and builds a prompt of
        each, so that the first request waits for neither."""
        for routes in self.table().values():
            for route in routes:
                self.prompts(route, [{field.name: placeholder(field) for field in route.fields}])


def _lookup() -> dict[str, tuple[Route, ...]]:
    # Imported here: the task modules are not needed until a task route is asked for.
    from t5tpu import tasks

    table: dict[str, list[Route]] = {}
    for route in tasks.served_routes(gin_setup.bound_value(TASK_MODULE_SETTING)):
        table.setdefault(route.name, []).append(route)
    return {name: tuple(routes) for name, routes in table.items()}
