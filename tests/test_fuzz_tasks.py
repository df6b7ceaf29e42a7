"""Fuzzing of the task files t5tpu reads (tests/fuzzing.py): SQuAD JSON (tasks/squad.py), the
stats.json of a prepared Quora directory (tasks/quora.py) and its TFRecord splits, which
availability.check_readable reads whole before a run. Each damaged file is read, or refused in
one line; a file the check lets through is then read by the task's own tf.data pipeline without
an error, so nothing damaged reaches training.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile

import gin
import pytest
from fuzzing import FUZZ, assert_refused, damaged
from hypothesis import given

from t5tpu.errors import UserError

SQUAD = {
    "version": "1.1",
    "data": [
        {
            "title": "Paris",
            "paragraphs": [
                {
                    "context": "Paris is the capital of France.",
                    "qas": [
                        {
                            "id": "q1",
                            "question": "What is the capital of France?",
                            "answers": [{"text": "Paris", "answer_start": 0}],
                        },
                        {
                            "id": "q2",
                            "question": "Of which country?",
                            "answers": [
                                {"text": "France", "answer_start": 24},
                                {"text": "France.", "answer_start": 24},
                            ],
                        },
                    ],
                }
            ],
        }
    ],
}
SQUAD_BYTES = json.dumps(SQUAD).encode()
# Where the structure changes: each object, list and key.
SQUAD_BOUNDARIES = [i for i, byte in enumerate(SQUAD_BYTES) if byte in b'{}[]:,"']


@pytest.fixture(scope="module", autouse=True)
def warm(prepared):
    """TensorFlow, seqio and the task modules imported, and one valid file of each kind read,
    before any case: assert_refused bounds a read's time and memory, not an import's."""
    read_squad(_write(_scratch(), "dev.json", SQUAD_BYTES))
    register_quora(_copy(prepared))
    check_and_read_split("validation")


# Removed when the worker exits (hypothesis' cases are not pytest tests: no tmp_path).
_ROOT = tempfile.TemporaryDirectory(prefix="t5tpu_fuzz_tasks_")


def _scratch() -> str:
    return tempfile.mkdtemp(dir=_ROOT.name)


def _write(folder: str, name: str, data: bytes) -> str:
    path = os.path.join(folder, name)
    with open(path, "wb") as f:
        f.write(data)
    return path


# --- SQuAD JSON -------------------------------------------------------------------------------


def read_squad(path: str):
    """What the squad tasks do with a bound file: its rows, as the tf.data dataset they read."""
    from t5tpu.tasks import squad

    squad.read_squad_json.cache_clear()
    return squad._json_dataset(squad.read_squad_json(path, require_answers=True))


SQUAD_FOLDER = _scratch()


@FUZZ
@given(damaged(SQUAD_BYTES, SQUAD_BOUNDARIES))
def test_damaged_squad_json_is_read_or_refused_in_one_line(data):
    path = _write(SQUAD_FOLDER, "dev.json", data)
    assert_refused(lambda: read_squad(path))


def _with(change) -> dict:
    document = json.loads(SQUAD_BYTES)
    change(document)
    return document


def _qa(document) -> dict:
    return document["data"][0]["paragraphs"][0]["qas"][0]


WRONG_SQUAD = {
    "not_json": (b"{'data': []}", "is not valid JSON"),
    "a_list": (b"[]", "holds a JSON list"),
    "no_data": ({"rows": []}, "the file has no 'data'"),
    "data_not_a_list": ({"data": {}}, "'data' is an object, not a list"),
    "article_not_an_object": ({"data": ["Paris"]}, "article 0 is a string, not an object"),
    "no_paragraphs": (_with(lambda d: d["data"][0].pop("paragraphs")), "has no 'paragraphs'"),
    "title_a_number": (
        _with(lambda d: d["data"][0].update(title=7)),
        "'title' is an integer",
    ),
    "no_qas": (_with(lambda d: d["data"][0]["paragraphs"][0].pop("qas")), "has no 'qas'"),
    "context_null": (
        _with(lambda d: d["data"][0]["paragraphs"][0].update(context=None)),
        "'context' is null, not a string",
    ),
    "no_answers": (_with(lambda d: _qa(d).pop("answers")), "has no 'answers'"),
    "answers_a_string": (
        _with(lambda d: _qa(d).update(answers="Paris")),
        "'answers' is a string",
    ),
    "answer_a_string": (_with(lambda d: _qa(d).update(answers=["Paris"])), "answer 0 of"),
    "answer_text_a_number": (
        _with(lambda d: _qa(d)["answers"][0].update(text=1)),
        "'text' is an integer, not a string",
    ),
    "answer_start_a_string": (
        _with(lambda d: _qa(d)["answers"][0].update(answer_start="0")),
        "'answer_start' is a string, not an integer",
    ),
    "answer_start_true": (
        _with(lambda d: _qa(d)["answers"][0].update(answer_start=True)),
        "'answer_start' is true/false, not an integer",
    ),
    "answer_start_huge": (
        _with(lambda d: _qa(d)["answers"][0].update(answer_start=2**40)),
        "beyond a 32-bit integer",
    ),
    "id_a_number": (_with(lambda d: _qa(d).update(id=3)), "'id' is an integer, not a string"),
    "lone_surrogate": (
        SQUAD_BYTES.replace(b'"Paris is', b'"\\ud800 is'),
        "lone surrogate",
    ),
    "nested_deep": (b"[" * 100_000 + b"]" * 100_000, "not valid JSON"),
    "no_questions": ({"data": []}, "holds no questions"),
    "v1_without_answers": (_with(lambda d: _qa(d).update(answers=[])), "has no answer"),
}


@pytest.mark.parametrize("case", list(WRONG_SQUAD))
def test_squad_json_of_the_wrong_shape_is_one_line_saying_what(case, tmp_path):
    document, saying = WRONG_SQUAD[case]
    data = document if isinstance(document, bytes) else json.dumps(document).encode()
    path = _write(str(tmp_path), "dev.json", data)
    refusal = assert_refused(lambda: read_squad(path))
    assert isinstance(refusal, UserError), refusal
    assert path in str(refusal) and saying in str(refusal), str(refusal)


def test_the_valid_squad_file_is_read():
    path = _write(_scratch(), "dev.json", SQUAD_BYTES)
    assert len(list(read_squad(path))) == 2


# --- a prepared Quora directory: stats.json and the TFRecord splits -------------------------


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A directory prepare-quora wrote from 40 pairs: {name: bytes} of its files."""
    from t5tpu.tasks import quora_csv

    folder = tmp_path_factory.mktemp("quora")
    rows = [f"{i}\t{2 * i}\t{2 * i + 1}\tquestion {i}?\tquery {i}?\t{i % 2}" for i in range(1, 41)]
    (folder / "pairs.tsv").write_text("\t".join(quora_csv.FIELDS) + "\n" + "\n".join(rows) + "\n")
    quora_csv.prepare(str(folder / "pairs.tsv"), str(folder / "out"))
    return {path.name: path.read_bytes() for path in (folder / "out").iterdir()}


def _copy(files: dict[str, bytes], **replaced: bytes) -> str:
    folder = _scratch()
    for name, data in {**files, **replaced}.items():
        _write(folder, name, data)
    return folder


def read_quora_stats(folder: str):
    from t5tpu.tasks import quora

    return quora._prepared_source(folder)


@pytest.fixture(scope="module")
def stats_cases(prepared):
    """(valid stats.json, its boundaries, a folder whose stats.json each case overwrites)."""
    valid = prepared["stats.json"]
    return valid, [i for i, byte in enumerate(valid) if byte in b'{}[]:,"'], _copy(prepared)


def test_damaged_stats_json_is_read_or_refused_in_one_line(stats_cases):
    valid, boundaries, folder = stats_cases

    @FUZZ
    @given(damaged(valid, boundaries))
    def case(data):
        _write(folder, "stats.json", data)
        assert_refused(lambda: read_quora_stats(folder))

    case()


WRONG_STATS = {
    "a_list": (b"[]", "no 'pairs' object"),
    "no_pairs": (b'{"input": "train.csv"}', "no 'pairs' object"),
    "pairs_a_list": (b'{"pairs": [1, 2]}', "no 'pairs' object"),
    "count_a_string": (b'{"pairs": {"train": "36", "validation": 4}}', "pairs['train']"),
    "count_true": (b'{"pairs": {"train": 36, "validation": true}}', "pairs['validation']"),
    "count_negative": (b'{"pairs": {"train": -1, "validation": 4}}', "pairs['train']"),
    "split_missing": (b'{"pairs": {"train": 36}}', "pairs['validation']"),
    "not_json": (b"{pairs: 1}", "not JSON"),
}


@pytest.mark.parametrize("case", list(WRONG_STATS))
def test_a_stats_json_of_the_wrong_shape_is_one_line(case, prepared):
    data, saying = WRONG_STATS[case]
    folder = _copy(prepared, **{"stats.json": data})
    refusal = assert_refused(lambda: read_quora_stats(folder))
    assert isinstance(refusal, UserError), refusal
    message = str(refusal)
    assert "is not the stats.json `t5tpu prepare-quora` writes" in message and saying in message


def _record_boundaries(data: bytes) -> list[int]:
    """Offsets in a TFRecord file where a record, its length's CRC, its data and its data's
    CRC start."""
    boundaries, offset = [], 0
    while offset + 12 <= len(data):
        (length,) = struct.unpack_from("<Q", data, offset)
        boundaries += [offset, offset + 8, offset + 12, offset + 12 + length]
        offset += 16 + length
    return boundaries


def register_quora(folder: str) -> None:
    """The Quora tasks over the prepared `folder` (its stats.json is read now, its TFRecords
    when a split is checked or read)."""
    from t5tpu.tasks import quora

    from t5tpu.data import vocab

    gin.bind_parameter("quora_data_dir.path", folder)
    try:
        quora.register(vocab.default_vocabulary())
    finally:
        gin.clear_config()


def check_and_read_split(split: str):
    """check_readable of qp_is_duplicate's split (register_quora first); when it passes, every
    example of the split read through the task (seqio, tf.data), which must then not fail."""
    import seqio
    from t5tpu.tasks import quora

    from t5tpu.data import availability

    availability.check_readable(quora.TASK_NAME, split)
    task = seqio.get_mixture_or_task(quora.TASK_NAME)
    lengths = {"inputs": 32, "targets": 4}
    return list(task.get_dataset(lengths, split=split, shuffle=False).as_numpy_iterator())


@pytest.fixture(scope="module")
def records_cases(prepared):
    valid = prepared["validation.tfrecord"]
    return valid, _record_boundaries(valid), _copy(prepared)


def test_damaged_tfrecords_are_refused_in_one_line_before_tf_data_reads_them(records_cases):
    valid, boundaries, folder = records_cases
    register_quora(folder)
    outcomes = []

    @FUZZ
    @given(damaged(valid, boundaries))
    def case(data):
        _write(folder, "validation.tfrecord", data)
        outcome = assert_refused(lambda: check_and_read_split("validation"))
        if data != valid:  # every change loses or garbles a record: none may pass unnoticed
            assert isinstance(outcome, UserError), f"{len(data)} bytes read as {len(outcome)}"
            assert folder in str(outcome), str(outcome)
        outcomes.append(outcome)

    case()
    assert any(isinstance(o, UserError) for o in outcomes)


TFRECORD_DAMAGE = {
    "bit_flip": (lambda v: v[:20] + bytes([v[20] ^ 4]) + v[21:], "corrupted record"),
    "cut_in_a_record": (lambda v: v[: len(v) - 3], "truncated record"),
    "cut_in_a_header": (lambda v: v + v[:5], "cut short, 5 bytes after its last whole record"),
    "a_record_lost": (lambda v: v[: _record_boundaries(v)[-4]], "records where"),
    "emptied": (lambda v: b"", "holds 0 records where"),
    "not_an_example": (
        lambda v: _tfrecord([b"not a tf.train.Example"]),
        "is damaged",
    ),
}


def _tfrecord(payloads: list[bytes]) -> bytes:
    import tensorflow as tf

    path = os.path.join(_scratch(), "r.tfrecord")
    with tf.io.TFRecordWriter(path) as writer:
        for payload in payloads:
            writer.write(payload)
    with open(path, "rb") as f:
        return f.read()


@pytest.mark.parametrize("case", list(TFRECORD_DAMAGE))
def test_each_kind_of_tfrecord_damage_names_the_file(case, prepared):
    damage, saying = TFRECORD_DAMAGE[case]
    folder = _copy(prepared, **{"validation.tfrecord": damage(prepared["validation.tfrecord"])})
    register_quora(folder)
    refusal = assert_refused(lambda: check_and_read_split("validation"))
    assert isinstance(refusal, UserError), refusal
    message = str(refusal)
    assert os.path.join(folder, "validation.tfrecord") in message and saying in message, message


def test_the_prepared_splits_pass_the_check_and_read_whole(prepared):
    stats = json.loads(prepared["stats.json"])
    register_quora(_copy(prepared))
    for split in ("train", "validation"):
        assert len(check_and_read_split(split)) == stats["pairs"][split]


def test_a_damaged_record_met_in_training_is_one_line_naming_the_task_files(prepared):
    """Data larger than availability.SCANNED_BYTES is not read before the run: the training
    input turns tf.data's DataLossError into one line."""
    from t5tpu.data import pipeline
    from t5tpu.partitioning import DataLayout

    valid = prepared["train.tfrecord"]
    flipped = valid[:40] + bytes([valid[40] ^ 1]) + valid[41:]
    folder = _copy(prepared, **{"train.tfrecord": flipped})
    register_quora(folder)
    stream = pipeline.train_batches(
        "qp_is_duplicate", {"inputs": 32, "targets": 4}, 4, 0, False, layout=DataLayout(0, 1, 4)
    )
    refusal = assert_refused(lambda: next(stream))
    assert isinstance(refusal, UserError), refusal
    message = str(refusal)
    assert "corrupted record" in message and os.path.join(folder, "train.tfrecord") in message
