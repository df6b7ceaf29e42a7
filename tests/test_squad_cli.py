"""squad_v1 and squad_v2 through the command line: train -> eval -> infer on the official JSON
files, and a tiny T5 that memorizes SQuAD v1.1 dev questions, which proves tokenization, targets,
decoding, postprocessing and the metric together."""

import json
import os

import cli_runs
import pytest
from cli_runs import SHARED_DATA, quick_training, read_json, succeeded

# Each test trains through the command line.
pytestmark = pytest.mark.slow

SQUAD_DIR = os.path.join(SHARED_DATA, "squad")
V1_FILE = os.path.join(SQUAD_DIR, "dev-v1.1.json")
V2_FILE = os.path.join(SQUAD_DIR, "dev-v2.0-cs224n-part-a.json")

# The memorization set: every question of the dev-v1.1 paragraphs shorter than 200 characters
# (26 paragraphs, 136 questions; inputs fit 160 pieces of the bundled vocabulary).
SHORT_CONTEXT_CHARS = 200
MEMORIZE_STEPS = 150
# Measured at 150 steps: exact match 91.2 (124 of 136), F1 92.7; asserted with some margin.
EM_THRESHOLD = 80.0


def t5tpu(*args, model_dir):
    """Every t5tpu run here must succeed."""
    return succeeded(cli_runs.t5tpu(*args, model_dir=model_dir))


def short_context_questions(path):
    """The dev set cut to its short-context paragraphs, in the official format."""
    articles = []
    for article in read_json(path)["data"]:
        kept = [p for p in article["paragraphs"] if len(p["context"]) < SHORT_CONTEXT_CHARS]
        if kept:
            articles.append({"title": article["title"], "paragraphs": kept})
    return {"version": "1.1", "data": articles}


def infer_flag(question, context):
    """--gin.INFER_INPUTS for one question: a list holding one model input (a Python literal)."""
    text = f"question: {question} context: {context}"
    return f"--gin.INFER_INPUTS=[{json.dumps(text)}]"


def test_tiny_t5_memorizes_136_squad_questions_through_the_cli(tmp_path):
    subset = short_context_questions(V1_FILE)
    questions = [
        (qa, p["context"]) for a in subset["data"] for p in a["paragraphs"] for qa in p["qas"]
    ]
    assert len(questions) == 136
    squad_file = tmp_path / "short_contexts.json"
    squad_file.write_text(json.dumps(subset), encoding="utf-8")
    model_dir = tmp_path / "model"
    flags = [
        "--gin_file=configs/experiments/squad_v1_tiny_cpu.gin",
        f"--gin.SQUAD_V1_TRAIN_FILE='{squad_file}'",
        f"--gin.SQUAD_V1_VALIDATION_FILE='{squad_file}'",
        "--gin.TASK_FEATURE_LENGTHS={'inputs': 160, 'targets': 32}",
        "--gin.EVAL_NUM_EXAMPLES=None",
    ]
    t5tpu(
        "train",
        *flags,
        f"--gin.TRAIN_STEPS={MEMORIZE_STEPS}",
        "--gin.BATCH_SIZE=32",
        "--gin.LEARNING_RATE=0.01",
        "--gin.DROPOUT_RATE=0.0",
        f"--gin.SAVE_PERIOD={MEMORIZE_STEPS}",
        # Training evaluates its last checkpoint (the official EM/F1 on the 136 questions), as
        # `t5tpu eval` would: one process less. The v2 test below runs `t5tpu eval` itself.
        f"--gin.EVAL_PERIOD={MEMORIZE_STEPS}",
        model_dir=model_dir,
    )

    metrics = read_json(model_dir / "eval_metrics.json")[str(MEMORIZE_STEPS)]["squad_v1"]
    assert metrics["exact_match"] >= EM_THRESHOLD
    assert metrics["f1"] >= metrics["exact_match"]

    # One memorized question asked from the shell, as `t5tpu infer --gin.INFER_INPUTS=[...]`.
    qa, context = questions[0]
    t5tpu("infer", *flags, infer_flag(qa["question"], context), model_dir=model_dir)
    path = model_dir / "inference" / f"inputs-{MEMORIZE_STEPS}.jsonl"
    (row,) = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert row["input"] == f"question: {qa['question']} context: {context}"
    assert row["prediction"] in {answer["text"] for answer in qa["answers"]}


@pytest.fixture(scope="module")
def v2_model_dir(tmp_path_factory):
    """A few steps on the SQuAD v2.0 dev file (part A) as both train and validation."""
    model_dir = tmp_path_factory.mktemp("squad_v2")
    flags = v2_flags()
    t5tpu("train", *flags, *quick_training(4), "--gin.EVAL_PERIOD=0", model_dir=model_dir)
    return model_dir


def v2_flags():
    return [
        "--gin_file=configs/experiments/squad_v2_tiny_cpu.gin",
        f"--gin.SQUAD_V2_TRAIN_FILE='{V2_FILE}'",
        f"--gin.SQUAD_V2_VALIDATION_FILE='{V2_FILE}'",
        "--gin.TASK_FEATURE_LENGTHS={'inputs': 128, 'targets': 8}",
        "--gin.EVAL_NUM_EXAMPLES=16",
        "--gin.EVAL_BATCH_SIZE=16",
    ]


def test_v2_train_eval_infer_writes_metrics_with_breakdowns(v2_model_dir):
    assert (v2_model_dir / "checkpoint_4").is_dir()
    t5tpu("eval", *v2_flags(), model_dir=v2_model_dir)
    metrics = read_json(v2_model_dir / "eval_metrics.json")["4"]["squad_v2"]
    # The first 16 questions of the file: 8 answerable, 8 unanswerable.
    assert (metrics["total"], metrics["HasAns_total"], metrics["NoAns_total"]) == (16, 8, 8)
    assert set(metrics) == {
        "exact", "f1", "total",
        "HasAns_exact", "HasAns_f1", "HasAns_total",
        "NoAns_exact", "NoAns_f1", "NoAns_total", "num_examples",
    }  # fmt: skip
    assert metrics["num_examples"] == 16
    assert all(0.0 <= metrics[k] <= 100.0 for k in ("exact", "f1", "HasAns_f1", "NoAns_f1"))

    question = "Who was the Norse leader?"
    context = "The Normans were led by Rollo."
    t5tpu("infer", *v2_flags(), infer_flag(question, context), model_dir=v2_model_dir)
    rows = (v2_model_dir / "inference" / "inputs-4.jsonl").read_text(encoding="utf-8")
    (row,) = [json.loads(line) for line in rows.splitlines()]
    assert row["input"] == f"question: {question} context: {context}"
    assert isinstance(row["prediction"], str)
