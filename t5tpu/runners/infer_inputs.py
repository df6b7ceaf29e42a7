"""What `t5tpu infer` decodes, read lazily: INFER_INPUTS, the lines of INFER_INPUT_FILE (a file,
a glob pattern or a comma list of them, local or gs://), or a task's split.

A source is read again for every pass over it (a scan before any work, then the decoding pass),
never held whole in memory, so a file of millions of lines costs what one chunk of it costs. The
scan checks every line (UTF-8, no NULs) and fingerprints the inputs before anything is compiled
or written: a binary file is refused before minutes of work, and a chunk written for other
inputs is never mixed into these inputs' predictions (runners/infer_chunks.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import itertools
import os
from collections.abc import Callable, Iterator

from etils import epath

from t5tpu.data import availability
from t5tpu.errors import UserError
from t5tpu.runtime.lazy_imports import seqio
from t5tpu.storage import remote, user_files
from t5tpu.tasks import registry

# A model input is at most thousands of tokens: a line far longer is not one (a file without
# newlines, a binary file), and reading it would hold all of it in memory.
MAX_LINE_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class Record:
    """One input as read: its text, where it came from ('line 7 of FILE', 'INFER_INPUTS[2]'),
    and, for a task's split, its tokens (already cut by the task) and target."""

    text: str
    where: str
    ids: tuple[int, ...] | None = None
    target: str | None = None


@dataclasses.dataclass(frozen=True)
class InputSource:
    """A re-readable stream of records: `name` names the predictions file, `fingerprint` says
    what the inputs are, `total` how many (None until a task's split has been read)."""

    name: str
    fingerprint: str
    total: int | None
    read: Callable[[], Iterator[Record]]


class Texts:
    """A source's input texts, read afresh at every iteration (prediction_files compares them
    with an existing file's inputs, line by line)."""

    def __init__(self, source: InputSource):
        self.source = source

    def __iter__(self) -> Iterator[str]:
        return (record.text for record in self.source.read())


def _expand(spec: str) -> list[str]:
    """The files INFER_INPUT_FILE names: comma-separated paths, each a file or a glob pattern."""
    files = []
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            continue
        remote.check_storage(part, "INFER_INPUT_FILE")
        if any(c in part for c in "*?["):
            parent, pattern = os.path.split(part)
            matches = sorted(str(p) for p in epath.Path(parent or ".").glob(pattern))
            if not matches:
                raise UserError(f"INFER_INPUT_FILE pattern {part} matches no file")
            files.extend(matches)
        elif not epath.Path(part).is_file():
            raise UserError(f"input file not found: {part}; set INFER_INPUT_FILE to a text file")
        else:
            files.append(part)
    if not files:
        raise UserError(f"INFER_INPUT_FILE = {spec!r} names no file")
    return files


def _not_text(path: str, line: int) -> UserError:
    return UserError(
        f"INFER_INPUT_FILE {path} is not a UTF-8 text file (line {line}); give a text file "
        "with one model input per line"
    )


def read_lines(path: str) -> Iterator[tuple[str, str]]:
    """(text, 'line N of FILE') of each non-empty line, with universal newlines (\\r\\n and \\r
    end a line too, as a file opened as text reads). Read as bytes and decoded line by line, so
    a line that is not UTF-8 or holds a NUL (UTF-16 text, a binary file) is refused in one line
    naming it, as is a line longer than MAX_LINE_BYTES."""
    number = 0
    with user_files.open_binary(path, what="INFER_INPUT_FILE") as f:
        for raw in raw_lines(f, max_bytes=MAX_LINE_BYTES):
            if raw is None:
                raise UserError(
                    f"INFER_INPUT_FILE {path}: line {number + 1} is longer than "
                    f"{MAX_LINE_BYTES:,} bytes; give a text file with one model input per line"
                )
            try:
                decoded = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise _not_text(path, number + 1) from None
            for line in io.StringIO(decoded, newline=None):
                number += 1
                if "\0" in line:
                    raise _not_text(path, number)
                if line.strip():
                    yield line.rstrip("\n"), f"line {number} of {path}"


def raw_lines(f, *, max_bytes: int, chunk_size: int = 1 << 20) -> Iterator[bytes | None]:
    """The lines of a binary file, split on b"\\n" and read a chunk at a time; None (then
    stop) for a line longer than `max_bytes`, which is never held whole."""
    pending = b""
    while chunk := f.read(chunk_size):
        lines = (pending + chunk).split(b"\n")
        pending = lines.pop()
        for line in lines:
            yield line + b"\n" if len(line) <= max_bytes else None
        if len(pending) > max_bytes:
            yield None
    if pending:
        yield pending


def _scan(read: Callable[[], Iterator[Record]], what: str) -> tuple[str, int]:
    """(fingerprint, count) of a source, read through once: every line checked now."""
    digest = hashlib.sha256(what.encode())
    count = 0
    for record in read():
        digest.update(record.text.encode() + b"\n")
        count += 1
    return digest.hexdigest(), count


def from_files(spec: str, num_examples: int | None) -> InputSource:
    files = _expand(spec)

    def read() -> Iterator[Record]:
        lines = itertools.chain.from_iterable(read_lines(f) for f in files)
        for text, where in itertools.islice(lines, num_examples):
            yield Record(text, where)

    fingerprint, total = _scan(read, "files")
    if not total:
        raise UserError(f"input file {spec} has no non-empty lines; put one input per line")
    name = os.path.splitext(os.path.basename(files[0]))[0]
    if len(files) > 1:
        name += f"-and-{len(files) - 1}-more"
    return InputSource(name, fingerprint, total, read)


def from_texts(inputs: list[str] | str, num_examples: int | None) -> InputSource:
    texts = ([inputs] if isinstance(inputs, str) else list(inputs))[:num_examples]
    records = [Record(text, f"INFER_INPUTS[{i}]") for i, text in enumerate(texts)]
    fingerprint, total = _scan(lambda: iter(records), "inputs")
    return InputSource("inputs", fingerprint, total, lambda: iter(records))


def _task_records(task, split: str, feature_lengths, num_examples: int | None):
    def read() -> Iterator[Record]:
        ds = task.get_dataset(dict(feature_lengths), split=split, shuffle=False, num_epochs=1)
        if num_examples is not None:
            ds = ds.take(num_examples)
        for number, ex in enumerate(ds.as_numpy_iterator(), start=1):
            yield Record(
                ex["inputs_pretokenized"].decode(),
                f"example {number} of {task.name}:{split}",
                tuple(ex["inputs"].tolist()),
                ex["targets_pretokenized"].decode(),
            )

    return read


def from_task(
    task_name: str, task_module: str | None, split: str, feature_lengths, num_examples
) -> InputSource:
    """The first `num_examples` (None: all) of a task's split, in the source's order. Its size
    is known only once read: the fingerprint names the task, split and count instead."""
    task = registry.get_task(task_name, task_module)
    if isinstance(task, seqio.Mixture):
        names = ", ".join(t.name for t in task.tasks)
        raise UserError(
            f"{task_name} is a mixture; infer reads one task's examples: set "
            f"MIXTURE_OR_TASK_NAME to one of {names}"
        )
    # A source is handed any split name and fails deep inside tf.data (the bundled Quora sample
    # looks for <split>.tsv), so the split is checked against the ones the task declares.
    if split not in task.splits:
        raise UserError(
            f"nothing to infer: task {task_name!r} has no {split!r} split; set INFER_SPLIT to a "
            f"split the task has: {', '.join(task.splits)}"
        )
    availability.check_readable(task_name, split, "INFER_SPLIT")
    what = f"task {task_name} split {split} first {num_examples} lengths {dict(feature_lengths)}"
    fingerprint = hashlib.sha256(what.encode()).hexdigest()
    read = _task_records(task, split, feature_lengths, num_examples)
    return InputSource(f"{task_name}_{split}", fingerprint, None, read)


def given(
    *, inputs: list[str] | str | None, input_file: str | None, num_examples: int | None
) -> InputSource | None:
    """INFER_INPUTS if given, else INFER_INPUT_FILE, else None (a task's split is decoded, at
    the run's lengths). Infer reads them before the checkpoints: a bad file is refused first."""
    if inputs:
        return from_texts(inputs, num_examples)
    if input_file:
        return from_files(input_file, num_examples)
    return None


def from_task_named(
    task_name: str | None, *, task_module: str | None, split: str, feature_lengths, num_examples
) -> InputSource:
    """The task's split, when no texts are given."""
    if task_name:
        return from_task(task_name, task_module, split, feature_lengths, num_examples)
    raise UserError("nothing to infer: set INFER_INPUTS, INFER_INPUT_FILE or MIXTURE_OR_TASK_NAME")
