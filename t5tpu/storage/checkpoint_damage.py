"""Whether a checkpoint_N in MODEL_DIR can be read, checked before orbax reads it.

Two kinds of damage, both found without reading the arrays themselves:
- incomplete: a file restore needs is missing (a partial copy), seen from the file names alone;
- unreadable: every file is there but one cannot be read back — metadata that is not JSON or
  not of orbax's structure, a tree naming arrays the data lacks, array data cut short or lost.
  orbax finds these only part-way through a restore, with a traceback (from a worker thread,
  for TensorStore's); here the OCDBT database of each item is opened, its keys listed and the
  last byte of every value read, which costs one small read per array chunk (not the arrays),
  so a truncated or missing data file is found without reading the data; the metadata is then
  read by orbax's own readers, once what they read is known to be there.

'latest' (train resume, eval, infer) then falls back to the newest readable checkpoint with one
warning line per damaged one; a step named explicitly is refused with a UserError naming it.
Damaged checkpoints are never deleted: training moves one aside when it saves that step again.
"""

from __future__ import annotations

import json
import sys

import jax
import orbax.checkpoint as ocp
import tensorstore as ts
from etils import epath

from t5tpu import validators
from t5tpu.errors import UserError
from t5tpu.storage import locations
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


def _json_object(path: epath.Path, name: str) -> tuple[dict | None, str | None]:
    """(the JSON object in `path`, None), or (None, why it is not one); `name` names it."""
    try:
        text = path.read_text()
        if not text.strip():
            return None, f"{name} is empty"
        value = json.loads(text)
    except (OSError, ValueError) as e:  # UnicodeDecodeError is a ValueError
        return None, f"{name}: {short(e)}"
    if not isinstance(value, dict):
        return None, f"{name} holds a JSON {type(value).__name__}, not an object"
    return value, None


def _step_metadata_reason(step_dir: epath.Path) -> str | None:
    """orbax reads _CHECKPOINT_METADATA at every restore: it logs errors over a file that is
    not JSON and raises on one of another structure. Asked here through orbax's own reader."""
    _, reason = _json_object(step_dir / CHECKPOINT_METADATA, CHECKPOINT_METADATA)
    if reason:
        return reason
    try:
        metadata = ocp.metadata.get_step_metadata(step_dir)
    except Exception as e:  # orbax's validation raises ValueError, TypeError, KeyError, ...
        return f"{CHECKPOINT_METADATA}: {short(e)}"
    if not isinstance(metadata.item_handlers, (dict, type(None))):
        # t5tpu saves items by name: one handler name alone is another kind of checkpoint
        return f"{CHECKPOINT_METADATA}: item_handlers is not a map of items"
    return None


def _kvstore_url(item_dir: epath.Path) -> str:
    text = str(item_dir).rstrip("/") + "/"
    return text if locations.is_remote(text) else f"file://{text}"


def _data_reason(store: ts.KvStore, keys: list[bytes], item: str) -> str | None:
    """Reads the last byte of every value of the item's OCDBT database: a data file that is
    missing or shorter than the values it holds fails that read."""
    failed, first = 0, None
    for read in [store.read(key, byte_range=slice(-1, None)) for key in keys]:
        try:
            found = read.result().state == "value"
        except ValueError as e:
            found, first = False, first or e
        failed += not found
    if not failed:
        return None
    cause = f": {short(first)}" if first else ""
    return f"{item}: data of {failed} of {len(keys)} array chunks missing or cut short{cause}"


def _entry_array(entry) -> str | None | bool:
    """The name of the array an entry of _METADATA's tree_metadata stores ('a.b.c'), None for
    an entry saved without one (optax's empty states), False when the entry is malformed."""
    if not isinstance(entry, dict):
        return False
    keys, value = entry.get("key_metadata"), entry.get("value_metadata")
    if not isinstance(keys, list) or not keys or not isinstance(value, dict):
        return False
    if not all(isinstance(k, dict) and isinstance(k.get("key"), str) for k in keys):
        return False
    if not isinstance(value.get("value_type"), str) or not validators.is_instance(
        value.get("skip_deserialize", False), bool
    ):
        return False
    return None if value.get("skip_deserialize") else ".".join(k["key"] for k in keys)


def _tree_reason(document: dict, keys: list[bytes], name: str) -> str | None:
    """Whether _METADATA's tree names arrays the database holds: orbax would otherwise fail
    reading them in its worker threads, which print tracebacks on their way out."""
    tree, zarr3 = document.get("tree_metadata"), document.get("use_zarr3", False)
    if not isinstance(tree, dict) or not tree or not validators.is_instance(zarr3, bool):
        return f"{name} has no tree_metadata of arrays"
    stored = {key.decode("utf-8", "replace") for key in keys}
    suffix = "zarr.json" if zarr3 else ".zarray"
    for entry in tree.values():
        array = _entry_array(entry)
        if array is False:
            return f"{name}: an entry of tree_metadata is malformed"
        if array is not None and f"{array}/{suffix}" not in stored:
            return f"{name} names {array[:80]!r}, which the checkpoint's data lacks"
    return None


def _orbax_metadata_reason(item_dir: epath.Path, name: str) -> str | None:
    """What orbax's own reader of the item's tree finds wrong, asked last (its parser raises
    many types), once everything it reads is known to be there."""
    try:
        metadata = ocp.StandardCheckpointHandler().metadata(item_dir)
    except Exception as e:
        return f"{name}: {short(e)}"
    # Every value t5tpu saves is an array (scalars included); anything else here was damaged.
    leaves = jax.tree_util.tree_leaves(getattr(metadata, "tree", metadata))
    if not all(isinstance(leaf, ocp.metadata.ArrayMetadata) for leaf in leaves):
        return f"{name}: entries that are not arrays"
    return None


def _item_reason(item_dir: epath.Path, item: str) -> str | None:
    """Why orbax could not read the item at `item_dir`: its _METADATA (orbax reads the tree
    from it first; an empty, cut or rewritten file stops it there), its OCDBT database (opened,
    its keys listed and the last byte of every value read), and the two against each other."""
    name = f"{item}/{ITEM_METADATA}"
    document, reason = _json_object(item_dir / ITEM_METADATA, name)
    if reason:
        return reason
    if not (item_dir / OCDBT_MANIFEST).exists():
        return None  # not OCDBT (orbax's older per-array layout): left to the restore
    try:
        store = ts.KvStore.open({"driver": "ocdbt", "base": _kvstore_url(item_dir)}).result()
        keys = store.list().result()
    except ValueError as e:
        return f"{item}: {short(e)}"
    return (
        _data_reason(store, keys, item)
        or _tree_reason(document, keys, name)
        or _orbax_metadata_reason(item_dir, name)
    )


def unreadable_reason(step_dir: epath.Path, items) -> str | None:
    """Why orbax could not read `items` of the checkpoint at `step_dir`, or None if it can."""
    reason = incomplete_reason(step_dir, items) or _step_metadata_reason(step_dir)
    for item in items:
        if reason:
            break
        reason = _item_reason(step_dir / item, item)
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
