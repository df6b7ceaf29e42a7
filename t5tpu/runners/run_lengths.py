"""The lengths a command decodes with: the ones it is told (TASK_FEATURE_LENGTHS in its gin
files, a server's flags), else the ones the run trained with (its run record,
storage/run_record.py), else t5tpu.load's defaults. Told lengths that differ from the run's are
used, with one line saying so: answers then differ from the ones the run's own lengths give."""

from __future__ import annotations

from collections.abc import Callable

from t5tpu.data import pipeline
from t5tpu.errors import UserError
from t5tpu.storage.run_record import RunRecord

# The lengths of a model whose checkpoint records none (t5tpu.load's and t5tpu serve's).
DEFAULT_LENGTHS = (512, 128)


def chosen(
    told: dict | None,
    record: RunRecord | None,
    *,
    setting: str,
    say: Callable[[str], None],
    default: tuple[int, int] | None = DEFAULT_LENGTHS,
) -> tuple[int, int]:
    """(input length, target length): `told` ({'inputs': n, 'targets': m}, named `setting` in
    messages) if given, else the record's, else `default` (None: one is needed)."""
    recorded = (record.input_length, record.target_length) if record else None
    if told is not None:
        lengths = pipeline.model_lengths(told)
        if recorded and lengths != recorded:
            say(
                f"note: decoding with {setting} {_shown(lengths)}, not the {_shown(recorded)} "
                "the run trained with (its run record)"
            )
        return lengths
    if recorded:
        return recorded
    if default is None:
        raise UserError(
            f"{setting} is not set and the checkpoint records no lengths (it was saved before "
            "runs recorded theirs); set it, e.g. {'inputs': 512, 'targets': 128}"
        )
    return default


def _shown(lengths: tuple[int, int]) -> str:
    return f"{{'inputs': {lengths[0]}, 'targets': {lengths[1]}}}"
