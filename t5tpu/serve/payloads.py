"""What the server's routes accept, checked before anything is queued.

Every route takes Vertex AI's shape, `{"instances": [...], "parameters": {...}}`. Anything else
(a body that is not JSON, a field of the wrong type, an empty or too long list of instances, an
unknown field or parameter) is a PayloadError: an HTTP status and a one-line message naming the
field. The tasks' routes are checked against the fields and parameters they declare
(t5tpu/tasks/serving.py). Nothing here touches the model, so a bad request costs the server no
model time.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence

from t5tpu import validators
from t5tpu.errors import UserError
from t5tpu.model import decoding_settings
from t5tpu.model.decoding_settings import DecodingSettings
from t5tpu.tasks.serving import Field, Route

# Every option of DecodingSettings by its name, and the earlier names it still takes.
DECODING_PARAMETERS = (*decoding_settings.NAMES, *decoding_settings.ALIASES)
# The parameter naming the task whose route a request uses.
TASK = "task"
# The parameter naming the LoRA adapter a request runs with (a server started with --adapter).
ADAPTER = "adapter"
# true: the texts are the model's inputs as they are, not shaped as the run's task did (the
# name `t5tpu infer` (INFER_EXACT_INPUTS) and t5tpu.load's predict give the same switch).
EXACT_INPUTS = "exact_inputs"
# false: a task route asks a model trained on another task all the same.
CHECK_TASK = "check_task"
# true: /v1/predict answers in server-sent events, each answer's text as it decodes.
STREAM = "stream"
_INPUT, _TARGET = Field("input"), Field("target")


class PayloadError(Exception):
    """A request the server refuses: `status` (4xx) and a one-line message."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclasses.dataclass(frozen=True)
class Limits:
    """The bounds a request must keep: instances per request, the longest decode, the vocabulary
    (top_k's upper bound), and the adapters a request may name (none: no "adapter" parameter)."""

    max_instances: int
    max_length: int
    vocab_size: int
    adapters: tuple[str, ...] = ()

    def with_adapter(self, allowed: tuple[str, ...]) -> tuple[str, ...]:
        """The parameters `allowed`, and "adapter" where the server has adapters."""
        return (*allowed, ADAPTER) if self.adapters else allowed


@dataclasses.dataclass(frozen=True)
class PredictRequest:
    """/v1/predict: the texts, whether they came as {"input": ...} objects (answered as
    {"prediction": ...} objects), the decoding settings, and the task whose input format and
    post-processing apply (None: the texts are the model's input as they are)."""

    texts: tuple[str, ...]
    objects: bool
    decoding: DecodingSettings
    task: str | None = None
    adapter: str | None = None
    exact_inputs: bool = False
    stream: bool = False


@dataclasses.dataclass(frozen=True)
class ScoreRequest:
    """/v1/score: input and target texts, pairwise, and the task that formats the inputs."""

    inputs: tuple[str, ...]
    targets: tuple[str, ...]
    task: str | None = None
    adapter: str | None = None
    exact_inputs: bool = False


@dataclasses.dataclass(frozen=True)
class TaskRequest:
    """A task route's request: the route its "task" parameter chose (else the one of the task
    the model was trained on), each instance's values by field name, and the decoding
    settings."""

    route: Route
    instances: tuple[dict, ...]
    decoding: DecodingSettings
    adapter: str | None = None
    exact_inputs: bool = False


def parse_json(body: bytes) -> dict:
    """The request body as a JSON object with nothing but "instances" and "parameters"."""
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise PayloadError(f"the body is not JSON: {e}") from None
    except RecursionError:
        raise PayloadError("the body's JSON is nested too deeply") from None
    if not isinstance(payload, dict):
        raise PayloadError(f"the body must be a JSON object, got {_kind(payload)}")
    unknown = sorted(set(payload) - {"instances", "parameters"})
    if unknown:
        raise PayloadError(f"unknown field {unknown[0]!r}; the body has instances and parameters")
    return payload


def _kind(value) -> str:
    names = {dict: "an object", list: "an array", str: "a string", bool: "a boolean"}
    if value is None:
        return "null"
    return names.get(type(value), "a number")


def _instances(payload: dict, limits: Limits) -> list:
    instances = payload.get("instances")
    if instances is None:
        raise PayloadError('"instances" is missing: send {"instances": [...]}')
    if not isinstance(instances, list):
        raise PayloadError(f'"instances" must be an array, got {_kind(instances)}')
    if not instances:
        raise PayloadError('"instances" is empty: send at least one')
    if len(instances) > limits.max_instances:
        raise PayloadError(
            f"{len(instances)} instances; at most {limits.max_instances} per request "
            "(send the rest in other requests)"
        )
    return instances


def _text(value, where: str) -> str:
    if not isinstance(value, str):
        raise PayloadError(f"{where} must be a string, got {_kind(value)}")
    return _unicode(value, where)


def _unicode(text: str, where: str) -> str:
    """`text`, unless it holds a lone surrogate: JSON's \\ud800 escape alone parses to a string
    no encoder (the tokenizer's) can write."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise PayloadError(
            f"{where} has a lone surrogate escape (such as \\ud800 alone), which no Unicode "
            "text holds; send text, or a surrogate pair for a character beyond U+FFFF"
        ) from None
    return text


_TYPE_NAMES = {
    str: "a string",
    int: validators.whole().wanted,
    float: "a number",
    bool: "a boolean",
}


def _typed(value, kind: type, where: str):
    """`value` if JSON gave it type `kind` (an integer is a number too; a boolean is
    neither)."""
    if kind is float:
        if not validators.is_number(value):
            raise PayloadError(f"{where} must be {_TYPE_NAMES[kind]}, got {_kind(value)}")
        return float(value)
    if not validators.is_instance(value, kind):
        raise PayloadError(f"{where} must be {_TYPE_NAMES[kind]}, got {_kind(value)}")
    return _unicode(value, where) if kind is str else value


def _fields(instance, where: str, fields: Sequence[Field]) -> dict:
    """The values of an {field: value} instance by name: every required field present, no
    unknown one, each of its type; an optional field left out takes its default."""
    if not isinstance(instance, dict):
        wanted = ", ".join(f'"{field.name}": ...' for field in fields)
        raise PayloadError(f"{where} must be an object {{{wanted}}}, got {_kind(instance)}")
    names = [field.name for field in fields]
    unknown = sorted(set(instance) - set(names))
    if unknown:
        raise PayloadError(f"{where} has unknown field {unknown[0]!r}; it takes {', '.join(names)}")
    missing = [field.name for field in fields if field.required and field.name not in instance]
    if missing:
        raise PayloadError(f'{where} has no "{missing[0]}"')
    return {
        field.name: _typed(instance[field.name], field.type, f"{where}.{field.name}")
        if field.name in instance
        else field.default
        for field in fields
    }


def _parameters(payload: dict, allowed: tuple[str, ...]) -> dict:
    parameters = payload.get("parameters", {})
    if parameters is None:
        return {}
    if not isinstance(parameters, dict):
        raise PayloadError(f'"parameters" must be an object, got {_kind(parameters)}')
    unknown = sorted(set(parameters) - set(allowed))
    if unknown:
        takes = f"it takes {', '.join(allowed)}" if allowed else "this route takes none"
        raise PayloadError(f"unknown parameter {unknown[0]!r}; {takes}")
    return parameters


def _decoding(parameters: dict, defaults: DecodingSettings, limits: Limits) -> DecodingSettings:
    """The request's settings: `defaults` with the options it gives, checked as every front end
    checks them (decoding_settings), its length within the longest output served."""
    try:
        chosen = decoding_settings.given(parameters, defaults)
        chosen.check(
            limits.vocab_size,
            longest=limits.max_length,
            name=decoding_settings.as_given(parameters, lambda option: f"parameter {option}"),
            shown=json.dumps,
        )
    except UserError as e:
        raise PayloadError(str(e)) from None
    return chosen


def _one_answer(decoding: DecodingSettings, where: str) -> None:
    if decoding.num_return_sequences > 1:
        raise PayloadError(f"{where} gives one answer an instance: leave out num_return_sequences")


def _flag(parameters: dict, name: str, default: bool) -> bool:
    value = parameters.pop(name, default)
    if not validators.boolean().accepts(value):
        raise PayloadError(f"parameter {name} = {json.dumps(value)} must be true or false")
    return value


def _task(parameters: dict) -> str | None:
    task = parameters.pop(TASK, None)
    if task is not None and not isinstance(task, str):
        raise PayloadError(f"parameter {TASK}={json.dumps(task)} must be a task's name")
    return task


def _adapter(parameters: dict, limits: Limits) -> str | None:
    """The adapter the "adapter" parameter names (None: the base alone), one of the server's."""
    adapter = parameters.pop(ADAPTER, None)
    if adapter is not None and adapter not in limits.adapters:
        raise PayloadError(
            f"parameter {ADAPTER}={json.dumps(adapter)} is not an adapter this server has; "
            f"choose one of {', '.join(limits.adapters)}, or leave it out for the base model"
        )
    return adapter


def predict_request(
    payload: dict, *, defaults: Callable[[str | None], DecodingSettings], limits: Limits
) -> PredictRequest:
    """/v1/predict's request: strings, or {"input": ...} objects (all of one kind); `defaults`
    gives the decoding defaults of the model or the adapter the request names."""
    instances = _instances(payload, limits)
    objects = isinstance(instances[0], dict)
    if objects:
        texts = [_fields(x, f"instances[{i}]", (_INPUT,))["input"] for i, x in enumerate(instances)]
    else:
        texts = [_text(x, f"instances[{i}]") for i, x in enumerate(instances)]
    allowed = (*DECODING_PARAMETERS, TASK, EXACT_INPUTS, STREAM)
    parameters = dict(_parameters(payload, limits.with_adapter(allowed)))
    task, adapter = _task(parameters), _adapter(parameters, limits)
    exact, stream = _flag(parameters, EXACT_INPUTS, False), _flag(parameters, STREAM, False)
    if stream and task is not None:
        raise PayloadError(
            f"parameter {STREAM} streams the model's own text, which task {json.dumps(task)} "
            "would post-process; leave out one of them"
        )
    decoding = _decoding(parameters, defaults(adapter), limits)
    if stream or task is not None:
        _one_answer(decoding, f"parameter {STREAM}" if stream else f"parameter {TASK}")
    return PredictRequest(
        texts=tuple(texts),
        objects=objects,
        decoding=decoding,
        task=task,
        adapter=adapter,
        exact_inputs=exact,
        stream=stream,
    )


def score_request(payload: dict, *, limits: Limits) -> ScoreRequest:
    """/v1/score's request: {"input": ..., "target": ...} objects; "task", "exact_inputs" (and
    "adapter") the only parameters."""
    instances = _instances(payload, limits)
    parameters = dict(_parameters(payload, limits.with_adapter((TASK, EXACT_INPUTS))))
    task, adapter = _task(parameters), _adapter(parameters, limits)
    exact = _flag(parameters, EXACT_INPUTS, False)
    pairs = [_fields(x, f"instances[{i}]", (_INPUT, _TARGET)) for i, x in enumerate(instances)]
    return ScoreRequest(
        inputs=tuple(pair["input"] for pair in pairs),
        targets=tuple(pair["target"] for pair in pairs),
        task=task,
        adapter=adapter,
        exact_inputs=exact,
    )


def choose(
    offers: Sequence[Route], task: str | None, where: str, model_tasks: tuple[str, ...] = ()
) -> Route:
    """The route of `offers` (one name, several tasks) that parameter "task" names, by default
    the one of a task the model was trained on (`model_tasks`), else the first."""
    if task is None:
        trained = [route for route in offers if any(route.serves(t) for t in model_tasks)]
        return (trained or list(offers))[0]
    for route in offers:
        if route.task == task:
            return route
    given = f"parameter {TASK}={json.dumps(task)}"
    if not offers:
        raise PayloadError(
            f"{given}: no task here formats {where}'s input; leave it out (the model shapes "
            "its inputs as its run did), or serve with the gin files naming your task module"
        )
    tasks = ", ".join(route.task for route in offers)
    raise PayloadError(f"{given} must be one of {tasks} ({where})")


def task_request(
    offers: Sequence[Route],
    payload: dict,
    *,
    defaults: Callable[[str | None], DecodingSettings],
    limits: Limits,
    model_tasks: Callable[[str | None], tuple[str, ...]],
) -> TaskRequest:
    """A task route's request. The route takes the decoding parameters unless it fixes its own
    settings, "task" when several tasks offer it, "check_task" and "exact_inputs". A model (or
    adapter) whose run trained on another task (`model_tasks(adapter)`) is refused with a 400
    unless "check_task" is false."""
    instances = _instances(payload, limits)
    decodes_as_declared = all(route.decoding is not None for route in offers)
    allowed = () if decodes_as_declared else DECODING_PARAMETERS
    if len(offers) > 1:
        allowed = (*allowed, TASK)
    allowed = (*allowed, CHECK_TASK, EXACT_INPUTS)
    parameters = dict(_parameters(payload, limits.with_adapter(allowed)))
    task, adapter = _task(parameters), _adapter(parameters, limits)
    trained_on = model_tasks(adapter)
    route = choose(offers, task, f"/v1/{offers[0].name}", trained_on)
    values = tuple(_fields(x, f"instances[{i}]", route.fields) for i, x in enumerate(instances))
    problem = _flag(parameters, CHECK_TASK, True) and route.mismatch(trained_on)
    if problem:
        raise PayloadError(f'{problem}; send "parameters": {{"{CHECK_TASK}": false}} to ask it')
    exact = _flag(parameters, EXACT_INPUTS, False)
    if route.decoding is not None:
        decoding = decoding_settings.given(route.decoding, defaults(adapter))
    else:
        decoding = _decoding(parameters, defaults(adapter), limits)
    _one_answer(decoding, f"/v1/{route.name}")
    return TaskRequest(
        route=route, instances=values, decoding=decoding, adapter=adapter, exact_inputs=exact
    )
