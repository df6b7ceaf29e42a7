"""Whether a checkpoint_N in MODEL_DIR can be read, checked before orbax reads it.

Two kinds of damage, both found without reading the arrays themselves:
- incomplete: a file restore needs is missing (a partial copy), seen from the file names alone;
- unreadable: every file is there but one cannot be read back — item metadata that is not JSON,
  array data cut short or lost. orbax finds these only part-way through a restore, with a
  TensorStore traceback from a worker thread; here the OCDBT database of each item is opened,
  its keys listed and the last byte of every value read, which costs one small read per array
  chunk (not the arrays), so a truncated or missing data file is found without reading the data.

'latest' (train resume, eval, infer) then falls back to the newest readable checkpoint with one
warning line per damaged one; a step named explicitly is refused with a UserError naming it.
Damaged checkpoints are never deleted: training moves one aside when it saves that step again.
"""

from __future__ import annotations

import json
import sys

import tensorstore as ts
from etils import epath

from t5tpu.errors import UserError
from t5tpu.storage import model_dir as paths

# orbax's names inside a checkpoint and its items.
CHECKPOINT_METADATA = "_CHECKPOINT_METADATA"
ITEM_METADATA = "_METADATA"
OCDBT_MANIFEST = "manifest.ocdbt"
# Causes are quoted in one-line warnings and errors: TensorStore's messages run to paragraphs.
_MAX_CAUSE = 160


def incomplete_reason(step_dir: epath.Path, items) -> str | None:
    """What file of `items` the checkpoint lacks, or None when none is missing."""
    if not (step_dir / CHECKPOINT_METADATA).exists():
        return f"no {CHECKPOINT_METADATA}"
    for item in items:
        if not (step_dir / item / ITEM_METADATA).exists():
            if item == "opt_state" and not (step_dir / item).exists():
                return (
                    "parameters only, as `t5tpu convert` writes; to fine-tune from it, give it "
                    "as INITIAL_CHECKPOINT_PATH"
                )
            return f"no {item}/{ITEM_METADATA}"
    return None


def short(error: BaseException) -> str:
    """The first line of an error's message, cut to fit a one-line warning."""
    lines = str(error).strip().splitlines()
    text = lines[0] if lines else type(error).__name__
    return text if len(text) <= _MAX_CAUSE else text[: _MAX_CAUSE - 3] + "..."


def _metadata_reason(item_dir: epath.Path, item: str) -> str | None:
    """orbax reads the item's tree from _METADATA first; an empty or cut file stops it there."""
    try:
        text = (item_dir / ITEM_METADATA).read_text()
        if not text.strip():
            return f"{item}/{ITEM_METADATA} is empty"
        json.loads(text)
    except (OSError, ValueError) as e:
        return f"{item}/{ITEM_METADATA}: {short(e)}"
    return None


def _kvstore_url(item_dir: epath.Path) -> str:
    text = str(item_dir).rstrip("/") + "/"
    return text if "://" in text else f"file://{text}"


def _data_reason(item_dir: epath.Path, item: str) -> str | None:
    """Opens the item's OCDBT database and reads the last byte of every value: a data file that
    is missing or shorter than the values it holds fails that read."""
    if not (item_dir / OCDBT_MANIFEST).exists():
        return None  # not OCDBT (orbax's older per-array layout): left to the restore
    try:
        store = ts.KvStore.open({"driver": "ocdbt", "base": _kvstore_url(item_dir)}).result()
        keys = store.list().result()
        reads = [store.read(key, byte_range=slice(-1, None)) for key in keys]
    except ValueError as e:
        return f"{item}: {short(e)}"
    failed, first = 0, None
    for read in reads:
        try:
            found = read.result().state == "value"
        except ValueError as e:
            found, first = False, first or e
        failed += not found
    if not failed:
        return None
    cause = f": {short(first)}" if first else ""
    return f"{item}: data of {failed} of {len(keys)} array chunks missing or cut short{cause}"


def unreadable_reason(step_dir: epath.Path, items) -> str | None:
    """Why orbax could not read `items` of the checkpoint at `step_dir`, or None if it can."""
    reason = incomplete_reason(step_dir, items)
    for item in items:
        if reason:
            break
        reason = _metadata_reason(step_dir / item, item) or _data_reason(step_dir / item, item)
    return reason


def check_readable(step_dir: str, items=("params",)) -> None:
    """Refuses a checkpoint named explicitly (a step, a path) that cannot be read."""
    reason = unreadable_reason(epath.Path(step_dir), items)
    if reason:
        raise UserError(f"checkpoint {step_dir} cannot be read ({reason}); give another checkpoint")


def newest_readable(model_dir: str, steps: list[int], items) -> tuple[int | None, list[int]]:
    """Of `steps` (complete checkpoints, oldest first): the newest whose `items` can be read,
    and the newer ones that cannot, each reported in one warning line naming the one used."""
    damaged = {}
    chosen = None
    for step in reversed(steps):
        reason = unreadable_reason(epath.Path(paths.checkpoint_dir(model_dir, step)), items)
        if reason is None:
            chosen = step
            break
        damaged[step] = reason
    using = f"using {paths.checkpoint_name(chosen)}" if chosen is not None else "none left"
    for step, reason in damaged.items():
        print(
            f"t5tpu: warning: {paths.checkpoint_name(step)} cannot be read ({reason}); {using}",
            file=sys.stderr,
            flush=True,
        )
    return chosen, list(damaged)


def readable_steps(model_dir: str, steps: list[int], items) -> list[int]:
    """`steps` but those that cannot be read, each skipped with one warning line."""
    kept = []
    for step in steps:
        reason = unreadable_reason(epath.Path(paths.checkpoint_dir(model_dir, step)), items)
        if reason is None:
            kept.append(step)
        else:
            name = paths.checkpoint_name(step)
            print(f"t5tpu: warning: {name} cannot be read ({reason}); skipped", file=sys.stderr)
    return kept


def move_aside(step_dir: epath.Path) -> str:
    """Renames a damaged checkpoint_N to checkpoint_N.incomplete (or .incomplete.2, ... when
    an earlier one is there): orbax never lists it, so its step can be saved anew, and its files
    stay for a look. Returns the new name."""
    step = paths.step_of(str(step_dir))
    base = paths.incomplete_checkpoint_name(step)
    name, n = base, 1
    while step_dir.with_name(name).exists():
        n += 1
        name = f"{base}.{n}"
    step_dir.rename(step_dir.with_name(name))
    return name
