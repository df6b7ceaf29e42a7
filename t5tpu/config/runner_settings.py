"""A runner's settings, as the parsed gin files bind them, read as a typed object by code that
does not run the runner (`t5tpu serve` answers with the settings `t5tpu infer` would use).

Each field is the runner's argument of the same name: read through the runner's signature, so
an argument renamed in the runner fails here at once instead of being read as unbound.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import TypeVar

import gin

from t5tpu import validators
from t5tpu.config import gin_setup
from t5tpu.model import decoding_settings
from t5tpu.model.decoding_settings import DecodingSettings

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class InferSettings:
    """What `t5tpu infer` (runners.infer.infer) would decode with; None where the runner has
    no default and nothing is bound."""

    model_dir: str | None
    checkpoint_step: int | str
    task_feature_lengths: dict | None
    truncation: str


# What INFER_TRUNCATION chooses between, and what each does with an input that is too long
# (`t5tpu infer` and `t5tpu serve`).
TRUNCATION = {
    "warn": "truncate inputs longer than TASK_FEATURE_LENGTHS['inputs'], with a warning",
    "error": "refuse them",
}


@dataclasses.dataclass(frozen=True)
class TrainSteps:
    """Where the experiment's training (runners.train.train) stops, for the evaluation that
    follows it: TRAIN_STEPS, counted from the start unless relative_steps."""

    train_steps: int | None
    relative_steps: bool


def bound_settings(runner: Callable | str, settings: type[T]) -> T:
    """`settings` (a dataclass) with each field the value `runner`'s argument of that name is
    bound to, else the runner's default, else None (gin.REQUIRED counts as unbound). `runner`
    may be the name gin knows it by: `t5tpu serve` reads infer's settings so, from a layer
    below the runners."""
    if isinstance(runner, str):
        gin_setup.import_configurables()  # registered even when no gin file was parsed
        runner = gin.get_configurable(runner)
    parameters = inspect.signature(runner).parameters
    values = {}
    for field in dataclasses.fields(settings):
        parameter = parameters.get(field.name)
        if parameter is None:
            raise TypeError(f"{runner.__name__} has no argument {field.name!r} for {settings}")
        value = gin_setup.bound_value(f"{runner.__name__}.{field.name}")
        if value is None or value is gin.REQUIRED:
            default = parameter.default
            unset = default is inspect.Parameter.empty or default is gin.REQUIRED
            value = None if unset else default
        values[field.name] = value
    return settings(**values)


def infer_decoding(recorded: DecodingSettings | None = None) -> DecodingSettings:
    """How `t5tpu infer` would decode: each of its decoding arguments where the gin files bind
    it, else `recorded`'s (a run's record), else infer's default. Not checked here: the
    caller checks against the model's vocabulary."""
    gin_setup.import_configurables()
    parameters = inspect.signature(gin.get_configurable("infer")).parameters
    values = {}
    for field in dataclasses.fields(DecodingSettings):
        name = decoding_settings.GIN_NAMES.get(field.name, field.name)
        if name not in parameters:  # max_new_tokens: infer's lengths are TASK_FEATURE_LENGTHS
            continue
        value = gin_setup.bound_value(f"infer.{name}")
        if value is None or value is gin.REQUIRED:
            value = getattr(recorded, field.name) if recorded else parameters[name].default
        if field.type in ("float", "float | None") and validators.is_number(value):
            value = float(value)
        values[field.name] = value
    return DecodingSettings(**values)
