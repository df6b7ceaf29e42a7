"""What a training run decided about its model's inputs and outputs, saved with every checkpoint
it writes (in the checkpoint's metadata, beside a LoRA run's adapter record) so that it travels
with the model: the task, the lengths, how the task turns a raw input into a model input, and
the decoding defaults. Every front end (`t5tpu infer`, `t5tpu.load`, `t5tpu serve`, the Hugging
Face export) reads it, so one input gets one answer whichever door it comes in by.

This module holds the record as data only; what each kind of input shaping does is the tasks'
(tasks/shaping.py), which this layer does not import.
"""

from __future__ import annotations

import dataclasses

from t5tpu import validators
from t5tpu.errors import UserError
from t5tpu.model.decoding_settings import DecodingSettings
from t5tpu.storage import checkpoints
from t5tpu.storage import model_dir as paths

# The custom metadata key of the record in a checkpoint.
RUN = "run"

# How a task turns a raw input into a model input (tasks/shaping.py does it):
NONE = "none"  # as given: the raw input is the model input (SQuAD, the user's own seqio tasks)
PREFIX = "prefix"  # `prefix` before it: text_to_text's INPUT_PREFIX
QUORA = "quora"  # the Quora tasks' questions lower-cased and their double quotes dropped
SHAPING_KINDS = (NONE, PREFIX, QUORA)


@dataclasses.dataclass(frozen=True)
class InputShaping:
    """How raw inputs become model inputs (`kind`, with its one setting)."""

    kind: str = NONE
    prefix: str = ""  # PREFIX's text
    normalize: bool = True  # QUORA: False when the run bound normalize_questions.normalize off

    @property
    def changes_inputs(self) -> bool:
        return (self.kind == PREFIX and bool(self.prefix)) or (
            self.kind == QUORA and self.normalize
        )

    def record(self) -> dict:
        if self.kind == PREFIX:
            return {"kind": PREFIX, "prefix": self.prefix}
        if self.kind == QUORA:
            return {"kind": QUORA, "normalize": self.normalize}
        return {"kind": self.kind}

    @classmethod
    def from_record(cls, record: dict) -> InputShaping:
        kind = record.get("kind", NONE)
        if kind not in SHAPING_KINDS:
            raise ValueError(f"input shaping {kind!r} is not one of {SHAPING_KINDS}")
        return cls(kind, str(record.get("prefix", "")), bool(record.get("normalize", True)))


@dataclasses.dataclass(frozen=True)
class RunRecord:
    """The run's decisions. `task` is MIXTURE_OR_TASK_NAME; `tasks` the tasks it trained on (a
    mixture's, else the task itself); the lengths are TASK_FEATURE_LENGTHS'."""

    task: str | None
    tasks: tuple[str, ...]
    input_length: int
    target_length: int
    shaping: InputShaping = InputShaping()
    # How its eval and infer decode unless told otherwise (NUM_BEAMS, TEMPERATURE, TOP_K,
    # infer.beam_alpha, infer.random_seed).
    decoding: DecodingSettings = DecodingSettings()

    def __post_init__(self):
        for name in ("input_length", "target_length"):
            validators.whole(low=1).check(name, getattr(self, name))

    def record(self) -> dict:
        return {
            "task": self.task,
            "tasks": list(self.tasks),
            "lengths": {"inputs": self.input_length, "targets": self.target_length},
            "shaping": self.shaping.record(),
            "decoding": dataclasses.asdict(self.decoding),
        }

    def metadata(self) -> dict:
        return {RUN: self.record()}

    @classmethod
    def from_record(cls, record: dict, where: str) -> RunRecord:
        """The record as record() wrote it; `where` names its file in the one-line error for
        one that is not."""
        try:
            lengths = record["lengths"]
            return cls(
                task=record.get("task"),
                tasks=tuple(str(name) for name in record.get("tasks", ())),
                input_length=lengths["inputs"],
                target_length=lengths["targets"],
                shaping=InputShaping.from_record(record.get("shaping", {})),
                decoding=DecodingSettings(**record.get("decoding", {})),
            )
        except (KeyError, TypeError, ValueError, AttributeError, UserError) as e:
            raise UserError(
                f"{where}: the run record is not the one t5tpu writes ({type(e).__name__}: "
                f"{str(e)[:200]}); restore it, or pass the lengths and settings explicitly"
            ) from None

    @classmethod
    def from_metadata(cls, metadata: dict | None, where: str) -> RunRecord | None:
        record = (metadata or {}).get(RUN)
        return None if record is None else cls.from_record(record, where)


def record_of(mngr, step: int) -> RunRecord | None:
    """The run record of checkpoint `step`; None for one saved before runs recorded theirs,
    or by `t5tpu convert`."""
    where = paths.checkpoint_dir(str(mngr.directory), step)
    return RunRecord.from_metadata(checkpoints.custom_metadata(mngr, step), where)
