"""The values each run macro accepts, checked once the gin files and flags are parsed, before
anything is compiled, read or written.

A macro's value reaches code in many places (LEARNING_RATE an optax schedule, DROPOUT_RATE the
model config, TASK_FEATURE_LENGTHS the data pipeline and the model's shapes), where a bad one
fails late: a traceback after training has started, or no failure at all (a negative learning
rate trains uphill). Checking the macros themselves names the setting the user wrote.
Macros an experiment does not bind are skipped, and so is a value that is a gin reference
(`LEARNING_RATE = @my_schedule()`): its configurable checks its own arguments.
"""

from __future__ import annotations

import dataclasses

import gin

from t5tpu import validators
from t5tpu.model import decoding_settings
from t5tpu.validators import Rule


@dataclasses.dataclass(frozen=True)
class Limit:
    """What a macro accepts (a validators.Rule) and a value to show as an example."""

    rule: Rule
    example: str


def _lengths(value) -> bool:
    return (
        isinstance(value, dict)
        and bool(value)
        and all(validators.is_whole(length, low=1) for length in value.values())
    )


def _positive(example: str) -> Limit:
    return Limit(validators.whole(low=1), example)


def _count(example: str) -> Limit:
    return Limit(validators.whole(low=0), example)


_OPTIONAL_COUNT = Limit(validators.optional(validators.whole(low=1)), "None")
# None where a path may be left out (MODEL_DIR: a server given --model); '' or a number never.
_PATH = validators.optional(validators.path())
# An example value of each decoding option that has a macro (its name in capitals).
_DECODING_EXAMPLES = {
    **{"num_beams": "4", "beam_alpha": "0.6", "length_penalty": "1.0", "temperature": "0.7"},
    **{"top_k": "40", "top_p": "0.9", "repetition_penalty": "1.2", "seed": "1"},
    **{"no_repeat_ngram_size": "3", "min_new_tokens": "4", "num_return_sequences": "3"},
}

LIMITS: dict[str, Limit] = {
    "MODEL_DIR": Limit(_PATH, "\"'/tmp/run'\""),
    "INITIAL_CHECKPOINT_PATH": Limit(_PATH, "\"'/path/to/checkpoint_1000000'\""),
    "EVAL_OUTPUT_DIR": Limit(_PATH, "\"'/tmp/eval'\""),
    "INFER_INPUT_FILE": Limit(_PATH, "\"'inputs.txt'\""),
    "INFER_OUTPUT_DIR": Limit(_PATH, "\"'/tmp/predictions'\""),
    "PREPARED_DATA": Limit(_PATH, "\"'/tmp/qp_prepared.npz'\""),
    "LEARNING_RATE": Limit(validators.number(above=0), "0.001"),
    "TRAIN_STEPS": _count("1000"),
    "BATCH_SIZE": _positive("32"),
    "EVAL_BATCH_SIZE": _positive("32"),
    "INFER_BATCH_SIZE": _positive("32"),
    "INFER_CHUNK_SIZE": _positive("4096"),
    "INFER_SHARD_ID": _count("0"),
    "INFER_NUM_SHARDS": _positive("2"),
    "NUM_MICROBATCHES": _positive("2"),
    "SAVE_PERIOD": _positive("1000"),
    "EVAL_PERIOD": _count("1000"),
    "KEEP_CHECKPOINTS": _OPTIONAL_COUNT,
    "KEEP_PERIOD": _OPTIONAL_COUNT,
    "EVAL_NUM_EXAMPLES": _OPTIONAL_COUNT,
    "INFER_NUM_EXAMPLES": _OPTIONAL_COUNT,
    "RANDOM_SEED": _count("0"),
    "DROPOUT_RATE": Limit(validators.number(low=0, below=1), "0.1"),
    # The decoding options' macros take what the options take (decoding_settings.OPTIONS).
    **{
        name.upper(): Limit(decoding_settings.OPTIONS[name], example)
        for name, example in _DECODING_EXAMPLES.items()
    },
    # None: infer's "the run's" (a run that trains or evaluates still needs them).
    "TASK_FEATURE_LENGTHS": Limit(
        validators.optional(Rule(_lengths, "a dict of feature lengths >= 1")),
        "\"{'inputs': 512, 'targets': 128}\"",
    ),
    "INFER_EXACT_INPUTS": Limit(validators.boolean(), "True"),
}


def _bound_value(name: str):
    """The macro's literal value; None when it is unbound or a gin reference."""
    try:
        value = gin.query_parameter(f"%{name}")
    except ValueError:
        return None, False
    if isinstance(value, gin.config.ConfigurableReference):  # also %OTHER_MACRO, %gin.REQUIRED
        return None, False
    return value, True


def check_macros() -> None:
    """A UserError naming the first macro whose value is out of its limits."""
    for name, limit in LIMITS.items():
        value, bound = _bound_value(name)
        if bound:
            limit.rule.check(name, value, example=f"--gin.{name}={limit.example}")
