"""The user's own text-to-text examples: TSV files (`input<TAB>target` a line, an optional
header line naming the two fields) or JSONL files (an object a line with the two fields), read
whole and checked before any work, so a bad row is reported with its file and line instead of
failing inside tf.data or vanishing from the data.

The format follows the file name: .tsv/.txt is TSV, .jsonl/.json is JSONL. Paths may be local or
gs:// and may hold wildcards.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator, Sequence

from etils import epath

from t5tpu.errors import UserError
from t5tpu.storage import locations, user_files

TSV_SUFFIXES = (".tsv", ".txt")
JSONL_SUFFIXES = (".jsonl", ".json")


@dataclasses.dataclass(frozen=True)
class Rows:
    """The well-formed examples of some files, and how many rows were not."""

    inputs: list[str]
    targets: list[str]
    malformed: int = 0
    first_problem: str | None = None  # e.g. "line 7 of train.tsv: 3 columns, expected 2"


def matching_files(patterns: str | Sequence[str], setting: str) -> list[str]:
    """Every file the patterns name (a string may list several, comma-separated), in order."""
    if isinstance(patterns, str):
        patterns = [p.strip() for p in patterns.split(",") if p.strip()]
    files = []
    for pattern in patterns:
        found = _glob(pattern)
        if not found:
            raise UserError(
                f"{setting}: no file matches {_shown(pattern)}; give existing TSV/JSONL files"
            )
        files.extend(found)
    return files


def _shown(pattern: str) -> str:
    """The pattern, and for a relative one where it was looked for: the bundled experiments name
    repository files (examples/...) that exist only from the checkout's root."""
    if locations.is_absolute(pattern):
        return pattern
    return f"{pattern} (relative to the current directory, {os.getcwd()})"


def _glob(pattern: str) -> list[str]:
    """Files matching a pattern whose wildcards are in the file name, through epath (so gs://
    goes through the client that reads MODEL_DIR, which a local emulator can stand in for)."""
    path = epath.Path(pattern)
    if any(c in path.name for c in "*?["):
        return sorted(str(found) for found in path.parent.glob(path.name))
    return [pattern] if path.is_file() else []


def read_rows(
    paths: Sequence[str], input_field: str = "input", target_field: str = "target"
) -> Rows:
    """The examples of `paths` as Rows, the malformed ones counted (and the first one named)."""
    inputs, targets, malformed, first = [], [], 0, None
    for path in paths:
        for where, parsed in _parsed_lines(path, input_field, target_field):
            if isinstance(parsed, str):
                malformed += 1
                first = first or f"{where}: {parsed}"
            else:
                inputs.append(parsed[0])
                targets.append(parsed[1])
    return Rows(inputs, targets, malformed, first)


def _parsed_lines(path: str, input_field: str, target_field: str) -> Iterator[tuple[str, object]]:
    """(where, (input, target) or what is wrong) for each non-empty line of one file."""
    name = path.lower()
    if name.endswith(TSV_SUFFIXES):
        header = f"{input_field}\t{target_field}"
        for number, line in _lines(path):
            if not (number == 1 and line == header):
                yield f"line {number} of {path}", _tsv_row(line)
    elif name.endswith(JSONL_SUFFIXES):
        for number, line in _lines(path):
            yield f"line {number} of {path}", _json_row(line, input_field, target_field)
    else:
        raise UserError(
            f"{path}: unknown format; name TSV files .tsv or .txt and JSONL files .jsonl or .json"
        )


def _lines(path: str) -> Iterator[tuple[int, str]]:
    """(line number, text) of the non-empty lines; a file that is not UTF-8 text (or holds a
    NUL, as UTF-16 text does) is refused naming the line."""
    data = user_files.read_bytes(path, what="text-to-text file")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _not_text(path, data[: e.start].count(b"\n") + 1) from None
    if "\0" in text:
        raise _not_text(path, text[: text.index("\0")].count("\n") + 1)
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            yield number, line.rstrip("\r")


def _not_text(path: str, line: int) -> UserError:
    return UserError(f"{path} is not a UTF-8 text file (line {line}); give TSV or JSONL text")


def _tsv_row(line: str) -> tuple[str, str] | str:
    columns = line.split("\t")
    if len(columns) != 2:
        return f"{len(columns)} columns, expected input<TAB>target"
    return _checked(columns[0], columns[1])


def _json_row(line: str, input_field: str, target_field: str) -> tuple[str, str] | str:
    try:
        row = json.loads(line)
    except ValueError as e:
        return f"not JSON ({getattr(e, 'msg', e)})"
    except RecursionError:  # brackets nested thousands deep
        return "not JSON (nested too deeply)"
    if not isinstance(row, dict):
        return "not a JSON object"
    missing = [field for field in (input_field, target_field) if field not in row]
    if missing:
        return f"no field {missing[0]!r}"
    if not all(isinstance(row[field], str) for field in (input_field, target_field)):
        return f"{input_field!r} and {target_field!r} must be strings"
    return _checked(row[input_field], row[target_field])


def _checked(input_text: str, target: str) -> tuple[str, str] | str:
    # An empty side trains the model to write or read nothing: almost always a broken row.
    if not input_text.strip():
        return "empty input"
    if not target.strip():
        return "empty target"
    return input_text, target
