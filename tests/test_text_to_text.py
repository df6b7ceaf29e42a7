"""The generic text-to-text task: the user's TSV/JSONL files trained, evaluated and decoded from a
gin file alone; malformed rows counted and reported, never dropped silently; files on gs://."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import gcs_emulator
import pytest
from cli_runs import ROOT, file_digests, t5tpu

from t5tpu.data import text_files
from t5tpu.errors import UserError

EXPERIMENT = "configs/experiments/text_to_text_tiny_cpu.gin"
EXAMPLES = os.path.join(ROOT, "examples", "text_to_text")
TRAIN_ROWS, VALIDATION_ROWS = 400, 48
# Copying the first of 4-7 words drawn from 30: chance is ~3%; 200 steps reach 37.5%.
MIN_EXACT_MATCH = 25.0


def _write(path, text: str) -> str:
    path.write_text(text)
    return str(path)


def test_bundled_files_read_in_both_formats():
    tsv = text_files.read_rows([os.path.join(EXAMPLES, "train.tsv")])
    jsonl = text_files.read_rows([os.path.join(EXAMPLES, "validation.jsonl")])
    assert (len(tsv.inputs), len(jsonl.inputs)) == (TRAIN_ROWS, VALIDATION_ROWS)
    assert tsv.malformed == jsonl.malformed == 0
    # The header line is not an example; every target is the first word of its input.
    assert "input" not in tsv.inputs
    assert all(i.split()[0] == t for i, t in zip(tsv.inputs, tsv.targets, strict=True))


def test_malformed_rows_are_counted_and_the_first_named(tmp_path):
    tsv = _write(tmp_path / "a.tsv", "x\ty\nno tab here\nx\ty\tz\n \tz\ny2\tz2\n")
    jsonl = _write(tmp_path / "b.jsonl", '{"input": "p", "target": "q"}\n{"input": "p"}\n[1]\n{\n')
    rows = text_files.read_rows([tsv, jsonl])
    assert rows.inputs == ["x", "y2", "p"] and rows.targets == ["y", "z2", "q"]
    assert rows.malformed == 6
    assert rows.first_problem == f"line 2 of {tsv}: 1 columns, expected input<TAB>target"
    named = text_files.read_rows([jsonl], input_field="src", target_field="tgt")
    assert named.malformed == 4 and named.first_problem.endswith("no field 'src'")


def test_binary_unknown_and_missing_files_are_refused(tmp_path):
    binary = tmp_path / "bin.tsv"
    binary.write_bytes(b"ok\tfine\n\xff\xfe\x00garbage")
    with pytest.raises(UserError, match=r"bin.tsv is not a UTF-8 text file \(line 2\)"):
        text_files.read_rows([str(binary)])
    with pytest.raises(UserError, match="unknown format"):
        text_files.read_rows([_write(tmp_path / "data.csv", "a,b\n")])
    with pytest.raises(UserError, match="TRAIN_FILES: no file matches [^ ]*train-\\*\\.tsv; give"):
        text_files.matching_files(str(tmp_path / "train-*.tsv"), "TRAIN_FILES")


def test_a_missing_relative_file_is_reported_with_the_directory_it_was_looked_in(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    expected = f"no file matches examples/t.tsv \\(relative to the current directory, {tmp_path}\\)"
    with pytest.raises(UserError, match=expected):
        text_files.matching_files("examples/t.tsv", "TRAIN_FILES")


def test_patterns_and_comma_lists_expand_in_order(tmp_path):
    for name in ("train-1.tsv", "train-0.tsv", "other.tsv"):
        _write(tmp_path / name, "a\tb\n")
    found = text_files.matching_files(f"{tmp_path}/train-*.tsv, {tmp_path}/other.tsv", "X")
    assert [os.path.basename(f) for f in found] == ["train-0.tsv", "train-1.tsv", "other.tsv"]


_READ_ON_GS = """
import json, sys
from t5tpu.data import text_files
found = text_files.matching_files(sys.argv[1], "TRAIN_FILES")
rows = text_files.read_rows(found)
print(json.dumps([found, rows.inputs, rows.targets]))
"""


def test_files_on_gs_are_read_through_the_emulator():
    # In a process of its own: epath picks its gs:// client (gcsfs here) when first imported.
    with gcs_emulator.running_emulator() as endpoint:
        bucket = gcs_emulator.BUCKET
        gcs_emulator.upload(endpoint, "data/train-0.tsv", b"a b\ta\n")
        gcs_emulator.upload(endpoint, "data/train-1.jsonl", b'{"input": "c d", "target": "c"}\n')
        run = subprocess.run(
            [sys.executable, "-c", _READ_ON_GS, f"gs://{bucket}/data/train-*"],
            env={**os.environ, **gcs_emulator.client_environment(endpoint)},
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert run.returncode == 0, run.stderr[-3000:]
    found, inputs, targets = json.loads(run.stdout.splitlines()[-1])
    assert found == [f"gs://{bucket}/data/train-0.tsv", f"gs://{bucket}/data/train-1.jsonl"]
    assert (inputs, targets) == (["a b", "c d"], ["a", "c"])


@pytest.fixture(scope="module")
def trained(trained_text_to_text):
    """The experiment's run (conftest's trained_text_to_text, shared: read only) and its
    training's output."""
    model_dir, stdout = trained_text_to_text
    return model_dir, subprocess.CompletedProcess(["t5tpu", "train"], 0, stdout, "")


@pytest.mark.slow
def test_trains_and_evaluates_from_the_gin_file_alone(trained):
    model_dir, run = trained
    losses = [float(line.split()[3]) for line in run.stdout.splitlines() if "loss" in line]
    assert losses[-1] < 0.5 * losses[0]
    metrics = json.loads((model_dir / "eval_metrics.json").read_text())["200"]["text_to_text"]
    assert metrics["exact_match"] >= MIN_EXACT_MATCH
    assert metrics["num_examples"] == VALIDATION_ROWS
    assert {"f1", "bleu", "rouge1", "rouge2", "rougeLsum"} <= set(metrics)
    assert metrics["f1"] == pytest.approx(metrics["exact_match"])  # one-word targets
    assert metrics["rouge1"] == pytest.approx(metrics["exact_match"])


@pytest.mark.slow
def test_infer_decodes_the_validation_split_with_the_prefix(trained, tmp_path):
    model_dir, _ = trained
    run = t5tpu(
        "infer",
        f"--gin_file={EXPERIMENT}",
        "--gin.INFER_NUM_EXAMPLES=4",
        f"--gin.INFER_OUTPUT_DIR='{tmp_path}'",  # the shared MODEL_DIR is only read
        model_dir=model_dir,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    written = tmp_path / "inference" / "text_to_text_validation-200-first4.jsonl"
    rows = [json.loads(line) for line in written.read_text().splitlines()]
    assert len(rows) == 4
    assert all(row["input"].startswith("first word: ") for row in rows)
    assert all(row["target"] == row["input"].split()[2] for row in rows)


def test_a_malformed_train_file_stops_before_any_work(tmp_path):
    bad = _write(tmp_path / "train.tsv", "a b\ta\nc d\tc\tX\n")
    model_dir = tmp_path / "run"
    run = t5tpu(
        "train", f"--gin_file={EXPERIMENT}", f"--gin.TRAIN_FILES='{bad}'", model_dir=model_dir
    )
    assert run.returncode == 2
    assert run.stderr.strip() == (
        f"t5tpu: error: TRAIN_FILES: 1 of 2 rows malformed, first line 2 of {bad}: 3 columns, "
        "expected input<TAB>target; fix them, or set text_to_text.skip_malformed = True to leave "
        "them out"
    )
    assert not model_dir.exists() or file_digests(model_dir) == {}


@pytest.mark.slow
def test_skip_malformed_leaves_them_out_with_one_warning(tmp_path):
    rows = pathlib.Path(EXAMPLES, "train.tsv").read_text() + "broken row\n"
    bad = _write(tmp_path / "train.tsv", rows)
    run = t5tpu(
        "train",
        f"--gin_file={EXPERIMENT}",
        f"--gin.TRAIN_FILES='{bad}'",
        "--gin.text_to_text.skip_malformed=True",
        "--gin.TRAIN_STEPS=2",
        "--gin.EVAL_PERIOD=0",
        model_dir=tmp_path / "run",
    )
    assert run.returncode == 0, run.stderr[-3000:]
    warnings = [line for line in run.stderr.splitlines() if line.startswith("t5tpu: warning")]
    assert warnings == [
        f"t5tpu: warning: TRAIN_FILES: left out 1 of {TRAIN_ROWS + 1} rows (first line "
        f"{TRAIN_ROWS + 2} of {bad}: 1 columns, expected input<TAB>target)"
    ]


def test_registering_again_reads_unchanged_files_once(tmp_path, monkeypatch, capsys):
    """A process registers its tasks more than once (infer, the Python API's helpers): unchanged
    files are read, and their malformed rows reported, once; a changed file is read again."""
    from t5tpu import tasks
    from t5tpu.config import gin_setup
    from t5tpu.runtime.lazy_imports import seqio

    train = _write(tmp_path / "train.tsv", "a b\ta\nbroken row\n")
    validation = _write(tmp_path / "validation.jsonl", '{"input": "c d", "target": "c"}\n')
    gin_setup.parse(
        [EXPERIMENT],
        [
            f"TRAIN_FILES = '{train}'",
            f"VALIDATION_FILES = '{validation}'",
            "text_to_text.skip_malformed = True",
        ],
        [],
    )
    reads = []
    read_rows = text_files.read_rows
    monkeypatch.setattr(
        text_files, "read_rows", lambda paths, *a: reads.append(paths) or read_rows(paths, *a)
    )
    for _ in range(3):
        tasks.register_builtin_tasks()
    assert reads == [[train], [validation]]
    warnings = capsys.readouterr().err.splitlines()
    assert warnings == [
        f"t5tpu: warning: TRAIN_FILES: left out 1 of 2 rows (first line 2 of {train}: 1 "
        "columns, expected input<TAB>target)"
    ]
    _write(tmp_path / "train.tsv", "a b\ta\ne f\te\n")  # edited: now two good rows
    tasks.register_builtin_tasks()
    assert reads == [[train], [validation], [train]]
    assert seqio.get_mixture_or_task("text_to_text").num_input_examples("train") == 2


def test_training_inputs_are_what_every_front_end_makes_of_a_raw_input():
    """The task's inputs are text_to_text.model_input of each row (INPUT_PREFIX before it): the
    function tasks/shaping.py calls on a raw input at every front end, from the run record."""
    from t5tpu.tasks import shaping

    from t5tpu import tasks
    from t5tpu.config import gin_setup
    from t5tpu.runtime.lazy_imports import seqio

    gin_setup.parse([EXPERIMENT], [], [])
    tasks.register_builtin_tasks()
    recorded = shaping.for_task("text_to_text")
    assert recorded.prefix == "first word: "
    rows = text_files.read_rows([os.path.join(EXAMPLES, "train.tsv")], "input", "target")
    task = seqio.get_mixture_or_task("text_to_text")
    lengths = {"inputs": 64, "targets": 8}
    made = task.get_dataset(lengths, split="train", shuffle=False).as_numpy_iterator()
    assert [ex["inputs_pretokenized"].decode() for ex in made] == [
        shaping.shape(recorded, text) for text in rows.inputs
    ]


def test_an_unknown_metric_is_one_line(tmp_path):
    run = t5tpu(
        "train", f"--gin_file={EXPERIMENT}", "--gin.TEXT_METRICS=['meteor']", model_dir=tmp_path
    )
    assert run.returncode == 2
    assert "TEXT_METRICS: unknown metric 'meteor'; choose from" in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1
