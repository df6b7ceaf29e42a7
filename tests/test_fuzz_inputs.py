"""Fuzzing of the readers of what the user gives and of what a run reads back: SentencePiece
models, gin files, TSV/JSONL rows, the Quora CSV of prepare-quora, infer's input lines,
eval_metrics.json, infer's chunk folder and an existing predictions file. Each damaged file is
read (tests/fuzzing.py) and must come back as data or one one-line UserError; the chunk folder
must moreover never merge a damaged chunk into the predictions file. Two CLI runs show the
same through the command line: exit 2, one stderr line, no traceback."""

from __future__ import annotations

import json
import os
import tempfile

import pytest
from cli_runs import TINY_EXPERIMENT, t5tpu
from fuzzing import FUZZ, assert_refused, damaged
from hypothesis import given
from hypothesis import strategies as st
from sentencepiece import sentencepiece_model_pb2 as sp_pb2
from t5tpu.tasks import quora_csv

from t5tpu import package_files
from t5tpu.config import gin_setup
from t5tpu.data import text_files
from t5tpu.data.sentencepiece_vocab import SentencePieceVocabulary
from t5tpu.errors import UserError
from t5tpu.runners import evaluator, infer_chunks, infer_inputs, prediction_files
from t5tpu.runners.infer_chunks import Assignment, ChunkStore, Span

# One folder for every case's files: hypothesis runs many cases in one test function call.
_ROOT = tempfile.TemporaryDirectory(prefix="t5tpu-fuzz-inputs-")  # removed at the worker's exit
FOLDER = _ROOT.name


def _file(name: str, data: bytes) -> str:
    path = os.path.join(FOLDER, name)
    with open(path, "wb") as f:
        f.write(data)
    return path


def _line_starts(data: bytes) -> list[int]:
    return [i + 1 for i, byte in enumerate(data) if byte == ord("\n")]


def _one_line(outcome) -> None:
    """A UserError the reader raised says what is wrong in one line (assert_refused checks
    that); here, the explicit cases must be refused."""
    assert isinstance(outcome, UserError), outcome


# --- SentencePiece models ----------------------------------------------------------------------


def _tiny_model() -> tuple[bytes, list[int]]:
    """An 8-piece unigram model, and the offsets where each of its fields ends: fields are
    serialized in field-number order, so each prefix below is a prefix of the bytes."""
    proto = sp_pb2.ModelProto()
    boundaries = []
    piece = sp_pb2.ModelProto.SentencePiece
    for text, kind in [("<pad>", piece.CONTROL), ("</s>", piece.CONTROL), ("<unk>", piece.UNKNOWN)]:
        proto.pieces.add(piece=text, score=0.0, type=kind)
        boundaries.append(len(proto.SerializeToString()))
    for i, text in enumerate(["▁", "a", "b", "▁a", "ab"]):
        proto.pieces.add(piece=text, score=-float(i), type=piece.NORMAL)
        boundaries.append(len(proto.SerializeToString()))
    spec = proto.trainer_spec
    spec.model_type, spec.vocab_size = sp_pb2.TrainerSpec.UNIGRAM, 8
    spec.pad_id, spec.eos_id, spec.unk_id, spec.bos_id = 0, 1, 2, -1
    boundaries.append(len(proto.SerializeToString()))
    proto.normalizer_spec.name = "identity"
    return proto.SerializeToString(), boundaries


TINY_MODEL, TINY_MODEL_BOUNDARIES = _tiny_model()
with open(package_files.asset("cpu_vocab.model"), "rb") as _f:
    BUNDLED_MODEL = _f.read()


def _use_vocabulary(path: str, extra_ids: int):
    """What a run asks of a vocabulary: its size and EOS, an encode, and the decode of every id
    (a piece that is not UTF-8 would fail only there)."""
    vocabulary = SentencePieceVocabulary(path, extra_ids=extra_ids)
    ids = vocabulary.encode("ab a ba")
    size = vocabulary.vocab_size
    vocabulary.decode(ids + list(range(size)) + [vocabulary.eos_id])
    return size


def test_the_tiny_model_is_a_model():
    assert _use_vocabulary(_file("tiny.model", TINY_MODEL), extra_ids=3) == 11


# Each damaged model is loaded in this process: a sentencepiece that aborted on one would end
# the test run, not fail one test.
@FUZZ
@given(damaged(TINY_MODEL, TINY_MODEL_BOUNDARIES), st.sampled_from([0, 3]))
def test_damaged_sentencepiece_models(data, extra_ids):
    path = _file("vocab.model", data)
    assert_refused(lambda: _use_vocabulary(path, extra_ids))


@FUZZ
@given(damaged(BUNDLED_MODEL, [len(BUNDLED_MODEL) // 2]))
def test_damaged_bundled_model(data):
    path = _file("bundled.model", data)
    assert_refused(lambda: _use_vocabulary(path, 0))


def test_models_that_are_not_usable_are_refused_in_one_line():
    no_eos = sp_pb2.ModelProto.FromString(TINY_MODEL)
    no_eos.pieces[1].piece = "<not-eos>"  # sentencepiece finds EOS by its piece, </s>
    not_utf8 = TINY_MODEL.replace(b"ab", b"\xe1b")
    cases = {
        "empty.model": (b"", "no pieces"),
        "cut.model": (BUNDLED_MODEL[:2000], "not a SentencePiece model proto"),
        "noeos.model": (no_eos.SerializeToString(), "no end-of-sequence piece"),
        "notutf8.model": (not_utf8, "is not UTF-8"),
    }
    for name, (data, why) in cases.items():
        outcome = assert_refused(lambda: _use_vocabulary(_file(name, data), 0))  # noqa: B023
        _one_line(outcome)
        assert why in str(outcome), outcome
    folder = assert_refused(lambda: _use_vocabulary(FOLDER, 0))
    _one_line(folder)
    assert "is a folder" in str(folder)


# --- gin files -----------------------------------------------------------------------------------

with open(os.path.join(os.path.dirname(__file__), "..", TINY_EXPERIMENT), "rb") as _f:
    GIN = _f.read()


@pytest.fixture(scope="module")
def gin_parsed_once():
    # The configurable modules are imported by the first parse: not a damaged file's cost.
    gin_setup.parse([TINY_EXPERIMENT], [], [])


@FUZZ
@given(damaged(GIN, _line_starts(GIN)))
def test_damaged_gin_files(gin_parsed_once, data):
    path = _file("experiment.gin", data)
    assert_refused(lambda: gin_setup.parse([path], [], []))


@pytest.mark.parametrize(
    "text, message",
    [
        (b"TRAIN_STEPS = 3\n\x80\xff\n", "experiment.gin is not UTF-8 text (line 2)"),
        (b"A = 1\nB = 2\x00\n", "experiment.gin is not text (a NUL byte on line 2)"),
        (b"A = 1\nB = (1,\n", "EOF in multi-line statement"),
        (b"A = 1\nB = 1 2\n", "experiment.gin, line 2)"),
        (b"no_such_configurable.x = 3\n", "No configurable matching 'no_such_configurable'"),
    ],
    ids=["not-utf8", "nul", "unclosed", "syntax", "unknown-configurable"],
)
def test_bad_gin_files_are_one_line_naming_file_and_line(gin_parsed_once, text, message):
    path = _file("experiment.gin", text)
    outcome = assert_refused(lambda: gin_setup.parse([path], [], []))
    _one_line(outcome)
    assert message in str(outcome) and path in str(outcome), outcome


def test_included_files_that_are_binary_or_missing_are_named(gin_parsed_once):
    binary = _file("binary.gin", b"\x00\x01\x02\xff" * 8)
    including = _file(
        "including.gin", f"include '{TINY_EXPERIMENT}'\ninclude '{binary}'\n".encode()
    )
    outcome = assert_refused(lambda: gin_setup.parse([including], [], []))
    _one_line(outcome)
    assert f"{binary} is not UTF-8 text (line 1)" in str(outcome)
    # A typo in a bundled include: gin's lookup of it on the Python path used to end in a
    # TypeError (the checkout's configs/ is a namespace package).
    typo = _file("typo.gin", b"include 'configs/topologies/cpu.gi'\n")
    outcome = assert_refused(lambda: gin_setup.parse([typo], [], []))
    _one_line(outcome)
    assert "Unable to open file: configs/topologies/cpu.gi." in str(outcome)


# --- TSV / JSONL rows of text_to_text -------------------------------------------------------

TSV = "input\ttarget\nWhat is 2+2?\tfour\nÇa va ?\toui\r\nthird\tone\n".encode()
JSONL = (
    b'{"input": "What is 2+2?", "target": "four"}\n'
    b'{"input": "\\u00c7a va ?", "target": "oui", "extra": [1, 2]}\n'
    b'{"input": "third", "target": "one"}\n'
)


@FUZZ
@given(
    st.sampled_from([("rows.tsv", TSV), ("rows.jsonl", JSONL)]).flatmap(
        lambda named: st.tuples(st.just(named[0]), damaged(named[1], _line_starts(named[1])))
    )
)
def test_damaged_text_to_text_files(named):
    name, data = named
    path = _file(name, data)
    rows = assert_refused(lambda: text_files.read_rows([path]))
    if not isinstance(rows, UserError):
        assert len(rows.inputs) == len(rows.targets)
        assert all(isinstance(t, str) for t in rows.inputs + rows.targets)


def test_json_rows_of_the_wrong_shape_are_counted_as_malformed():
    lines = [
        b"[1, 2]",
        b"7",
        b'"text"',
        b"null",
        b'{"input": "x"}',
        b'{"input": 1, "target": "y"}',
        b'{"input": "x", "target": ["y"]}',
        b'{"input": "x", "target": {"a": 1}}',
        b"[" * 50_000 + b"]" * 50_000,
        b"1" * 5000,
        b'{"input": "x", "target": "y"',
        b'{"input": "ok", "target": "fine"}',
    ]
    path = _file("shapes.jsonl", b"\n".join(lines) + b"\n")
    rows = assert_refused(lambda: text_files.read_rows([path]))
    assert rows.inputs == ["ok"] and rows.malformed == len(lines) - 1
    assert rows.first_problem == f"line 1 of {path}: not a JSON object"


@pytest.mark.parametrize(
    "name, data, line",
    [("utf16.tsv", "a\tb\n".encode("utf-16"), 1), ("nul.jsonl", b'{"a": 1}\n\x00\n', 2)],
)
def test_text_that_is_not_utf8_is_refused_with_its_line(name, data, line):
    outcome = assert_refused(lambda: text_files.read_rows([_file(name, data)]))
    _one_line(outcome)
    assert f"{name} is not a UTF-8 text file (line {line})" in str(outcome)


# --- the Quora CSV of prepare-quora -------------------------------------------------------------


def _quora_csv() -> bytes:
    rows = ["id,qid1,qid2,question1,question2,is_duplicate"]
    for i in range(24):
        question = f'"What is {i}, and why?"' if i % 3 else f"How do I learn {i}?"
        rows.append(f"{i},{2 * i},{2 * i + 1},{question},Is {i} a number?,{i % 2}")
    return ("\n".join(rows) + "\n").encode()


QUORA = _quora_csv()
assert any(quora_csv.is_validation_pair(i) for i in range(24))  # both splits get pairs


@pytest.fixture(scope="module")
def tensorflow_imported():
    # prepare imports TensorFlow on first use: once here, not inside a measured read.
    import tensorflow  # noqa: F401


def _prepare(path: str):
    return quora_csv.prepare(path, os.path.join(FOLDER, "quora-out"), overwrite=True)


def test_the_quora_file_is_prepared(tensorflow_imported):
    stats = _prepare(_file("pairs.csv", QUORA))
    assert sum(stats.pairs.values()) == 24 and not stats.rejected


@FUZZ
@given(damaged(QUORA, _line_starts(QUORA)))
def test_damaged_quora_files(tensorflow_imported, data):
    path = _file("pairs.csv", data)
    assert_refused(lambda: _prepare(path))


def test_quora_rows_too_long_for_any_record_are_refused_or_rejected(tensorflow_imported):
    header, first = QUORA.split(b"\n")[:2]
    huge_id = b"9" * 5000 + first[first.index(b",") :]
    rows = b"\n".join([header, huge_id, *QUORA.split(b"\n")[2:]])
    stats = assert_refused(lambda: _prepare(_file("pairs.csv", rows)))
    assert [r.line for r in stats.rejected] == [2] and "more than 18 digits" in str(stats.rejected)
    long_line = header + b"\n" + b"x" * (quora_csv.MAX_LINE_BYTES + 1)
    outcome = assert_refused(lambda: _prepare(_file("pairs.csv", long_line)))
    _one_line(outcome)
    assert "line 2 is longer than" in str(outcome)


# --- infer's input lines ------------------------------------------------------------------------

INPUTS = "What is 2+2?\r\nÇa va ?\n\n\tindented\rlast line without newline".encode()


def _read_inputs(path: str) -> list[str]:
    source = infer_inputs.from_files(path, None)
    texts = list(infer_inputs.Texts(source))
    assert len(texts) == source.total
    return texts


@FUZZ
@given(damaged(INPUTS, _line_starts(INPUTS)))
def test_damaged_infer_input_files(data):
    path = _file("inputs.txt", data)
    assert_refused(lambda: _read_inputs(path))


def test_a_line_longer_than_any_input_is_refused_without_reading_it_whole():
    path = _file("long.txt", b"fine\n" + b"x" * (32 * infer_inputs.MAX_LINE_BYTES))
    # Read whole, the file alone would be four times this.
    outcome = assert_refused(lambda: _read_inputs(path), max_mib=8)
    _one_line(outcome)
    assert "line 2 is longer than" in str(outcome)
    at_limit = _file("limit.txt", b"y" * infer_inputs.MAX_LINE_BYTES + b"\nz")
    assert [len(t) for t in _read_inputs(at_limit)] == [infer_inputs.MAX_LINE_BYTES, 1]


# --- eval_metrics.json read back ---------------------------------------------------------------

METRICS = json.dumps(
    {
        "100": {"qp_is_duplicate": {"accuracy": 61.9, "num_examples": 105}},
        "200": {"qp_is_duplicate": {"accuracy": 65.7, "num_examples": 105}, "other": {}},
    },
    indent=2,
    sort_keys=True,
).encode()


def _read_metrics(path: str):
    """recorded_metrics, then what evaluate and the evaluator do with it."""
    recorded = evaluator.recorded_metrics(path)
    newest = max(map(int, recorded), default=None)
    for tasks in recorded.values():
        tasks.setdefault("new_task", {}).update({"accuracy": 1.0})
    return newest


@FUZZ
@given(damaged(METRICS, _line_starts(METRICS)))
def test_damaged_eval_metrics(data):
    path = _file("eval_metrics.json", data)
    assert_refused(lambda: _read_metrics(path))


@pytest.mark.parametrize(
    "data",
    [
        b"[]",
        b'{"last": {}}',
        b'{"12": 5}',
        b'{"12": {"task": 0.5}}',
        b'{"\xd9\xa1": {}}',  # an Arabic-Indic digit, which int() would take
        b"[" * 100_000,
        b"\xff\xfe{}",
    ],
)
def test_eval_metrics_that_t5tpu_did_not_write_are_refused(data):
    _one_line(assert_refused(lambda: _read_metrics(_file("eval_metrics.json", data))))


def test_no_eval_metrics_is_a_fresh_start():
    assert evaluator.recorded_metrics(os.path.join(FOLDER, "none.json")) == {}


# --- infer's chunks read back when resuming ----------------------------------------------------

TOTAL, CHUNK = 10, 4
LINES = [prediction_files.json_line(f"input {i}", f"prédiction {i}") for i in range(TOTAL)]
MANIFEST = {"inputs": "fingerprint", "step": 2, "chunk_size": CHUNK}


def _interrupted_run(folder: str) -> ChunkStore:
    """Chunks [0, 4) and [4, 8) written and END recorded, [8, 10) not: a shard that stopped."""
    store = ChunkStore(os.path.join(folder, "out.jsonl"), MANIFEST)
    store.open(writer=True)
    for span in (Span(0, 4), Span(4, 8)):
        store.write(span, LINES[span.start : span.end])
    store.record_end(TOTAL)
    return store


def _resumed(final_path: str) -> bytes:
    """What a rerun writes: it decodes (here, looks up) the inputs no sound chunk holds."""
    store = ChunkStore(final_path, MANIFEST)
    done = store.open(writer=True)
    records = iter(range(TOTAL))
    for span, indices in infer_chunks.pieces(records, assignment=Assignment(CHUNK), done=done):
        store.write(span, [LINES[i] for i in indices])
    store.record_end(TOTAL)
    store.merge(store.complete())
    with open(final_path, "rb") as f:
        return f.read()


def _files_of_a_run() -> dict[str, bytes]:
    folder = tempfile.mkdtemp(dir=FOLDER)
    store = _interrupted_run(folder)
    return {path.name: path.read_bytes() for path in store.folder.iterdir()}


RUN_FILES = _files_of_a_run()


def _passes_for_a_chunk(data: bytes, lines: int) -> bool:
    """Whether a chunk's bytes look whole (the checks' promise): one UTF-8 line per input."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return data.count(b"\n") == lines and data.endswith(b"\n") and "\0" not in text


@FUZZ
@given(
    st.sampled_from(sorted(RUN_FILES)).flatmap(
        lambda name: st.tuples(
            st.just(name), damaged(RUN_FILES[name], _line_starts(RUN_FILES[name]))
        )
    )
)
def test_damaged_chunk_folders_start_afresh_and_never_merge_damage(named):
    name, data = named
    folder = tempfile.mkdtemp(dir=FOLDER)
    store = _interrupted_run(folder)
    (store.folder / name).write_bytes(data)
    written = assert_refused(lambda: _resumed(store.final_path))
    expected = b"".join(line.encode() for line in LINES)
    if isinstance(written, bytes) and written != expected:
        # Only a chunk that still looks whole may be merged, and then as it is: no check can
        # tell a changed letter from a prediction. A damaged MANIFEST or END changes nothing.
        assert name.endswith(".jsonl"), name
        span = Span(*(int(n) for n in name.removesuffix(".jsonl").split("-")))
        assert _passes_for_a_chunk(data, span.end - span.start), name
        before = b"".join(line.encode() for line in LINES[: span.start])
        after = b"".join(line.encode() for line in LINES[span.end :])
        assert written == before + data + after


def test_chunks_that_overlap_or_name_no_inputs_are_decoded_again(capsys):
    folder = tempfile.mkdtemp(dir=FOLDER)
    store = _interrupted_run(folder)
    (store.folder / Span(2, 6).file_name()).write_text("".join(LINES[2:6]))
    (store.folder / "000000000009-000000000008.jsonl").write_text("x\n")
    (store.folder / Span(8, 10).file_name()).write_text(LINES[8])  # one line of two
    assert _resumed(store.final_path) == "".join(LINES).encode()
    said = capsys.readouterr().err
    assert said.count("decoding again") == 3, said
    assert "overlaps another chunk" in said and "does not hold 2 complete lines" in said


# --- an existing predictions file ---------------------------------------------------------------

PREDICTIONS = b"".join(line.encode() for line in LINES[:3])
TEXTS = [f"input {i}" for i in range(3)]


def _holds_reference(data: bytes) -> bool:
    """Whether the lines of `data` are JSON objects whose "input"s are TEXTS."""
    try:
        rows = [json.loads(line.decode("utf-8")) for line in data.split(b"\n") if line.strip()]
        return [row["input"] for row in rows] == TEXTS
    except (ValueError, KeyError, TypeError, RecursionError):
        return False


@FUZZ
@given(damaged(PREDICTIONS, _line_starts(PREDICTIONS)))
def test_damaged_predictions_files_are_kept_and_another_name_used(data):
    path = _file("predictions.jsonl", data)
    chosen = assert_refused(lambda: prediction_files.own_file(path, TEXTS))
    assert chosen == (path if _holds_reference(data) else path.replace(".jsonl", ".2.jsonl"))


def test_a_folder_where_the_predictions_file_goes_is_one_line():
    folder = os.path.join(FOLDER, "taken.jsonl")
    os.makedirs(folder, exist_ok=True)
    outcome = assert_refused(lambda: prediction_files.own_file(folder, TEXTS))
    _one_line(outcome)
    assert "is a folder" in str(outcome)


# --- through the command line ------------------------------------------------------------------


def _refused(run) -> str:
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert run.returncode == 2 and len(lines) == 1, (run.returncode, run.stderr[-3000:])
    assert "Traceback" not in run.stderr + run.stdout
    return lines[0]


def test_train_with_a_cut_vocabulary_is_one_line_and_writes_nothing(tmp_path):
    vocabulary = tmp_path / "cut.model"
    vocabulary.write_bytes(BUNDLED_MODEL[:2000])
    model_dir = tmp_path / "run"
    run = t5tpu(
        "train",
        f"--gin_file={TINY_EXPERIMENT}",
        f"--gin.default_vocabulary.sentencepiece_model_file='{vocabulary}'",
        "--gin.TRAIN_STEPS=1",
        model_dir=model_dir,
    )
    line = _refused(run)
    assert f"{vocabulary} is not a usable SentencePiece model" in line
    assert not model_dir.exists()


def test_infer_with_a_gin_file_including_a_binary_file_is_one_line(tmp_path):
    binary = tmp_path / "binary.gin"
    binary.write_bytes(b"TRAIN_STEPS = 1\n\xff\xfe\x00\x01")
    experiment = tmp_path / "experiment.gin"
    experiment.write_text(f"include '{TINY_EXPERIMENT}'\ninclude '{binary}'\n")
    run = t5tpu("infer", f"--gin_file={experiment}", model_dir=tmp_path / "run")
    assert f"{binary} is not UTF-8 text (line 2)" in _refused(run)
