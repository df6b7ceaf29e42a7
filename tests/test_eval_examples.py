"""`t5tpu eval` writes each example it evaluated (runners/eval_examples.py): input, target and
the prediction the metric saw, one JSON line each, in eval_examples/<task>-<step>.jsonl beside
eval_metrics.json; a rerun of a step rewrites that file whole."""

from __future__ import annotations

import pytest
import tensorflow as tf
from cli_runs import TINY_EXPERIMENT, TRAINED_TINY_STEPS, read_json, read_jsonl, succeeded, t5tpu
from test_writer_faults import FAULT_CASES, Writer

from t5tpu.runners.eval_examples import ExamplesLogger
from t5tpu.storage import model_dir as paths

TASK = "qp_is_duplicate"


@pytest.mark.slow  # needs the trained_tiny run
def test_eval_writes_every_example_and_a_rerun_rewrites_the_file(trained_tiny, tmp_path):
    out = tmp_path / "out"
    eval_args = [
        "eval",
        f"--gin_file={TINY_EXPERIMENT}",
        f"--gin.MODEL_DIR='{trained_tiny}'",  # only read: results go to EVAL_OUTPUT_DIR
        f"--gin.EVAL_OUTPUT_DIR='{out}'",
    ]
    succeeded(t5tpu(*eval_args))
    step = TRAINED_TINY_STEPS
    metrics = read_json(out / "eval_metrics.json")[str(step)][TASK]
    path = out / "eval_examples" / f"{TASK}-{step}.jsonl"
    assert str(path) == paths.eval_examples(str(out), "validation", TASK, step)
    rows = read_jsonl(path)
    assert len(rows) == metrics["num_examples"]
    assert all(set(row) == {"input", "target", "prediction"} for row in rows), rows[0]
    assert all(row["input"].startswith("is duplicate:") for row in rows), rows[0]
    correct = sum(row["prediction"] == row["target"] for row in rows)
    assert 100.0 * correct / len(rows) == pytest.approx(metrics["accuracy"])

    other_step = path.with_name(f"{TASK}-1.jsonl")
    other_step.write_text('{"input": "an earlier step"}\n')
    before = path.read_bytes()
    succeeded(t5tpu(*eval_args))  # the same step again
    assert sorted(p.name for p in path.parent.iterdir()) == [other_step.name, path.name]
    assert path.read_bytes() == before  # rewritten whole: the same examples, nothing appended
    assert other_step.read_text() == '{"input": "an earlier step"}\n'


def _dataset(inputs: list[str], targets: list[str]) -> tf.data.Dataset:
    return tf.data.Dataset.from_tensor_slices(
        {"inputs_pretokenized": inputs, "targets_pretokenized": targets}
    )


def test_the_logger_writes_scores_references_and_replaces_a_steps_file(tmp_path):
    logger = ExamplesLogger(str(tmp_path), split="test")
    logger(
        task_name="squad_like",
        step=7,
        metrics={},
        dataset=_dataset(["question: who? context: Ann", "q2"], ["Ann", "é"]),
        inferences={"prediction": ["Ann", "b"], "score": [-0.5, -2.0], "output": ["x", "y"]},
        targets=[["Ann", "ann"], "é"],  # a list of gold answers, then the target text itself
    )
    (written,) = logger.write(setting="EVAL_OUTPUT_DIR")
    assert written == str(tmp_path / "eval_test_examples" / "squad_like-7.jsonl")
    assert read_jsonl(written) == [
        {
            "input": "question: who? context: Ann",
            "target": "Ann",
            "prediction": "Ann",
            "score": -0.5,
            "references": ["Ann", "ann"],
        },
        {"input": "q2", "target": "é", "prediction": "b", "score": -2.0},
    ]
    logger(
        task_name="squad_like",
        step=7,
        metrics={},
        dataset=_dataset(["only one"], ["t"]),
        inferences={"prediction": ["t"]},
        targets=["t"],
    )
    assert logger.write(setting="EVAL_OUTPUT_DIR") == [written]
    assert read_jsonl(written) == [{"input": "only one", "target": "t", "prediction": "t"}]
    assert logger.write(setting="EVAL_OUTPUT_DIR") == []  # nothing new since


def _write_examples(folder, version, root):
    """A step's examples (step = `version`), as TaskEvaluator writes them after the metrics."""
    logger = ExamplesLogger(str(folder), split="validation")
    count = 200
    logger(
        task_name="task",
        step=version,
        metrics={},
        dataset=_dataset([f"input {i} " * 20 for i in range(count)], ["1"] * count),
        inferences={"prediction": [f"v{version}"] * count},
        targets=["1"] * count,
    )
    logger.write(setting="EVAL_OUTPUT_DIR")


# storage/atomic_files.py's faults, as tests/test_writer_faults.py checks every other writer's.
EXAMPLES_WRITER = Writer(_write_examples, "eval_examples/task-2.jsonl", "folder", "EVAL_OUTPUT_DIR")


@pytest.mark.parametrize("fault", list(FAULT_CASES))
def test_an_examples_write_fault_is_one_line_and_loses_nothing(fault, tmp_path):
    FAULT_CASES[fault](EXAMPLES_WRITER, tmp_path, str(tmp_path))
