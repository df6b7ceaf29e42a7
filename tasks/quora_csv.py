"""Reading Quora question pairs, splitting them into train and validation, and turning a full
release into the TFRecord splits the Quora tasks read (`t5tpu prepare-quora`, whose flags are
t5tpu.cli.prepare_quora's).

The Quora release is a tab-separated file whose fields are csv-quoted where needed; one question
even holds a quoted newline, so records must be read with a quote-aware reader, never by lines.

TensorFlow (for gs:// paths and TFRecords) is imported by the functions that read or write: the
command line imports this module to answer `t5tpu prepare-quora --help` at once.
"""

import csv
import dataclasses
import hashlib
import json
import os
import re
from collections.abc import Iterable, Iterator

from etils import epath

from t5tpu.errors import UserError
from t5tpu.storage import atomic_files, remote, user_files

FIELDS = ("id", "qid1", "qid2", "question1", "question2", "is_duplicate")
SPLITS = ("train", "validation")

# One pair in ten goes to validation.
_VALIDATION_BUCKETS = 10


def is_validation_pair(pair_id: int) -> bool:
    """Whether the pair with this id belongs to the validation split.

    The rule hashes the id (md5, not Python's salted hash) so that every run, machine and
    version of the file puts a given pair in the same split.
    """
    digest = hashlib.md5(str(pair_id).encode("ascii")).hexdigest()
    return int(digest, 16) % _VALIDATION_BUCKETS == 0


def split_of_pair(pair_id: int) -> str:
    return "validation" if is_validation_pair(pair_id) else "train"


def read_pairs(path: str) -> Iterator[dict[str, str]]:
    """Yields each record of a Quora TSV file as a dict of its six fields, as strings.

    Values stay the file's exact text so that writing them back with `write_pairs` reproduces
    the original bytes; convert "id" and "is_duplicate" with int() where numbers are needed.
    `path` may be local or gs://.
    """
    import tensorflow as tf

    with tf.io.gfile.GFile(path, "r") as file:
        reader = csv.DictReader(file, delimiter="\t")
        if tuple(reader.fieldnames or ()) != FIELDS:
            raise ValueError(f"{path}: expected header {FIELDS}, found {reader.fieldnames}")
        yield from reader


def write_pairs(path: str, pairs: Iterable[dict[str, str]]) -> int:
    """Writes pairs as a Quora TSV file (header, tabs, minimal csv quoting), atomically
    (storage.atomic_files); returns the count."""
    count = 0
    with atomic_files.atomic_file(path, setting="the path given") as file:
        # lineterminator "\n" and minimal quoting are what the original file uses.
        writer = csv.DictWriter(file, fieldnames=FIELDS, delimiter="\t", lineterminator="\n")
        writer.writeheader()
        for pair in pairs:
            writer.writerow(pair)
            count += 1
    return count


# --- Kaggle train.csv or a QQP TSV -> TFRecord splits -----------------------------------------

OUTPUT_FILES = {"train": "train.tfrecord", "validation": "validation.tfrecord"}
STATS_FILE = "stats.json"
_INTEGER_FIELDS = ("id", "qid1", "qid2")
_QUESTION_FIELDS = ("question1", "question2")
_LABELS = ("0", "1")
_MAX_DIGITS = 18
MAX_LINE_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class Rejection:
    """A record that could not be used: the physical lines it spans (1-based) and why."""

    line: int
    last_line: int
    reason: str

    def describe(self) -> str:
        lines = f"line {self.line}"
        if self.last_line != self.line:
            lines = f"lines {self.line}-{self.last_line}"
        return f"{lines}: {self.reason}"


@dataclasses.dataclass
class PrepareStats:
    """What `prepare` read and wrote; saved as stats.json beside the splits."""

    input: str
    format: str
    pairs: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(SPLITS, 0))
    duplicates: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(SPLITS, 0))
    blank_lines: list[int] = dataclasses.field(default_factory=list)
    rejected: list[Rejection] = dataclasses.field(default_factory=list)

    @property
    def duplicate_fraction(self) -> float:
        total = sum(self.pairs.values())
        return sum(self.duplicates.values()) / total if total else 0.0

    def to_json(self) -> str:
        record = {
            "input": self.input,
            "format": self.format,
            "pairs": self.pairs,
            "duplicates": self.duplicates,
            "duplicate_fraction": round(self.duplicate_fraction, 6),
            "files": OUTPUT_FILES,
            "blank_lines": self.blank_lines,
            "num_rejected": len(self.rejected),
            "rejected": [dataclasses.asdict(r) for r in self.rejected],
        }
        return json.dumps(record, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


class _DecodedLines:
    """The physical lines of a UTF-8 file, split on "\\n" only (a lone "\\r" inside a quoted
    question is text, not a line break, so line numbers match what `sed -n Np` shows).

    A line that is not valid UTF-8 is decoded with replacement characters and its number kept in
    `undecodable`, so the record holding it can be rejected instead of written garbled.
    """

    def __init__(self, file, chunk_size: int = 1 << 20, name: str = "the input"):
        self._file = file
        self._chunk_size = chunk_size
        self._name = name
        self.undecodable: set[int] = set()

    def __iter__(self) -> Iterator[str]:
        for number, raw in enumerate(self._raw_lines(), start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = raw.decode("utf-8", errors="replace")
                self.undecodable.add(number)
            if number == 1:
                text = text.removeprefix("\ufeff")  # a byte-order mark some editors add
            yield text

    def _raw_lines(self) -> Iterator[bytes]:
        pending = b""
        number = 0
        while chunk := self._file.read(self._chunk_size):
            lines = (pending + chunk).split(b"\n")
            pending = lines.pop()
            for line in lines:
                number += 1
                self._check_length(line, number)
                yield line + b"\n"
            self._check_length(pending, number + 1)
        if pending:
            yield pending

    def _check_length(self, line: bytes, number: int) -> None:
        # No record's six fields fill a line this long (csv caps a field at 128 KiB): the file
        # is not a pairs file, and its line is not held whole.
        if len(line) > MAX_LINE_BYTES:
            raise UserError(
                f"--input={self._name}: line {number} is longer than {MAX_LINE_BYTES:,} bytes; "
                "pass Kaggle's train.csv or a QQP TSV"
            )


def _detect_delimiter(path: str, header_line: str) -> tuple[str, str]:
    """(delimiter, format name) from the header: Kaggle's train.csv or a tab-separated file."""
    for delimiter, name in (("\t", "tsv"), (",", "csv")):
        try:
            fields = next(csv.reader([header_line], delimiter=delimiter), [])
        except csv.Error:  # a stray "\r" or quote: not the header either
            fields = []
        if tuple(field.strip() for field in fields) == FIELDS:
            return delimiter, name
    raise UserError(
        f"{path}: first line is {header_line.strip()[:120]!r}; expected the header "
        f"{','.join(FIELDS)} (Kaggle train.csv) or the same names tab-separated (QQP TSV)"
    )


def _records(
    lines: Iterator[str], delimiter: str, quoting: str, lines_before: int
) -> Iterator[tuple[int, int, list | str]]:
    """(first line, last line, fields) per record, numbering lines after the `lines_before`
    already consumed (the header); fields is an error message if the record is unreadable."""
    mode = csv.QUOTE_NONE if quoting == "none" else csv.QUOTE_MINIMAL
    # strict: a quote that closes mid-field ('"Quoted" words') is an error, where csv would
    # otherwise drop both quotes and keep the record, silently changing the question.
    reader = csv.reader(lines, delimiter=delimiter, quoting=mode, strict=quoting == "csv")
    while True:
        first = lines_before + reader.line_num + 1
        try:
            fields = next(reader)
        except StopIteration:
            return
        except csv.Error as e:  # a quote closed mid-field, or one running past the size limit
            why = str(e).replace("\t", "\\t")  # "'\t' expected after '"'", with a real tab
            fields = f"unreadable record ({why}; if quotes are text in this file: --quoting=none)"
        yield first, lines_before + reader.line_num, fields


def _pair_or_reason(fields: list[str]) -> dict | str:
    """The pair with typed values, or why the record cannot be used."""
    if len(fields) != len(FIELDS):
        return f"expected {len(FIELDS)} fields, found {len(fields)}"
    values = dict(zip(FIELDS, fields, strict=True))
    for name in _INTEGER_FIELDS:
        if not re.fullmatch(r"[0-9]+", values[name].strip()):
            return f"{name} {_excerpt(values[name])} is not a non-negative integer"
        if len(values[name].strip()) > _MAX_DIGITS:  # beyond a TFRecord's int64
            return f"{name} {_excerpt(values[name])} has more than {_MAX_DIGITS} digits"
    label = values["is_duplicate"].strip()
    if label not in _LABELS:
        return f"is_duplicate {_excerpt(values['is_duplicate'])} is not 0 or 1"
    for name in _QUESTION_FIELDS:
        if not values[name].strip():
            return f"{name} is empty"
    pair = {name: int(values[name]) for name in _INTEGER_FIELDS}
    pair.update({name: values[name] for name in _QUESTION_FIELDS})
    pair["is_duplicate"] = int(label)
    return pair


def _excerpt(value: str, limit: int = 40) -> str:
    return repr(value if len(value) <= limit else value[:limit] + "...")


def _serialize(pair: dict) -> bytes:
    """A pair as a tf.train.Example; deterministic so that re-running gives identical bytes."""
    import tensorflow as tf

    def ints(value):
        return tf.train.Feature(int64_list=tf.train.Int64List(value=[value]))

    def text(value):
        return tf.train.Feature(bytes_list=tf.train.BytesList(value=[value.encode("utf-8")]))

    feature = {name: ints(pair[name]) for name in (*_INTEGER_FIELDS, "is_duplicate")}
    feature.update({name: text(pair[name]) for name in _QUESTION_FIELDS})
    example = tf.train.Example(features=tf.train.Features(feature=feature))
    # Feature is a protobuf map, whose order is unspecified unless serialization is deterministic.
    return example.SerializeToString(deterministic=True)


def tfrecord_feature_description() -> dict:
    """How to parse the examples that `prepare` writes (for seqio.TFExampleDataSource)."""
    import tensorflow as tf

    description = {name: tf.io.FixedLenFeature([], tf.int64) for name in _INTEGER_FIELDS}
    description["is_duplicate"] = tf.io.FixedLenFeature([], tf.int64)
    description.update({name: tf.io.FixedLenFeature([], tf.string) for name in _QUESTION_FIELDS})
    return description


class _StagedOutput:
    """Writes the output files under temporary names and renames them into place only when
    everything succeeded, stats.json last; on failure the temporary files are removed. A write
    that fails (TensorFlow's errors) is storage.atomic_files' error naming the file."""

    def __init__(self, output_dir: str):
        self.output_dir = output_dir
        self._staged: dict[str, str] = {}  # final path -> temporary path

    def path(self, name: str) -> str:
        final = os.path.join(self.output_dir, name)
        self._staged[final] = f"{final}.tmp"
        return self._staged[final]

    def make_folder(self) -> None:
        import tensorflow as tf

        with atomic_files.write_faults(self.output_dir, _OUTPUT_SETTING):
            tf.io.gfile.makedirs(self.output_dir)

    def record_writer(self, name: str) -> "_RecordWriter":
        return _RecordWriter(self.path(name), os.path.join(self.output_dir, name))

    def write_text(self, name: str, text: str) -> None:
        import tensorflow as tf

        faults = atomic_files.write_faults(os.path.join(self.output_dir, name), _OUTPUT_SETTING)
        with faults, tf.io.gfile.GFile(self.path(name), "w") as file:
            file.write(text)

    def commit(self) -> None:
        import tensorflow as tf

        for final in self._staged:  # a folder in the way: nothing replaced yet
            atomic_files.refuse_a_folder(final, _OUTPUT_SETTING)
        for final, tmp in self._staged.items():
            with atomic_files.write_faults(final, _OUTPUT_SETTING):
                tf.io.gfile.rename(tmp, final, overwrite=True)
        self._staged.clear()

    def discard(self) -> None:
        import tensorflow as tf

        for tmp in self._staged.values():
            if tf.io.gfile.exists(tmp):
                tf.io.gfile.remove(tmp)
        self._staged.clear()


_OUTPUT_SETTING = "--output_dir"


class _RecordWriter:
    """A TFRecordWriter of `tmp` whose failed writes name `final` (atomic_files.write_faults)."""

    def __init__(self, tmp: str, final: str):
        import tensorflow as tf

        self._final = final
        with atomic_files.write_faults(final, _OUTPUT_SETTING):
            self._writer = tf.io.TFRecordWriter(tmp)

    def write(self, record: bytes) -> None:
        with atomic_files.write_faults(self._final, _OUTPUT_SETTING):
            self._writer.write(record)

    def close(self) -> None:
        with atomic_files.write_faults(self._final, _OUTPUT_SETTING):
            self._writer.close()


def _check_paths(input_path: str, output_dir: str, overwrite: bool) -> None:
    import tensorflow as tf

    # Through the storage layer first: a gs:// object or bucket that is missing, or storage that
    # does not answer, is one line here instead of TensorFlow's retries.
    remote.check_storage(output_dir, "--output_dir")
    if not remote.is_file(input_path, "--input"):
        if remote.answered(
            lambda: epath.Path(input_path).is_dir(), path=input_path, setting="--input"
        ):
            raise UserError(f"--input={input_path} is a directory; pass the pairs file in it")
        raise UserError(f"input file not found: {input_path}; pass --input=PATH (local or gs://)")
    if tf.io.gfile.exists(output_dir) and not tf.io.gfile.isdir(output_dir):
        raise UserError(f"--output_dir={output_dir} is a file; pass a directory")
    existing = [
        name
        for name in (*OUTPUT_FILES.values(), STATS_FILE)
        if tf.io.gfile.exists(os.path.join(output_dir, name))
    ]
    if existing and not overwrite:
        raise UserError(
            f"{output_dir} already holds {', '.join(existing)}; pass --overwrite to replace "
            "them or choose another --output_dir"
        )


def prepare(
    input_path: str, output_dir: str, overwrite: bool = False, quoting: str = "csv"
) -> PrepareStats:
    """Converts a Quora pairs file into DIR/{train,validation}.tfrecord and DIR/stats.json.

    Pairs go to a split by `split_of_pair(id)`, in file order. Records that cannot be used are
    listed in the stats with the physical line they start on and the reason; nothing is dropped
    without a trace. Existing output is replaced only with `overwrite`, and only once the new
    output is complete.
    """
    import tensorflow as tf

    _check_paths(input_path, output_dir, overwrite)
    created_dir = not tf.io.gfile.exists(output_dir)
    staged = _StagedOutput(output_dir)
    try:
        stats = _convert(input_path, staged, quoting)
        staged.write_text(STATS_FILE, stats.to_json())
        staged.commit()
    except BaseException:
        staged.discard()
        # A failed run leaves no trace, not even the directory it made.
        if created_dir and tf.io.gfile.isdir(output_dir) and not tf.io.gfile.listdir(output_dir):
            tf.io.gfile.rmtree(output_dir)
        raise
    return stats


def _convert(input_path: str, staged: _StagedOutput, quoting: str) -> PrepareStats:
    with user_files.open_binary(input_path, what="--input") as file:
        lines = _DecodedLines(file, name=input_path)
        line_iter = iter(lines)
        header = next(line_iter, "")
        if 1 in lines.undecodable or "\0" in header:  # before any output: a binary file
            raise UserError(
                f"--input={input_path} is not a text file (its first line is not UTF-8 text); "
                "pass Kaggle's train.csv or a QQP TSV"
            )
        delimiter, file_format = _detect_delimiter(input_path, header)
        stats = PrepareStats(input=input_path, format=file_format)
        staged.make_folder()
        writers = {s: staged.record_writer(OUTPUT_FILES[s]) for s in SPLITS}
        try:
            records = _records(line_iter, delimiter, quoting, lines_before=1)
            _write_pairs(records, lines, writers, stats)
        finally:
            for writer in writers.values():
                writer.close()
    if not sum(stats.pairs.values()):
        hint = "; GLUE's QQP files need --quoting=none" if quoting == "csv" else ""
        raise UserError(
            f"{input_path}: no usable pairs ({len(stats.rejected)} rows rejected, e.g. "
            f"{stats.rejected[0].describe() if stats.rejected else 'the file has only a header'})"
            f"{hint}"
        )
    empty = [split for split in SPLITS if not stats.pairs[split]]
    if empty:  # training or evaluating on it would fail later, far from the cause
        raise UserError(
            f"{input_path}: {sum(stats.pairs.values())} usable pairs, none in the {empty[0]} "
            "split (about 10% of pairs go to validation); use a larger file"
        )
    return stats


def _write_pairs(records, lines: _DecodedLines, writers: dict, stats: PrepareStats) -> None:
    first_line_of_id: dict[int, int] = {}
    for first, last, fields in records:
        if fields == []:  # csv reads an empty line as a record with no fields
            stats.blank_lines.append(first)
            continue
        pair = _usable_pair(first, last, fields, lines.undecodable, first_line_of_id)
        if isinstance(pair, str):
            stats.rejected.append(Rejection(first, last, pair))
            continue
        first_line_of_id[pair["id"]] = first
        split = split_of_pair(pair["id"])
        writers[split].write(_serialize(pair))
        stats.pairs[split] += 1
        stats.duplicates[split] += pair["is_duplicate"]


def _usable_pair(
    first: int, last: int, fields: list | str, undecodable: set, first_line_of_id: dict
) -> dict | str:
    """The pair on lines first..last, or why it cannot be used (fields may already say why)."""
    if isinstance(fields, str):
        return fields
    if undecodable.intersection(range(first, last + 1)):
        return "not valid UTF-8"
    pair = _pair_or_reason(fields)
    if isinstance(pair, dict) and pair["id"] in first_line_of_id:
        return f"id {pair['id']} already used on line {first_line_of_id[pair['id']]}"
    return pair
