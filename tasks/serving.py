"""What a task offers `t5tpu serve`, declared as data: routes, which the server mounts without
knowing any task.

A Route is `POST /v1/<name>`: each instance is an object of the route's fields; `prompt` turns
them into the task's input text, as the task's preprocessing does; the model's decoded text
becomes the answer's value through `respond`, answered as `{name: value}`. A name that several
tasks offer takes the parameter "task" to choose one (the first offered is the default). A
route named PREDICT takes the one field INPUT: it formats /v1/predict's and /v1/score's input
when a request names its task.

The built-in task modules declare theirs in `routes()`, next to `register`; a user's module
(MIXTURE_OR_TASK_MODULE) calls `add_routes` when it is imported.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping

from t5tpu.tasks.registry import TextModel

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
    """`POST /v1/<name>`, offered by seqio task `task`. `decoding` fixes settings (e.g.
    max_length) and then the route takes no decoding parameters; None takes the request's."""

    name: str
    task: str
    fields: tuple[Field, ...]
    prompt: Callable[..., str]  # the fields' values as keyword arguments -> the input text
    respond: Callable[[str], object] = _as_text  # the decoded text -> the answer's value
    decoding: Mapping[str, object] | None = None

    def __post_init__(self):
        if not _NAME.fullmatch(self.name) or self.name in _RESERVED:
            raise ValueError(f"route name {self.name!r}: letters, digits, _ . - and not score")
        if self.name == PREDICT and [f.name for f in self.fields] != [INPUT]:
            raise ValueError(f"a {PREDICT!r} route takes one field, {INPUT!r}")

    def ask(self, model: TextModel, values: Mapping[str, object], **decoding_settings):
        """The answer of `model` (T5Model.predict's decoding settings) to one instance, as the
        server gives it."""
        settings = {**decoding_settings, **(self.decoding or {})}
        return self.respond(model.predict([self.prompt(**values)], **settings)[0])


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
