"""`t5tpu prepare-quora` (t5tpu.tasks.quora_csv.prepare, t5tpu.cli.prepare_quora.main): real
files, hostile rows, overwrite refusal, atomic output and byte-for-byte determinism."""

import hashlib
import json
import os

import pytest
import tensorflow as tf
from t5tpu.tasks import quora, quora_csv

from t5tpu.cli import prepare_quora
from t5tpu.errors import UserError

PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED_QUORA = os.path.join(PROJECT_ROOT, "..", "shared", "data", "quora")
KAGGLE_CSV = os.path.join(SHARED_QUORA, "kaggle_train_head999.csv")
RELEASE_TSV = os.path.join(SHARED_QUORA, "quora_duplicate_questions_first8000.tsv")

# Kaggle's format (every field quoted, CRLF line ends) with the rows a real file can hold.
# Physical lines: 1 header, 2 ok, 3-4 one record (quoted newline), 5 empty question, 6 missing
# field, 7 bad label, 8 non-ASCII ok, 9 blank, 10 bad id, 11 repeated id, 12 extra field,
# 13 invalid UTF-8, 14 ok with a quoted tab and no final newline.
HOSTILE_CSV = (
    b'"id","qid1","qid2","question1","question2","is_duplicate"\r\n'
    b'"0","1","2","What is 1, 2, 3?","Why ""quotes"" here?","0"\r\n'
    b'"1","3","4","A question\r\nspanning lines, with a comma?","Another one?","1"\r\n'
    b'"2","5","6","","Empty first question?","0"\r\n'
    b'"3","7","8","Missing a field","1"\r\n'
    b'"4","9","10","Bad label?","Yes","2"\r\n'
    b'"5","11","12","'
    + "Qu'est-ce que c'est? 日本語".encode()
    + b'","'
    + "Ça va?".encode()
    + b'","1"\r\n'
    b"\r\n"
    b'"x","13","14","a","b","0"\r\n'
    b'"1","15","16","repeated id","b","0"\r\n'
    b'"7","17","18","a","b","0","extra"\r\n'
    b'"8","19","20","\xff\xfe broken","b","1"\r\n'
    b'"9","21","22","with\ta tab","last one","0"'
)
HOSTILE_REJECTIONS = [
    {"line": 5, "last_line": 5, "reason": "question1 is empty"},
    {"line": 6, "last_line": 6, "reason": "expected 6 fields, found 5"},
    {"line": 7, "last_line": 7, "reason": "is_duplicate '2' is not 0 or 1"},
    {"line": 10, "last_line": 10, "reason": "id 'x' is not a non-negative integer"},
    {"line": 11, "last_line": 11, "reason": "id 1 already used on line 3"},
    {"line": 12, "last_line": 12, "reason": "expected 6 fields, found 7"},
    {"line": 13, "last_line": 13, "reason": "not valid UTF-8"},
]


def read_split(output_dir, split) -> list[dict]:
    path = os.path.join(str(output_dir), quora_csv.OUTPUT_FILES[split])
    description = quora_csv.tfrecord_feature_description()
    dataset = tf.data.TFRecordDataset(path).map(
        lambda record: tf.io.parse_single_example(record, description)
    )
    return [
        {k: v.decode() if isinstance(v, bytes) else int(v) for k, v in example.items()}
        for example in dataset.as_numpy_iterator()
    ]


def read_stats(output_dir) -> dict:
    with open(os.path.join(str(output_dir), quora_csv.STATS_FILE)) as file:
        return json.load(file)


def output_bytes(output_dir) -> dict[str, bytes]:
    return {name: (output_dir / name).read_bytes() for name in sorted(os.listdir(output_dir))}


@pytest.fixture(scope="module")
def hostile_csv(tmp_path_factory):
    path = tmp_path_factory.mktemp("hostile") / "train.csv"
    path.write_bytes(HOSTILE_CSV)
    return str(path)


def test_kaggle_csv_gives_the_sample_split_and_text(tmp_path):
    stats = quora_csv.prepare(KAGGLE_CSV, str(tmp_path))
    assert (stats.format, stats.pairs, stats.duplicates) == (
        "csv",
        {"train": 895, "validation": 104},
        {"train": 344, "validation": 36},
    )
    assert stats.rejected == [] and stats.blank_lines == []
    assert sorted(os.listdir(tmp_path)) == ["stats.json", "train.tfrecord", "validation.tfrecord"]
    train, validation = read_split(tmp_path, "train"), read_split(tmp_path, "validation")
    assert sorted(p["id"] for p in train + validation) == list(range(999))
    assert all(quora_csv.is_validation_pair(p["id"]) for p in validation)
    # The CSV holds the same rows as the bundled TSV sample (ids 0..998): same text, same split.
    for split, pairs in (("train", train), ("validation", validation)):
        expected = [p for p in quora_csv.read_pairs(quora.sample_path(split)) if p["id"] != "999"]
        assert [(p["id"], p["question1"], p["question2"], p["is_duplicate"]) for p in pairs] == [
            (int(p["id"]), p["question1"], p["question2"], int(p["is_duplicate"])) for p in expected
        ]
    assert train[0] == {
        "id": 1,
        "qid1": 3,
        "qid2": 4,
        "question1": "What is the story of Kohinoor (Koh-i-Noor) Diamond?",
        "question2": "What would happen if the Indian government stole the Kohinoor "
        "(Koh-i-Noor) diamond back?",
        "is_duplicate": 0,
    }


def test_release_tsv_keeps_the_quoted_newline(tmp_path):
    stats = quora_csv.prepare(RELEASE_TSV, str(tmp_path))
    assert (stats.format, stats.pairs, stats.duplicates, stats.rejected) == (
        "tsv",
        {"train": 7159, "validation": 841},
        {"train": 2677, "validation": 302},
        [],
    )
    recorded = read_stats(tmp_path)
    assert recorded["duplicate_fraction"] == pytest.approx(2979 / 8000)
    assert recorded["num_rejected"] == 0
    pair = next(p for p in read_split(tmp_path, "train") if p["id"] == 2332)
    assert pair["question1"] == "Which is the best RO water purifier in Ahmedabad?\n"


def test_hostile_rows_are_counted_and_reported_by_line(hostile_csv, tmp_path, capsys):
    assert prepare_quora.main([f"--input={hostile_csv}", f"--output_dir={tmp_path}"]) == 0
    stats = read_stats(tmp_path)
    assert stats["pairs"] == {"train": 3, "validation": 1}
    assert stats["duplicates"] == {"train": 2, "validation": 0}
    assert stats["rejected"] == HOSTILE_REJECTIONS and stats["num_rejected"] == 7
    assert stats["blank_lines"] == [9]
    pairs = {p["id"]: p for split in quora_csv.SPLITS for p in read_split(tmp_path, split)}
    assert sorted(pairs) == [0, 1, 5, 9]
    assert pairs[0]["question2"] == 'Why "quotes" here?'
    assert pairs[1]["question1"] == "A question\r\nspanning lines, with a comma?"
    assert (pairs[5]["question1"], pairs[5]["question2"]) == (
        "Qu'est-ce que c'est? 日本語",
        "Ça va?",
    )
    assert pairs[9]["question1"] == "with\ta tab"
    printed = capsys.readouterr().out.splitlines()
    assert printed[1:] == [
        f"train: 3 pairs, 2 duplicates -> {tmp_path}/train.tfrecord",
        f"validation: 1 pairs, 0 duplicates -> {tmp_path}/validation.tfrecord",
        "duplicates: 50.0% of 4 pairs",
        "rejected: 7 rows",
        "  line 5: question1 is empty",
        "  line 6: expected 6 fields, found 5",
        "  line 7: is_duplicate '2' is not 0 or 1",
        "  line 10: id 'x' is not a non-negative integer",
        "  line 11: id 1 already used on line 3",
        "  line 12: expected 6 fields, found 7",
        "  line 13: not valid UTF-8",
        "blank lines skipped: 1 (listed in stats.json)",
    ]


def test_glue_style_tsv_needs_quoting_none_for_a_stray_quote(tmp_path):
    """GLUE writes QQP without csv quoting: a question that opens a quote it never closes
    swallows the rest of the file under csv rules (reported, not dropped); --quoting=none
    reads one record per line."""
    source = tmp_path / "qqp.tsv"
    source.write_text(
        "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n"
        '0\t1\t2\t"Unclosed quote?\tSecond?\t0\n'
        "1\t3\t4\tFine?\tAlso fine?\t1\n"
        "2\t5\t6\tOK?\tYes?\t0\n"
    )
    with pytest.raises(
        UserError, match=r"no usable pairs \(1 rows rejected, e\.g\. lines 2-4: "
    ) as e:
        quora_csv.prepare(str(source), str(tmp_path / "quoted"))
    assert str(e.value).endswith("; GLUE's QQP files need --quoting=none")
    assert not (tmp_path / "quoted").exists()  # a failed run leaves nothing, not even the dir

    stats = quora_csv.prepare(str(source), str(tmp_path / "plain"), quoting="none")
    assert (stats.pairs, stats.rejected) == ({"train": 2, "validation": 1}, [])
    validation = read_split(tmp_path / "plain", "validation")
    assert [(p["id"], p["question1"]) for p in validation] == [(0, '"Unclosed quote?')]


def test_a_quote_closed_mid_field_is_rejected_not_dropped(tmp_path):
    """Under csv rules '"Quoted" words?' would lose both quotes and pass as another question;
    it is rejected with the hint instead, and read as written with --quoting=none."""
    source = tmp_path / "qqp.tsv"
    source.write_text(
        "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n"
        '1\t1\t2\t"Imagine" by whom?\tWho wrote Imagine?\t1\n'
        "0\t3\t4\tFine?\tAlso fine?\t1\n"
        "2\t5\t6\tOK?\tYes?\t0\n"
    )
    stats = quora_csv.prepare(str(source), str(tmp_path / "quoted"))
    assert sum(stats.pairs.values()) == 2
    assert [r.describe() for r in stats.rejected] == [
        "line 2: unreadable record ('\\t' expected after '\"'; if quotes are text in this "
        "file: --quoting=none)"
    ]

    quora_csv.prepare(str(source), str(tmp_path / "plain"), quoting="none")
    train = read_split(tmp_path / "plain", "train")
    assert [(p["id"], p["question1"]) for p in train] == [(1, '"Imagine" by whom?'), (2, "OK?")]


def test_unknown_header_and_missing_input_are_user_errors(tmp_path):
    source = tmp_path / "test.tsv"
    source.write_text("id\tquestion1\tquestion2\n0\ta?\tb?\n")
    with pytest.raises(UserError, match="expected the header id,qid1,qid2,question1,question2"):
        quora_csv.prepare(str(source), str(tmp_path / "out"))
    with pytest.raises(UserError, match="input file not found"):
        quora_csv.prepare(str(tmp_path / "nope.csv"), str(tmp_path / "out"))
    with pytest.raises(UserError, match="is a directory; pass the pairs file in it"):
        quora_csv.prepare(str(tmp_path), str(tmp_path / "out"))
    with pytest.raises(UserError, match="test.tsv is a file; pass a directory"):
        quora_csv.prepare(KAGGLE_CSV, str(source))
    # Pairs only in train (id 0 goes to validation, ids 1 and 2 to train): eval would fail later.
    one_split = tmp_path / "one_split.tsv"
    one_split.write_text("id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n1\t3\t4\tA?\tB?\t1\n")
    with pytest.raises(UserError, match="1 usable pairs, none in the validation split"):
        quora_csv.prepare(str(one_split), str(tmp_path / "out"))
    assert sorted(os.listdir(tmp_path)) == ["one_split.tsv", "test.tsv"]


@pytest.mark.parametrize(
    "data",
    [
        b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR",
        b"\xff\xfei\x00d\x00,\x00q\x00",  # UTF-16 text
        b"id,qid1\x00,qid2\n",  # NULs in UTF-8
    ],
    ids=["png", "utf16", "nul"],
)
def test_a_binary_input_is_a_user_error_naming_it_and_writes_nothing(data, tmp_path):
    source = tmp_path / "train.csv"
    source.write_bytes(data)
    with pytest.raises(UserError, match=f"--input={source} is not a text file"):
        quora_csv.prepare(str(source), str(tmp_path / "out"))
    assert sorted(os.listdir(tmp_path)) == ["train.csv"]


def test_a_header_csv_cannot_parse_is_the_header_error(tmp_path):
    source = tmp_path / "train.csv"
    source.write_bytes(b"id,qid1\r,qid2 and more\n")  # a lone "\r": csv.Error, not a traceback
    with pytest.raises(UserError, match="expected the header id,qid1,qid2"):
        quora_csv.prepare(str(source), str(tmp_path / "out"))


def test_existing_output_is_kept_without_overwrite(hostile_csv, tmp_path):
    quora_csv.prepare(KAGGLE_CSV, str(tmp_path))
    before = output_bytes(tmp_path)
    with pytest.raises(UserError) as raised:
        quora_csv.prepare(hostile_csv, str(tmp_path))
    assert str(raised.value) == (
        f"{tmp_path} already holds train.tfrecord, validation.tfrecord, stats.json; pass "
        "--overwrite to replace them or choose another --output_dir"
    )
    assert output_bytes(tmp_path) == before

    quora_csv.prepare(hostile_csv, str(tmp_path), overwrite=True)
    assert read_stats(tmp_path)["pairs"] == {"train": 3, "validation": 1}
    assert sorted(os.listdir(tmp_path)) == ["stats.json", "train.tfrecord", "validation.tfrecord"]


def test_a_failure_midway_leaves_the_previous_dataset_whole(tmp_path, monkeypatch):
    quora_csv.prepare(KAGGLE_CSV, str(tmp_path))
    before = output_bytes(tmp_path)
    serialize = quora_csv._serialize
    written = []

    def fail_on_the_500th(pair):
        written.append(pair["id"])
        if len(written) == 500:
            raise OSError("disk full")
        return serialize(pair)

    monkeypatch.setattr(quora_csv, "_serialize", fail_on_the_500th)
    with pytest.raises(OSError, match="disk full"):
        quora_csv.prepare(RELEASE_TSV, str(tmp_path), overwrite=True)
    assert output_bytes(tmp_path) == before  # no temporary files left, nothing replaced


def test_same_input_gives_the_same_bytes(hostile_csv, tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    quora_csv.prepare(hostile_csv, str(first))
    quora_csv.prepare(hostile_csv, str(second))
    assert output_bytes(first) == output_bytes(second)
    # And across processes and machines: these are the bytes every run has written.
    digests = {
        name: hashlib.sha256(data).hexdigest()[:16]
        for name, data in output_bytes(first).items()
        if name.endswith(".tfrecord")
    }
    assert digests == {
        "train.tfrecord": "ada62ba9d0c6d217",
        "validation.tfrecord": "3bc0f593d60955c1",
    }
