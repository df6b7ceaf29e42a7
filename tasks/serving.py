"""What a task offers `t5tpu serve`, declared as data: routes, which the server mounts without
knowing any task.

A Route is `POST /v1/<name>`: each instance is an object of the route's fields; `prompt` turns
them into the task's input text, which the model shapes as its run shaped its training inputs;
the model's decoded text becomes the answer's value through `respond`, answered as `{name:
value}`. A route asks models trained on its task: another model is refused (check_task=False,
or the parameter "check_task": false, insists). A name that several tasks offer takes the
parameter "task" to choose one (default: the one the model was trained on, else the first
offered). A route named PREDICT takes the one field INPUT: it formats /v1/predict's and
/v1/score's input when a request names its task.

The built-in task modules declare theirs in `routes()`, next to `register`; a user's module
(MIXTURE_OR_TASK_MODULE) calls `add_routes` when it is imported.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping

from t5tpu.tasks.registry import TextModel

from t5tpu.errors import UserError

PREDICT = "predict"
INPUT = "input"
# Taken by the server's own routes: no task route may use them as its path.
_RESERVED = ("score",)
_NAME = re.compile(r"[A-Za-z0-9_.-]+")
FIELD_TYPES = (str, int, float, bool)


@dataclasses.dataclass(frozen=True)
class Field:
    """One field of a route's instances: its JSON type (str, int, float or bool) and, when it
    is optional, the value it takes when left out."""

    name: str
    type: type = str
    required: bool = True
    default: object = None

    def __post_init__(self):
        if self.type not in FIELD_TYPES:
            raise ValueError(f"field {self.name!r}: type must be one of {FIELD_TYPES}")


def _as_text(output: str) -> str:
    return output


@dataclasses.dataclass(frozen=True)
class Route:
    """`POST /v1/<name>`, offered by seqio task `task` (and the same task over other sources,
    `aliases`): it asks models trained on one of them. `prompt` puts the fields in the task's
    words; the model then shapes that text as its run shaped its training inputs (a Quora
    model lower-cases it). `decoding` fixes settings (e.g. max_new_tokens) and then the route takes
    no decoding parameters; None takes the request's."""

    name: str
    task: str
    fields: tuple[Field, ...]
    prompt: Callable[..., str]  # the fields' values as keyword arguments -> the input text
    respond: Callable[[str], object] = _as_text  # the decoded text -> the answer's value
    decoding: Mapping[str, object] | None = None
    aliases: tuple[str, ...] = ()

    def __post_init__(self):
        if not _NAME.fullmatch(self.name) or self.name in _RESERVED:
            raise ValueError(f"route name {self.name!r}: letters, digits, _ . - and not score")
        if self.name == PREDICT and [f.name for f in self.fields] != [INPUT]:
            raise ValueError(f"a {PREDICT!r} route takes one field, {INPUT!r}")

    def serves(self, task: str) -> bool:
        return task in (self.task, *self.aliases)

    def mismatch(self, model_tasks: tuple[str, ...]) -> str | None:
        """Why a model trained on `model_tasks` (() when unknown: not refused) is not one this
        route asks, else None."""
        if not model_tasks or any(self.serves(task) for task in model_tasks):
            return None
        return (
            f"the model was trained on {', '.join(model_tasks)}, not {self.task}: its answer to "
            f"a {self.name} question would not mean one"
        )

    def ask(
        self,
        model: TextModel,
        values: Mapping[str, object],
        *,
        check_task: bool = True,
        **decoding_settings,
    ):
        """The answer of `model` (T5Model.predict's decoding settings) to one instance, as the
        server gives it; a model of another task is refused unless `check_task` is False."""
        problem = check_task and self.mismatch(tuple(getattr(model, "tasks", ())))
        if problem:
            raise UserError(f"{model.source}: {problem}; pass check_task=False to ask it anyway")
        settings = {**decoding_settings, **(self.decoding or {})}
        return self.respond(model.predict([self.prompt(**values)], **settings)[0])


def chosen(routes: tuple[Route, ...], task: str | None, model_tasks: tuple[str, ...]) -> Route:
    """The route of `task` among routes of one name; without `task`, the one the model was
    trained on, else the first (the default). `task` must be one they offer."""
    if task is not None:
        named = [route for route in routes if route.task == task]
        if not named:
            raise ValueError(f"task {task!r} is not one of {[route.task for route in routes]}")
        return named[0]
    trained = [route for route in routes if any(route.serves(t) for t in model_tasks)]
    return (trained or list(routes))[0]


def placeholder(field: Field) -> object:
    """A value of the field's type, for prompts built only to warm up."""
    return "warm up" if field.type is str else field.type()


# Routes added by users' modules, by (name, task): adding one again replaces it in place.
_ADDED: dict[tuple[str, str], Route] = {}


def add_routes(*routes: Route) -> None:
    """Offers `routes` to `t5tpu serve` (call it where your module registers its tasks)."""
    for route in routes:
        _ADDED[(route.name, route.task)] = route


def added_routes() -> tuple[Route, ...]:
    return tuple(_ADDED.values())
