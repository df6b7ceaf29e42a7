"""What the server's routes accept, checked before anything is queued.

Every route takes Vertex AI's shape, `{"instances": [...], "parameters": {...}}`. Anything else
(a body that is not JSON, a field of the wrong type, an empty or too long list of instances, an
unknown field or parameter) is a PayloadError: an HTTP status and a one-line message naming the
field. Nothing here touches the model, so a bad request costs the server no model time.
"""

from __future__ import annotations

import dataclasses
import json

from t5tpu import validators

# Beam search holds num_beams hypotheses per row: a bound keeps one request from asking for a
# batch many times the compiled one.
MAX_NUM_BEAMS = 16
_MAX_SEED = 2**31 - 1
DECODING_PARAMETERS = ("num_beams", "max_length", "temperature", "top_k", "seed")
# The fields of each task route's instances, in the order its task function takes them.
TASK_FIELDS = {
    "is_duplicate": ("question1", "question2"),
    "similar_question": ("question",),
    "answer": ("question", "context"),
}
SQUAD_TASKS = ("squad_v1", "squad_v2")


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

    @property
    def samples(self) -> bool:
        return self.num_beams == 1 and self.temperature > 0

    @property
    def program(self) -> tuple:
        """What the compiled decoding program depends on (the seed only feeds the row keys)."""
        return (self.num_beams, self.max_length, self.temperature, self.top_k)

    def as_settings(self) -> dict:
        """T5Model.predict's keyword arguments, as the task functions pass them on."""
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Limits:
    """The bounds a request must keep: instances per request, the longest decode, the vocabulary
    (top_k's upper bound)."""

    max_instances: int
    max_length: int
    vocab_size: int


@dataclasses.dataclass(frozen=True)
class PredictRequest:
    """/v1/predict: the texts, whether they came as {"input": ...} objects (answered as
    {"prediction": ...} objects) and the decoding settings."""

    texts: tuple[str, ...]
    objects: bool
    decoding: Decoding


@dataclasses.dataclass(frozen=True)
class ScoreRequest:
    """/v1/score: input and target texts, pairwise."""

    inputs: tuple[str, ...]
    targets: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class TaskRequest:
    """A task route's instances (each a tuple of its fields' texts), the decoding settings
    (is_duplicate's task function overrides max_length) and the SQuAD task whose prompt
    /v1/answer uses."""

    route: str
    instances: tuple[tuple[str, ...], ...]
    decoding: Decoding
    squad_task: str = SQUAD_TASKS[0]


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
    return value


def _fields(instance, where: str, fields: tuple[str, ...]) -> tuple[str, ...]:
    """The texts of an {field: text} instance: every field present, no other."""
    if not isinstance(instance, dict):
        wanted = ", ".join(f'"{name}": "..."' for name in fields)
        raise PayloadError(f"{where} must be an object {{{wanted}}}, got {_kind(instance)}")
    unknown = sorted(set(instance) - set(fields))
    if unknown:
        takes = ", ".join(fields)
        raise PayloadError(f"{where} has unknown field {unknown[0]!r}; it takes {takes}")
    missing = [name for name in fields if name not in instance]
    if missing:
        raise PayloadError(f'{where} has no "{missing[0]}"')
    return tuple(_text(instance[name], f"{where}.{name}") for name in fields)


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


def _decoding(parameters: dict, defaults: Decoding, limits: Limits) -> Decoding:
    temperature = parameters.get("temperature", defaults.temperature)
    rule = validators.number(low=0)
    if not rule.accepts(temperature):
        raise PayloadError(
            rule.message("parameter temperature", temperature, shown=json.dumps)
            + " (0 is greedy, above 0 samples)"
        )
    decoding = Decoding(
        num_beams=_whole(parameters, "num_beams", 1, MAX_NUM_BEAMS, defaults.num_beams),
        max_length=_whole(parameters, "max_length", 1, limits.max_length, defaults.max_length),
        temperature=float(temperature),
        top_k=_whole(parameters, "top_k", 0, limits.vocab_size, defaults.top_k),
        seed=_whole(parameters, "seed", 0, _MAX_SEED, defaults.seed),
    )
    if decoding.num_beams > 1 and (decoding.temperature > 0 or decoding.top_k > 0):
        raise PayloadError(
            f"num_beams={decoding.num_beams} is beam search, which does not sample: send "
            "temperature 0 and top_k 0 with it, or num_beams 1 to sample"
        )
    return decoding


def predict_request(payload: dict, *, defaults: Decoding, limits: Limits) -> PredictRequest:
    """/v1/predict's request: strings, or {"input": ...} objects (all of one kind)."""
    instances = _instances(payload, limits)
    objects = isinstance(instances[0], dict)
    if objects:
        texts = [_fields(x, f"instances[{i}]", ("input",))[0] for i, x in enumerate(instances)]
    else:
        texts = [_text(x, f"instances[{i}]") for i, x in enumerate(instances)]
    decoding = _decoding(_parameters(payload, DECODING_PARAMETERS), defaults, limits)
    return PredictRequest(texts=tuple(texts), objects=objects, decoding=decoding)


def score_request(payload: dict, *, limits: Limits) -> ScoreRequest:
    """/v1/score's request: {"input": ..., "target": ...} objects, no parameters."""
    instances = _instances(payload, limits)
    _parameters(payload, ())
    pairs = [_fields(x, f"instances[{i}]", ("input", "target")) for i, x in enumerate(instances)]
    return ScoreRequest(
        inputs=tuple(pair[0] for pair in pairs), targets=tuple(pair[1] for pair in pairs)
    )


def task_request(route: str, payload: dict, *, defaults: Decoding, limits: Limits) -> TaskRequest:
    """A task route's request. is_duplicate decodes as its task function says (no parameters);
    similar_question and answer take the decoding parameters, answer also "task" (squad_v1 or
    squad_v2: whose prompt and post-processing to use)."""
    fields = TASK_FIELDS[route]
    instances = _instances(payload, limits)
    texts = tuple(_fields(x, f"instances[{i}]", fields) for i, x in enumerate(instances))
    if route == "is_duplicate":
        _parameters(payload, ())
        return TaskRequest(route=route, instances=texts, decoding=defaults)
    allowed = (*DECODING_PARAMETERS, "task") if route == "answer" else DECODING_PARAMETERS
    parameters = dict(_parameters(payload, allowed))
    squad_task = parameters.pop("task", SQUAD_TASKS[0])
    if squad_task not in SQUAD_TASKS:
        raise PayloadError(
            f"parameter task={json.dumps(squad_task)} must be one of {', '.join(SQUAD_TASKS)}"
        )
    decoding = _decoding(parameters, defaults, limits)
    return TaskRequest(route=route, instances=texts, decoding=decoding, squad_task=squad_task)
