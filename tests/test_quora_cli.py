"""The Quora workloads through the command line: the original recipe's flow (train on the qp_all
mixture, evaluate one of its tasks), and prepare-quora -> train -> eval -> infer on
generate_similar_question over the prepared Kaggle rows. A few steps each: these check that
every stage runs and writes its files, not what the model learns."""

import json
import os

import pytest
from cli_runs import SHARED_DATA, quick_training, read_json, t5tpu

# Each test trains, evaluates and decodes through the command line.
pytestmark = pytest.mark.slow

KAGGLE_CSV = os.path.join(SHARED_DATA, "quora", "kaggle_train_head999.csv")
QP_ALL = "configs/experiments/qp_all_tiny_cpu.gin"
SIMILAR = "configs/experiments/generate_similar_question_tiny_cpu.gin"
STEPS = 4
# Small batches and few steps keep each command to its start-up and compile time.
QUICK = quick_training(STEPS)


def test_train_on_the_mixture_then_evaluate_one_task(tmp_path):
    model_dir = f"--gin.MODEL_DIR='{tmp_path}'"
    run = t5tpu("train", f"--gin_file={QP_ALL}", model_dir, *QUICK)
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"step {STEPS}/{STEPS}" in run.stdout
    config = (tmp_path / "config.gin").read_text()
    assert "MIXTURE_OR_TASK_NAME = 'qp_all'" in config
    assert "qp_all_rates.generate_similar_question = 1.0" in config

    run = t5tpu(
        "eval",
        f"--gin_file={QP_ALL}",
        model_dir,
        "--gin.MIXTURE_OR_TASK_NAME='qp_is_duplicate'",
        "--gin.EVAL_NUM_EXAMPLES=32",
    )
    assert run.returncode == 0, run.stderr[-3000:]
    metrics = read_json(tmp_path / "eval_metrics.json")
    assert list(metrics) == [str(STEPS)]
    assert list(metrics[str(STEPS)]) == ["qp_is_duplicate"]
    values = metrics[str(STEPS)]["qp_is_duplicate"]
    assert sorted(values) == ["accuracy", "f1_duplicate", "num_examples"]
    assert values["num_examples"] == 32
    assert 0.0 <= values["accuracy"] <= 100.0 and 0.0 <= values["f1_duplicate"] <= 100.0

    # The mixture's other task at the same step joins the record instead of replacing it.
    run = t5tpu(
        "eval",
        f"--gin_file={QP_ALL}",
        model_dir,
        "--gin.MIXTURE_OR_TASK_NAME='generate_similar_question'",
        "--gin.EVAL_NUM_EXAMPLES=8",
    )
    assert run.returncode == 0, run.stderr[-3000:]
    metrics = read_json(tmp_path / "eval_metrics.json")[str(STEPS)]
    assert sorted(metrics) == ["generate_similar_question", "qp_is_duplicate"]
    assert metrics["qp_is_duplicate"] == values
    assert metrics["generate_similar_question"]["num_examples"] == 8


def test_prepare_then_train_eval_infer_similar_questions(tmp_path):
    data_dir = tmp_path / "quora"
    run = t5tpu("prepare-quora", f"--input={KAGGLE_CSV}", f"--output_dir={data_dir}")
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.splitlines()[1:5] == [
        f"train: 895 pairs, 344 duplicates -> {data_dir}/train.tfrecord",
        f"validation: 104 pairs, 36 duplicates -> {data_dir}/validation.tfrecord",
        "duplicates: 38.0% of 999 pairs",
        "rejected: 0 rows",
    ]
    # A second run refuses in one line (exit 2) and leaves the first one's output alone.
    stats = (data_dir / "stats.json").read_bytes()
    run = t5tpu("prepare-quora", f"--input={KAGGLE_CSV}", f"--output_dir={data_dir}")
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        f"t5tpu: error: {data_dir} already holds train.tfrecord, validation.tfrecord, "
        "stats.json; pass --overwrite to replace them or choose another --output_dir"
    ]
    assert (data_dir / "stats.json").read_bytes() == stats
    # A missing flag too: one line, not argparse's usage block.
    run = t5tpu("prepare-quora", f"--input={KAGGLE_CSV}")
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        "t5tpu: error: the following arguments are required: --output_dir; "
        "see t5tpu prepare-quora --help"
    ]

    model_dir = tmp_path / "model"
    flags = [
        f"--gin_file={SIMILAR}",
        f"--gin.MODEL_DIR='{model_dir}'",
        f"--gin.QUORA_DATA_DIR='{data_dir}'",
    ]
    run = t5tpu("train", *flags, *QUICK)
    assert run.returncode == 0, run.stderr[-3000:]
    config = (model_dir / "config.gin").read_text()
    assert "quora_data_dir.path = %QUORA_DATA_DIR" in config and f"'{data_dir}'" in config

    run = t5tpu("eval", *flags)
    assert run.returncode == 0, run.stderr[-3000:]
    metrics = read_json(model_dir / "eval_metrics.json")[str(STEPS)]
    assert list(metrics) == ["generate_similar_question"]
    assert sorted(metrics["generate_similar_question"]) == ["bleu", "exact_match", "num_examples"]

    run = t5tpu("infer", *flags)
    assert run.returncode == 0, run.stderr[-3000:]
    path = model_dir / "inference" / f"generate_similar_question_validation-{STEPS}.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 36  # the duplicates among the 104 prepared validation pairs
    assert all(sorted(row) == ["input", "prediction", "target"] for row in rows)
    assert rows[0]["input"] == (
        "generate similar question: how do i read and find my youtube comments?"
    )
    assert rows[0]["target"] == "how can i see all my youtube comments?"
