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
from t5tpu.model.decoding import LENGTH_PENALTIES, PENALTIES, TEMPERATURES, DecodingSettings
from t5tpu.tasks.serving import Field, Route

# Beam search holds num_beams hypotheses per row: a bound keeps one request from asking for a
# batch many times the compiled one.
MAX_NUM_BEAMS = 16
_MAX_SEED = 2**31 - 1
DECODING_PARAMETERS = (
    *("num_beams", "max_length", "temperature", "top_k", "top_p", "seed"),
    *("repetition_penalty", "no_repeat_ngram_size", "min_new_tokens"),
    *("beam_alpha", "num_return_sequences", "length_penalty"),
)
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
class Decoding:
    """How a request's rows are decoded. Rows whose settings are equal but for the seed share a
    batch: each row samples from a key of its own (the seed folded with its index in its
    request), so a sample never depends on its batch mates."""

    num_beams: int = 1
    max_length: int = 128
    temperature: float = 0.0
    top_k: int = 0
    seed: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    no_repeat_ngram_size: int = 0
    min_new_tokens: int = 0
    beam_alpha: float = 0.6
    num_return_sequences: int = 1
    length_penalty: float | None = None

    def settings(self) -> DecodingSettings:
        """The engine's settings for these, the length limit a row's own (max_new_tokens)."""
        values = dataclasses.asdict(self)
        length = values.pop("max_length")
        return DecodingSettings(**values, max_new_tokens=length)

    @classmethod
    def of(cls, settings: DecodingSettings, *, max_length: int) -> Decoding:
        values = dataclasses.asdict(settings)
        del values["max_new_tokens"]
        return cls(**values, max_length=max_length)


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
    decoding: Decoding
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
    decoding: Decoding
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


def _whole(parameters: dict, name: str, low: int, high: int, default: int) -> int:
    value = parameters.get(name, default)
    rule = validators.whole(low, high)
    if not rule.accepts(value):
        raise PayloadError(rule.message(f"parameter {name}", value, shown=json.dumps))
    return value


def _temperature(parameters: dict, default: float) -> float:
    """0 (greedy) or a temperature float32 programs divide by safely (decoding.TEMPERATURES)."""
    value = parameters.get("temperature", default)
    low, high = TEMPERATURES
    if not (validators.is_number(value) and (value == 0 or low <= value <= high)):
        raise PayloadError(
            f"parameter temperature = {json.dumps(value)} must be 0 (greedy) or a number from "
            f"{low:g} to {high:g} (sampling)"
        )
    return float(value)


def _top_p(parameters: dict, default: float) -> float:
    value = parameters.get("top_p", default)
    if not (validators.is_number(value) and 0 < value <= 1):
        raise PayloadError(f"parameter top_p = {json.dumps(value)} must be above 0 and at most 1")
    return float(value)


def _decoding(parameters: dict, defaults: Decoding, limits: Limits) -> Decoding:
    decoding = Decoding(
        num_beams=_whole(parameters, "num_beams", 1, MAX_NUM_BEAMS, defaults.num_beams),
        max_length=_whole(parameters, "max_length", 1, limits.max_length, defaults.max_length),
        temperature=_temperature(parameters, defaults.temperature),
        top_k=_whole(parameters, "top_k", 0, limits.vocab_size, defaults.top_k),
        top_p=_top_p(parameters, defaults.top_p),
        seed=_whole(parameters, "seed", 0, _MAX_SEED, defaults.seed),
        repetition_penalty=_repetition_penalty(parameters, defaults.repetition_penalty),
        no_repeat_ngram_size=_whole(
            parameters, "no_repeat_ngram_size", 0, limits.max_length, defaults.no_repeat_ngram_size
        ),
        min_new_tokens=_whole(
            parameters, "min_new_tokens", 0, limits.max_length, defaults.min_new_tokens
        ),
        beam_alpha=_beam_alpha(parameters, defaults.beam_alpha),
        num_return_sequences=_whole(
            parameters, "num_return_sequences", 1, MAX_NUM_BEAMS, defaults.num_return_sequences
        ),
        length_penalty=_length_penalty(parameters, defaults.length_penalty),
    )
    if decoding.num_return_sequences > max(decoding.num_beams, 1):
        raise PayloadError(
            f"num_return_sequences={decoding.num_return_sequences} must be at most num_beams "
            f"({decoding.num_beams}): it returns beam search's n best"
        )
    samples = decoding.temperature > 0 or decoding.top_k > 0 or decoding.top_p < 1
    if decoding.num_beams > 1 and samples:
        raise PayloadError(
            f"num_beams={decoding.num_beams} is beam search, which does not sample: send "
            "temperature 0, top_k 0 and top_p 1 with it, or num_beams 1 to sample"
        )
    penalizes = decoding.repetition_penalty != 1 or decoding.no_repeat_ngram_size > 0
    if decoding.num_beams > 1 and (penalizes or decoding.min_new_tokens > 0):
        raise PayloadError(
            f"num_beams={decoding.num_beams} is beam search, which does not take "
            "repetition_penalty, no_repeat_ngram_size or min_new_tokens: leave them out, or "
            "send num_beams 1"
        )
    return decoding


def _one_answer(decoding: Decoding, where: str) -> None:
    if decoding.num_return_sequences > 1:
        raise PayloadError(f"{where} gives one answer an instance: leave out num_return_sequences")


def _beam_alpha(parameters: dict, default: float) -> float:
    value = parameters.get("beam_alpha", default)
    if not (validators.is_number(value) and 0 <= value <= 10):
        raise PayloadError(f"parameter beam_alpha = {json.dumps(value)} must be from 0 to 10")
    return float(value)


def _length_penalty(parameters: dict, default: float | None) -> float | None:
    value = parameters.get("length_penalty", default)
    low, high = LENGTH_PENALTIES
    if value is not None and not (validators.is_number(value) and low <= value <= high):
        raise PayloadError(
            f"parameter length_penalty = {json.dumps(value)} must be null (T5X's beam_alpha) or "
            f"a number from {low:g} to {high:g} (Hugging Face's exponent)"
        )
    return None if value is None else float(value)


def _repetition_penalty(parameters: dict, default: float) -> float:
    value = parameters.get("repetition_penalty", default)
    low, high = PENALTIES
    if not (validators.is_number(value) and low <= value <= high):
        raise PayloadError(
            f"parameter repetition_penalty = {json.dumps(value)} must be a number from {low:g} "
            f"to {high:g} (1: none)"
        )
    return float(value)


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
    payload: dict, *, defaults: Callable[[str | None], Decoding], limits: Limits
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
    defaults: Callable[[str | None], Decoding],
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
        decoding = dataclasses.replace(defaults(adapter), **route.decoding)
    else:
        decoding = _decoding(parameters, defaults(adapter), limits)
    _one_answer(decoding, f"/v1/{route.name}")
    return TaskRequest(
        route=route, instances=values, decoding=decoding, adapter=adapter, exact_inputs=exact
    )
