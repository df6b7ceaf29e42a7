"""What `t5tpu infer` decodes and the settings it refuses: a split the task lacks or cannot
read (eval and train too), INFER_NUM_EXAMPLES, NUM_BEAMS, and decoding settings
(DecodingSettings.check) that would crash, decode nonsense or be silently ignored. The model is
trained for two steps: these tests check what is read and refused, not what the model predicts."""

import json
import pathlib
import re
import shutil

import pytest
from cli_runs import TINY_EXPERIMENT as EXPERIMENT
from cli_runs import TRAINED_TINY_STEPS, t5tpu
from cli_runs import read_jsonl as read_rows

from t5tpu import package_files
from t5tpu.errors import UserError
from t5tpu.model import decoding_settings
from t5tpu.model.decoding_settings import DecodingSettings
from t5tpu.runners import infer as infer_runner
from t5tpu.runners import infer_chunks, infer_inputs
from t5tpu.runners.prediction_files import file_name, own_file
from t5tpu.storage import run_record
from t5tpu.storage.run_record import InputShaping

RUNS = package_files.configs_dir("runs")
STEPS = TRAINED_TINY_STEPS
VALIDATION_PAIRS = 105  # the bundled sample's validation split


@pytest.fixture(scope="module")
def model_dir(trained_tiny, tmp_path_factory):
    """The tiny Quora experiment trained for two steps (a checkpoint to decode with): this
    module's copy of the shared run (conftest's trained_tiny), as these tests write predictions
    and configs into it."""
    return shutil.copytree(trained_tiny, tmp_path_factory.mktemp("quora_model") / "model")


def infer(model_dir, *extra):
    return t5tpu("infer", f"--gin_file={EXPERIMENT}", f"--gin.MODEL_DIR='{model_dir}'", *extra)


def files_in(folder):
    return sorted(str(p.relative_to(folder)) for p in pathlib.Path(folder).rglob("*"))


def refused(run) -> str:
    """The one stderr line of a run that refused its input with exit code 2."""
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert run.returncode == 2 and len(lines) == 1, (run.returncode, run.stderr[-2000:])
    assert lines[0].startswith("t5tpu: error: ")
    return lines[0]


# --- DecodingSettings.check ------------------------------------------------------------------

VOCAB = 1024


@pytest.mark.parametrize(
    "temperature, top_k, num_beams",
    [(0.0, 0, 1), (1, 0, 1), (0.7, 40, 1), (1.0, VOCAB, 1), (0.0, 5, 1), (0.0, 0, 4)],
)
def test_check_settings_accepts_greedy_sampling_and_beam_search(temperature, top_k, num_beams):
    decoding_settings.DecodingSettings(temperature, top_k, num_beams).check(VOCAB)


@pytest.mark.parametrize(
    "temperature, top_k, num_beams, message",
    [
        (-1.0, 0, 1, "TEMPERATURE = -1.0 must be 0.0 (greedy) or a number from 1e-06 to 1e+06"),
        (float("nan"), 0, 1, "TEMPERATURE = nan must be 0.0 (greedy) or a number from 1e-06"),
        ("hot", 0, 1, "TEMPERATURE = 'hot' must be 0.0 (greedy) or a number from 1e-06"),
        (1e-320, 0, 1, "TEMPERATURE = 1e-320 must be 0.0 (greedy) or a number from 1e-06"),
        (1e308, 0, 1, "TEMPERATURE = 1e+308 must be 0.0 (greedy) or a number from 1e-06"),
        (1.0, VOCAB + 1, 1, f"TOP_K = {VOCAB + 1} must be at most the vocabulary size ({VOCAB})"),
        (1.0, -1, 1, "TOP_K = -1 must be a whole number >= 0 (0: no limit)"),
        (0.0, 0, 0, "NUM_BEAMS = 0 must be a whole number from 1 to 16"),
        (0.5, 0, 2, "NUM_BEAMS = 2 is beam search, which does not sample, so TEMPERATURE"),
        (0.0, 40, 2, "TOP_K would be ignored; leave TEMPERATURE = 0.0, TOP_K = 0, TOP_P = 1.0"),
    ],
)
def test_check_settings_refuses(temperature, top_k, num_beams, message):
    with pytest.raises(UserError, match=re.escape(message)):
        decoding_settings.DecodingSettings(temperature, top_k, num_beams).check(VOCAB)


@pytest.mark.parametrize(
    "top_p, num_beams, message",
    [
        (0.0, 1, "TOP_P = 0.0 must be a number above 0 and at most 1 (1.0: no limit)"),
        (1.5, 1, "TOP_P = 1.5 must be a number above 0 and at most 1"),
        ("most", 1, "TOP_P = 'most' must be a number above 0"),
        (0.9, 2, "does not sample, so TOP_P would be ignored"),
    ],
)
def test_check_settings_refuses_a_top_p_out_of_range_or_beside_beams(top_p, num_beams, message):
    decoding_settings.DecodingSettings(temperature=0.7, top_p=0.9).check(VOCAB)
    with pytest.raises(UserError, match=re.escape(message)):
        decoding_settings.DecodingSettings(num_beams=num_beams, top_p=top_p).check(VOCAB)


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"repetition_penalty": 0.0}, "REPETITION_PENALTY = 0.0 must be a number from 0.001"),
        ({"repetition_penalty": "high"}, "REPETITION_PENALTY = 'high' must be a number from"),
        ({"repetition_penalty": 1e9}, "REPETITION_PENALTY = 1000000000.0 must be a number"),
        (
            {"no_repeat_ngram_size": -1},
            "NO_REPEAT_NGRAM_SIZE = -1 must be a whole number from 0 to 65536",
        ),
        ({"min_new_tokens": 2.5}, "MIN_NEW_TOKENS = 2.5 must be a whole number from 0 to 65536"),
        ({"num_beams": 2, "min_new_tokens": 3}, "takes no penalties, so MIN_NEW_TOKENS would be"),
        ({"num_return_sequences": 2}, "NUM_RETURN_SEQUENCES = 2 must be at most 1 with greedy"),
        ({"num_beams": 2, "num_return_sequences": 3}, "NUM_RETURN_SEQUENCES = 3 must be at most"),
    ],
)
def test_check_settings_refuses_penalties_out_of_range_or_beside_beams(settings, message):
    decoding_settings.DecodingSettings(repetition_penalty=1.2, no_repeat_ngram_size=3).check(VOCAB)
    with pytest.raises(UserError, match=re.escape(message)):
        decoding_settings.DecodingSettings(**settings).check(VOCAB)


def test_decoding_macros_are_defined_once_for_eval_and_infer():
    """eval.gin and infer.gin both include decoding.gin and define none of its macros: a default
    of their own would silently change the other command's, as experiments include both."""
    texts = {name: pathlib.Path(RUNS, name).read_text() for name in ("eval.gin", "infer.gin")}
    texts["decoding.gin"] = pathlib.Path(RUNS, "decoding.gin").read_text()
    defined = {
        name: re.findall(
            r"^(NUM_BEAMS|TEMPERATURE|TOP_K|TOP_P|REPETITION_PENALTY|NO_REPEAT_NGRAM_SIZE"
            r"|MIN_NEW_TOKENS|NUM_RETURN_SEQUENCES) = (.*)$",
            text,
            re.M,
        )
        for name, text in texts.items()
    }
    decoding_macros = [("NUM_BEAMS", "1"), ("TEMPERATURE", "0.0"), ("TOP_K", "0")]
    decoding_macros += [("TOP_P", "1.0"), ("REPETITION_PENALTY", "1.0")]
    decoding_macros += [("NO_REPEAT_NGRAM_SIZE", "0"), ("MIN_NEW_TOKENS", "0")]
    decoding_macros += [("NUM_RETURN_SEQUENCES", "1")]
    assert defined == {"eval.gin": [], "infer.gin": [], "decoding.gin": decoding_macros}
    for name in ("eval.gin", "infer.gin"):
        assert "include 'configs/runs/decoding.gin'" in texts[name]


# --- through the command line -----------------------------------------------------------------


TASK_MODULE = """
import seqio, tensorflow as tf
from t5tpu.data import vocab

FEATURES = {"inputs": seqio.Feature(vocab.default_vocabulary()),
            "targets": seqio.Feature(vocab.default_vocabulary())}
source = seqio.TFExampleDataSource(
    {"test": "{folder}/test-*.tfrecord"}, {"inputs": tf.io.FixedLenFeature([], tf.string)})
seqio.TaskRegistry.remove("records")
seqio.TaskRegistry.add("records", source=source, preprocessors=[seqio.preprocessors.tokenize],
                       output_features=FEATURES)
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    "task, split, why",
    [
        # stats.json says `prepare-quora` finished, but validation.tfrecord is gone.
        (
            "qp_is_duplicate",
            "validation",
            "no file {folder}/validation.tfrecord",
        ),
        ("records", "test", "no file matches {folder}/test-*.tfrecord"),
    ],
)
def test_declared_split_without_its_files_is_refused(model_dir, tmp_path, task, split, why):
    """A split the task declares but whose data is missing: one line naming what is missing."""
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "stats.json").write_text(json.dumps({"pairs": {"train": 3, "validation": 2}}))
    module = tmp_path / "tasks.py"
    module.write_text(TASK_MODULE.replace("{folder}", str(folder)))
    flags = [f"--gin.INFER_SPLIT='{split}'", f"--gin.QUORA_DATA_DIR='{folder}'"]
    if task != "qp_is_duplicate":
        flags += [
            f"--gin.MIXTURE_OR_TASK_MODULE='{module}'",
            f"--gin.MIXTURE_OR_TASK_NAME='{task}'",
        ]
    before = files_in(model_dir)
    assert refused(infer(model_dir, *flags)) == (
        f"t5tpu: error: cannot read the '{split}' split of task '{task}' "
        f"({why.replace('{folder}', str(folder))}); restore its data or set INFER_SPLIT to "
        "another split"
    )
    assert files_in(model_dir) == before


@pytest.mark.slow
def test_eval_and_train_refuse_a_split_without_its_files(model_dir, tmp_path):
    """data.check_readable, which infer uses above, guards eval and train too."""
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "stats.json").write_text(json.dumps({"pairs": {"train": 3, "validation": 2}}))
    data_flags = [f"--gin_file={EXPERIMENT}", f"--gin.QUORA_DATA_DIR='{folder}'"]
    before = files_in(model_dir)
    run = t5tpu("eval", *data_flags, f"--gin.MODEL_DIR='{model_dir}'")
    assert refused(run) == (
        "t5tpu: error: cannot read the 'validation' split of task 'qp_is_duplicate' (no file "
        f"{folder}/validation.tfrecord); restore its data or set EVAL_SPLIT to another split"
    )
    assert files_in(model_dir) == before
    new_dir = tmp_path / "new_model"
    run = t5tpu("train", *data_flags, f"--gin.MODEL_DIR='{new_dir}'")
    assert refused(run) == (
        "t5tpu: error: cannot read the 'train' split of task 'qp_is_duplicate' (no file "
        f"{folder}/train.tfrecord); restore its data"
    )
    assert not new_dir.exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    "flags, message",
    [
        # The rest of DecodingSettings.check is tested above; TOP_K is in test_cli.py.
        (["--gin.NUM_BEAMS=3", "--gin.TEMPERATURE=0.5"], "or set NUM_BEAMS = 1"),
        (
            ["--gin.INFER_NUM_EXAMPLES=0"],
            "INFER_NUM_EXAMPLES = 0 must be None or a whole number >= 1",
        ),
    ],
)
def test_bad_decoding_settings_are_refused_before_anything_is_written(model_dir, flags, message):
    before = files_in(model_dir)
    assert message in refused(infer(model_dir, *flags))
    assert files_in(model_dir) == before


# --- reading INFER_INPUT_FILE and INFER_INPUTS (in-process: no model needed) ------------------


class _CharVocabulary:
    """One token per character, EOS 1: lengths are easy to count."""

    eos_id = 1

    def encode(self, text):
        return [ord(c) for c in text]


class _SmallModel:
    """What infer's settings check reads of a model: its vocabulary's size."""

    class config:  # noqa: N801 - an attribute, as EncoderDecoderModel's
        vocab_size = 100


@pytest.mark.parametrize(
    "data, line",
    [(b"ok\n\xff\xfe binary\n", 2), (b"one\ntwo\n\nfour\x00\n", 4), (b"\xff\xfeh\x00i\x00", 1)],
    ids=["not-utf8", "nul", "utf16"],
)
def test_a_binary_input_file_is_one_user_error_with_its_line(tmp_path, data, line):
    path = tmp_path / "inputs.txt"
    path.write_bytes(data)
    with pytest.raises(
        UserError, match=re.escape(f"{path} is not a UTF-8 text file (line {line})")
    ):
        infer_inputs.from_files(str(path), None)


def test_input_lines_keep_their_numbers_across_blank_lines_and_crlf(tmp_path):
    path = tmp_path / "inputs.txt"
    path.write_bytes("a?\r\n\r\nb c?\nÇa va?\rlast".encode())
    assert list(infer_inputs.read_lines(str(path))) == [
        ("a?", f"line 1 of {path}"),
        ("b c?", f"line 3 of {path}"),
        ("Ça va?", f"line 4 of {path}"),
        ("last", f"line 5 of {path}"),
    ]


def test_input_files_by_pattern_and_list_are_read_in_order(tmp_path):
    for name, text in (("b.txt", "b1\nb2\n"), ("a.txt", "a1\n"), ("c.tsv", "c1\n")):
        (tmp_path / name).write_text(text)
    source = infer_inputs.from_files(f"{tmp_path}/*.txt,{tmp_path / 'c.tsv'}", None)
    assert (source.name, source.total) == ("a-and-2-more", 4)
    assert list(infer_inputs.Texts(source)) == ["a1", "b1", "b2", "c1"]
    assert list(infer_inputs.Texts(source)) == ["a1", "b1", "b2", "c1"]  # read afresh
    assert infer_inputs.from_files(f"{tmp_path}/*.txt", 2).total == 2
    with pytest.raises(UserError, match=re.escape(f"pattern {tmp_path}/*.md matches no file")):
        infer_inputs.from_files(f"{tmp_path}/*.md", None)
    with pytest.raises(UserError, match="input file not found: .*missing.txt"):
        infer_inputs.from_files(f"{tmp_path}/a.txt,{tmp_path}/missing.txt", None)


def test_the_fingerprint_follows_the_inputs_and_their_count(tmp_path):
    path = tmp_path / "in.txt"
    path.write_text("one\ntwo\n")
    first = infer_inputs.from_files(str(path), None).fingerprint
    assert infer_inputs.from_files(str(path), None).fingerprint == first
    assert infer_inputs.from_files(str(path), 1).fingerprint != first
    path.write_text("one\ntwo!\n")
    assert infer_inputs.from_files(str(path), None).fingerprint != first


def _char_inputs(input_length: int, shaping: InputShaping | None = None, exact: bool = False):
    """infer's texts -> model inputs, with one id per character."""
    shaping = shaping or InputShaping()
    return infer_runner._Inputs(_CharVocabulary(), input_length, 4, shaping, exact=exact)


def test_inputs_longer_than_the_input_length_are_truncated_and_marked():
    texts = [infer_inputs.Record("x" * n, f"INFER_INPUTS[{i}]") for i, n in enumerate((7, 8, 3))]
    examples = [_char_inputs(8).example(r) for r in texts]
    assert [len(ex.ids) for ex in examples] == [8, 8, 4]  # 7 + EOS fits in 8; 8 + EOS does not
    assert all(ex.ids[-1] == 1 for ex in examples)
    assert [ex.overlong for ex in examples] == [False, True, False]


def test_inputs_are_shaped_before_they_are_cut_unless_exact():
    """The run's prefix counts against the input length, as it did in training."""
    prefix = InputShaping(run_record.PREFIX, prefix="ab: ")
    record = infer_inputs.Record("xxxx", "INFER_INPUTS[0]")
    shaped = _char_inputs(8, prefix).example(record)
    assert (shaped.model_input, len(shaped.ids), shaped.overlong) == ("ab: xxxx", 8, True)
    exact = _char_inputs(8, prefix, exact=True).example(record)
    assert (exact.model_input, len(exact.ids), exact.overlong) == ("xxxx", 5, False)
    assert not _char_inputs(8, prefix, exact=True).shown and _char_inputs(8, prefix).shown


def test_truncation_error_names_the_first_overlong_input_before_any_work():
    source = infer_inputs.from_texts(["x" * 3, "x" * 20, "x" * 9], None)
    with pytest.raises(UserError, match=re.escape("2 of 3 inputs are longer than 8 tokens")):
        infer_runner._refuse_overlong("error", source, _char_inputs(8))
    with pytest.raises(UserError, match=re.escape("the first on INFER_INPUTS[1]")):
        infer_runner._refuse_overlong("error", source, _char_inputs(8))
    infer_runner._refuse_overlong("error", infer_inputs.from_texts(["x"], None), _char_inputs(8))
    infer_runner._refuse_overlong("warn", source, _char_inputs(8))  # truncated when decoded


def test_infer_truncation_takes_warn_or_error():
    chunks = infer_chunks.Assignment(chunk_size=8)
    model = _SmallModel()
    infer_runner._check_settings(DecodingSettings(), model, None, "warn", chunks, False)
    with pytest.raises(UserError, match="INFER_TRUNCATION = 'cut' must be 'warn'"):
        infer_runner._check_settings(DecodingSettings(), model, None, "cut", chunks, False)
    with pytest.raises(UserError, match="INFER_EXACT_INPUTS = 1 must be True or False"):
        infer_runner._check_settings(DecodingSettings(), model, None, "warn", chunks, 1)


def without_predictions(rows):
    return [{key: value for key, value in row.items() if key != "prediction"} for row in rows]


@pytest.mark.slow
def test_infer_num_examples_decodes_the_first_examples_of_the_split(model_dir, tmp_path):
    """...into a file of its own: a partial run never replaces the full predictions."""
    name = f"qp_is_duplicate_validation-{STEPS}"
    out = tmp_path / "inference"
    run = infer(model_dir, f"--gin.INFER_OUTPUT_DIR='{tmp_path}'")
    assert run.returncode == 0, run.stderr[-3000:]
    every = read_rows(out / f"{name}.jsonl")
    assert len(every) == VALIDATION_PAIRS

    run = infer(model_dir, "--gin.INFER_NUM_EXAMPLES=7", f"--gin.INFER_OUTPUT_DIR='{tmp_path}'")
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"wrote 7 predictions to {out / name}-first7.jsonl" in run.stdout
    first = read_rows(out / f"{name}-first7.jsonl")
    assert without_predictions(first) == without_predictions(every[:7])
    assert read_rows(out / f"{name}.jsonl") == every
    assert "infer.num_examples = %INFER_NUM_EXAMPLES" in (tmp_path / "infer_config.gin").read_text()


def test_a_prediction_file_of_other_inputs_is_never_replaced(tmp_path):
    """Another input file of the same name (or other INFER_INPUTS) gets <name>.2.jsonl; the
    same inputs again rewrite their own file."""
    first, other = tmp_path / "questions-5.jsonl", tmp_path / "questions-5.2.jsonl"
    first.write_text('{"input": "a?", "prediction": "no"}\n{"input": "b?", "prediction": "no"}\n')
    assert own_file(str(first), ["a?", "b?"]) == str(first)
    assert own_file(str(first), ["a?", "c?"]) == str(other)
    assert own_file(str(first), ["a?"]) == str(other)
    other.write_text('{"input": "a?", "prediction": "yes"}\n')
    assert own_file(str(first), ["a?"]) == str(other)
    assert own_file(str(first), ["c?"]) == str(tmp_path / "questions-5.3.jsonl")
    (tmp_path / "notes.jsonl").write_text("my own notes, not predictions\n")
    assert own_file(str(tmp_path / "notes.jsonl"), ["a?"]) == str(tmp_path / "notes.2.jsonl")


@pytest.mark.slow
def test_same_named_input_files_keep_their_own_predictions(model_dir, tmp_path):
    out = tmp_path / "out" / "inference"
    for folder, lines in (("a", "Is it raining?\n"), ("b", "How do I learn jax?\nWhy?\n")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "questions.txt").write_text(lines)
    runs = [
        infer(
            model_dir,
            f"--gin.INFER_INPUT_FILE='{tmp_path / folder / 'questions.txt'}'",
            f"--gin.INFER_OUTPUT_DIR='{tmp_path / 'out'}'",
        )
        for folder in ("a", "b", "a")
    ]
    assert [run.returncode for run in runs] == [0, 0, 0], runs[-1].stderr[-3000:]
    inputs = {name: [row["input"] for row in read_rows(out / name)] for name in files_in(out)}
    assert inputs == {
        f"questions-{STEPS}.jsonl": ["Is it raining?"],
        f"questions-{STEPS}.2.jsonl": ["How do I learn jax?", "Why?"],
    }
    assert f"wrote 1 predictions to {out}/questions-{STEPS}.jsonl" in runs[2].stdout


@pytest.mark.parametrize(
    "num_examples, settings, name",
    [
        (None, (0.0, 0, 1, 0.6, 0), "src-5.jsonl"),
        (None, (0.0, 40, 1, 0.6, 0), "src-5.jsonl"),  # greedy: TOP_K changes nothing
        (10, (0.0, 0, 1, 0.6, 0), "src-5-first10.jsonl"),
        (None, (0.0, 0, 4, 0.6, 0), "src-5-beam4-alpha0.6.jsonl"),
        (None, (0.7, 0, 1, 0.6, 3), "src-5-temp0.7-seed3.jsonl"),
        (2, (1.0, 40, 1, 0.6, 0), "src-5-first2-temp1-top40-seed0.jsonl"),
        (None, (0.9, 0, 1, 0.6, 1, 0.95), "src-5-temp0.9-topp0.95-seed1.jsonl"),
    ],
)
def test_prediction_files_are_named_by_the_settings_that_change_them(num_examples, settings, name):
    assert file_name("src", 5, num_examples, DecodingSettings(*settings)) == name


@pytest.mark.slow
def test_num_beams_macro_reaches_infer_and_eval(model_dir, tmp_path):
    run = infer(model_dir, "--gin.NUM_BEAMS=2", "--gin.INFER_NUM_EXAMPLES=3")
    assert run.returncode == 0, run.stderr[-3000:]
    path = (
        model_dir / "inference" / f"qp_is_duplicate_validation-{STEPS}-first3-beam2-alpha0.6.jsonl"
    )
    assert f"wrote 3 predictions to {path}" in run.stdout
    config = (model_dir / "infer_config.gin").read_text()
    assert "infer.num_beams = %NUM_BEAMS" in config and "NUM_BEAMS = 2" in config

    run = t5tpu(
        "eval",
        f"--gin_file={EXPERIMENT}",
        f"--gin.MODEL_DIR='{model_dir}'",
        "--gin.NUM_BEAMS=2",
        "--gin.EVAL_NUM_EXAMPLES=8",
    )
    assert run.returncode == 0, run.stderr[-3000:]
    config = (model_dir / "eval_config.gin").read_text()
    assert "evaluate.num_beams = %NUM_BEAMS" in config and "NUM_BEAMS = 2" in config
