"""The t5tpu command line, end to end: train -> eval -> infer through the real runners, and the
contract for bad input (one line on stderr, exit code 2, nothing already written changed)."""

import json
import os
import pathlib
import shutil

import cli_runs
import pytest
from cli_runs import ROOT, file_digests, foreign_log_lines, t5tpu
from cli_runs import TINY_EXPERIMENT as EXPERIMENT

MEMORIZE_TASK = os.path.join(ROOT, "tests", "data", "memorize_task.py")
# Exact match on the 32 pairs, seeds 0 / 1: 87.5 / 78.1 at step 25, 96.9 / 93.8 at 50, 100 from
# step 75 on (2026-11-28).
STEPS = 100


def memorize_flags(*extra):
    return [
        f"--gin_file={EXPERIMENT}",
        f"--gin.MIXTURE_OR_TASK_MODULE='{MEMORIZE_TASK}'",
        "--gin.MIXTURE_OR_TASK_NAME='memorize_similar_questions'",
        "--gin.TASK_FEATURE_LENGTHS={'inputs': 64, 'targets': 48}",
        "--gin.EVAL_SPLIT='train'",
        "--gin.INFER_SPLIT='train'",
        *extra,
    ]


@pytest.fixture(scope="module")
def trained_dir(tmp_path_factory):
    """A tiny T5 trained from scratch on 32 question pairs until it can reproduce them. In a
    fresh interpreter, so that what TensorFlow prints while importing would show."""
    model_dir = str(tmp_path_factory.mktemp("memorize"))
    run = t5tpu(
        "train",
        *memorize_flags(
            f"--gin.TRAIN_STEPS={STEPS}",
            "--gin.BATCH_SIZE=32",
            "--gin.DROPOUT_RATE=0.0",
            "--gin.LEARNING_RATE=0.01",
            f"--gin.SAVE_PERIOD={STEPS // 2}",
            f"--gin.EVAL_PERIOD={STEPS}",
        ),
        model_dir=model_dir,
        fresh=True,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert not foreign_log_lines(run.stderr), run.stderr[-3000:]
    return model_dir, run.stdout


def test_a_command_forked_from_the_zygote_answers_as_a_fresh_interpreter(tmp_path):
    """tests/cli_zygote.py's children stand in for `python -m t5tpu.cli.main` in most tests."""
    args = (
        "train",
        f"--gin_file={EXPERIMENT}",
        "--gin.BATCH_SIZE=0",
        f"--gin.MODEL_DIR='{tmp_path}'",
    )
    forked, fresh = t5tpu(*args), t5tpu(*args, fresh=True)
    assert cli_runs._Zygote._started is not None  # the first run went through it
    assert forked.returncode == fresh.returncode == 2
    assert (forked.stdout, forked.stderr) == (fresh.stdout, fresh.stderr)
    assert fresh.stderr.startswith("t5tpu: error: BATCH_SIZE = 0 must be a whole number")
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
@pytest.mark.smoke
def test_training_reports_progress_and_writes_run_files(trained_dir):
    model_dir, stdout = trained_dir
    progress = [line for line in stdout.splitlines() if line.startswith(f"step {STEPS}/{STEPS}")]
    assert progress and "examples/s" in progress[0] and "ETA" in progress[0]
    assert "lr 0.01 " in progress[0]  # LEARNING_RATE, constant
    final_loss = float(progress[0].split("loss ")[1].split()[0])
    assert final_loss < 0.05  # z-loss keeps it just above 0
    assert {d for d in os.listdir(model_dir) if d.startswith("checkpoint_")} == {
        f"checkpoint_{STEPS // 2}",
        f"checkpoint_{STEPS}",
    }
    config = pathlib.Path(os.path.join(model_dir, "config.gin")).read_text()
    assert f"TRAIN_STEPS = {STEPS}" in config and "T5Config.emb_dim = 128" in config
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(f"{model_dir}/train"))


@pytest.mark.slow
def test_greedy_decoding_reproduces_every_training_target(trained_dir):
    model_dir, _ = trained_dir
    run = t5tpu("eval", *memorize_flags(), model_dir=model_dir)
    assert run.returncode == 0, run.stderr[-3000:]
    assert not foreign_log_lines(run.stderr), run.stderr[-3000:]
    # The memorized pairs are the task's train split, kept apart from validation results.
    metrics = json.loads(pathlib.Path(f"{model_dir}/eval_train_metrics.json").read_text())
    assert metrics[str(STEPS)]["memorize_similar_questions"]["exact_match"] == 100.0
    assert metrics[str(STEPS)]["memorize_similar_questions"]["num_examples"] == 32
    assert not os.path.exists(f"{model_dir}/eval_metrics.json")
    assert any(f.startswith("events.out.tfevents") for f in os.listdir(f"{model_dir}/eval_train"))

    run = t5tpu("infer", *memorize_flags(), model_dir=model_dir)
    assert run.returncode == 0, run.stderr[-3000:]
    assert not foreign_log_lines(run.stderr), run.stderr[-3000:]
    path = os.path.join(model_dir, "inference", f"memorize_similar_questions_train-{STEPS}.jsonl")
    rows = [json.loads(line) for line in pathlib.Path(path).read_text().splitlines()]
    assert len(rows) == 32
    assert all(r["prediction"] == r["target"] for r in rows)
    assert rows[0]["input"].startswith("generate similar question: ")


@pytest.mark.slow
def test_eval_all_checkpoints_and_infer_from_text_file(trained_dir, tmp_path):
    model_dir, _ = trained_dir
    run = t5tpu("eval", *memorize_flags("--gin.CHECKPOINT_STEP='all'"), model_dir=model_dir)
    assert run.returncode == 0, run.stderr[-3000:]
    metrics = json.loads(pathlib.Path(f"{model_dir}/eval_train_metrics.json").read_text())
    assert sorted(metrics, key=int) == [str(STEPS // 2), str(STEPS)]

    questions = tmp_path / "questions.txt"
    questions.write_text("generate similar question: how do i learn python?\n\n" * 1)
    step_as_text = f"--gin.CHECKPOINT_STEP='{STEPS}'"  # a quoted step works like a number
    run = t5tpu(
        "infer",
        *memorize_flags(f"--gin.INFER_INPUT_FILE='{questions}'", step_as_text),
        model_dir=model_dir,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    path = pathlib.Path(f"{model_dir}/inference/questions-{STEPS}.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["input"] for r in rows] == ["generate similar question: how do i learn python?"]
    assert rows[0]["prediction"] and "target" not in rows[0]


@pytest.mark.slow
def test_continuous_eval_follows_checkpoints_as_they_appear(trained_dir, tmp_path):
    """CHECKPOINT_STEP='continuous' evaluates each checkpoint training writes, and stops after
    the one at TRAIN_STEPS; started again, it goes on after the newest evaluated step."""
    model_dir, _ = trained_dir
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    shutil.copytree(f"{model_dir}/checkpoint_{STEPS // 2}", run_dir / f"checkpoint_{STEPS // 2}")
    flags = memorize_flags(
        "--gin.CHECKPOINT_STEP='continuous'", "--gin.evaluate.poll_seconds=0.5"
    ) + [f"--gin.TRAIN_STEPS={STEPS}", f"--gin.MODEL_DIR='{run_dir}'"]
    with open(tmp_path / "stderr", "w") as stderr:
        follower = cli_runs.start("eval", *flags, stderr=stderr)
        seen = []
        for line in follower.stdout:  # the first checkpoint is evaluated; then the next appears
            seen.append(line)
            if line.startswith(f"step {STEPS // 2}: "):
                break
        shutil.copytree(f"{model_dir}/checkpoint_{STEPS}", tmp_path / "writing")
        os.rename(tmp_path / "writing", run_dir / f"checkpoint_{STEPS}")
        seen.extend(follower.stdout)
        assert follower.wait(timeout=600) == 0, (tmp_path / "stderr").read_text()[-3000:]
    metrics = json.loads((run_dir / "eval_train_metrics.json").read_text())
    assert sorted(metrics, key=int) == [str(STEPS // 2), str(STEPS)], "".join(seen)
    assert metrics[str(STEPS)]["memorize_similar_questions"]["exact_match"] == 100.0

    run = t5tpu("eval", *flags, "--gin.evaluate.wait_seconds=0")
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"evaluating each checkpoint after step {STEPS} as it appears" in run.stdout
    assert "no new checkpoint" in run.stdout
    assert json.loads((run_dir / "eval_train_metrics.json").read_text()) == metrics


def test_continuous_eval_skips_a_checkpoint_deleted_before_it_was_read(tmp_path):
    from t5tpu.errors import UserError
    from t5tpu.runners import evaluate

    # Listed, then removed by KEEP_CHECKPOINTS: gone, or half deleted.
    (tmp_path / "checkpoint_5").mkdir()
    for step in (4, 5):
        assert evaluate._restored(str(tmp_path), step, {}, {}, continuous=True) is None
    # Other modes check every step beforehand: one that breaks later is refused in one line.
    with pytest.raises(UserError, match="checkpoint_5 cannot be read"):
        evaluate._restored(str(tmp_path), 5, {}, {}, continuous=False)


@pytest.mark.slow
def test_rerun_of_finished_training_changes_nothing(trained_dir):
    model_dir, _ = trained_dir
    before = _digest(model_dir)
    run = t5tpu("train", *memorize_flags(f"--gin.TRAIN_STEPS={STEPS}"), model_dir=model_dir)
    assert run.returncode == 0 and "nothing to do" in run.stdout
    assert _digest(model_dir) == before


def _digest(model_dir):
    """sha256 of every file under model_dir (but TensorBoard events, appended by design)."""
    return file_digests(model_dir, skip_prefixes=("events.out",))


BAD_INPUTS = {
    "unknown subcommand": (["frobnicate"], "expected one subcommand"),
    "unknown flag": (["train", "--no_such_flag=1"], "no_such_flag"),
    "missing gin file": (["train", "--gin_file=configs/experiments/nope.gin"], "nope.gin"),
    "unknown binding": (["eval", f"--gin_file={EXPERIMENT}", "--gin.evaluate.bogus=1"], "bogus"),
    "missing MODEL_DIR": (["eval", f"--gin_file={EXPERIMENT}"], "MODEL_DIR"),
    "unknown task": (["eval", *memorize_flags("--gin.MIXTURE_OR_TASK_NAME='nope'")], "'nope'"),
    "task left unset": (
        ["eval", *memorize_flags("--gin.MIXTURE_OR_TASK_NAME=None")],
        "MIXTURE_OR_TASK_NAME is not set; set it to one of: ",
    ),
    "missing infer input": (
        ["infer", *memorize_flags("--gin.INFER_INPUT_FILE='/no/such/file.txt'")],
        "/no/such/file.txt",
    ),
    "infer split the task lacks": (
        ["infer", *memorize_flags("--gin.INFER_SPLIT='test'")],
        "task 'memorize_similar_questions' has no 'test' split; set INFER_SPLIT to a split",
    ),
    "eval with zero beams": (
        ["eval", *memorize_flags("--gin.NUM_BEAMS=0")],
        "NUM_BEAMS = 0 must be a whole number from 1 to 16",
    ),
    "top_k above the vocabulary": (
        ["infer", *memorize_flags("--gin.TOP_K=5000", "--gin.TEMPERATURE=1.0")],
        "TOP_K = 5000 must be at most the vocabulary size (1024)",
    ),
    "checkpoint of another shape": (
        ["eval", *memorize_flags("--gin.T5Config.emb_dim=64")],
        "another geometry",
    ),
    "negative poll period": (
        [
            "eval",
            *memorize_flags("--gin.CHECKPOINT_STEP='continuous'", "--gin.evaluate.poll_seconds=-1"),
        ],
        "evaluate.poll_seconds = -1 must be a number > 0",
    ),
    "missing checkpoint step": (["eval", *memorize_flags("--gin.CHECKPOINT_STEP=7")], "7"),
    "misspelled macro": (
        ["train", *memorize_flags("--gin.TRAIN_STEP=5")],
        "TRAIN_STEP is bound but no setting uses %TRAIN_STEP; did you mean TRAIN_STEPS?",
    ),
    "unbound macro": (["eval", *memorize_flags("--gin.EVAL_BATCH_SIZE=%BATCH")], "%BATCH"),
    "bad T5Config value": (
        ["eval", *memorize_flags("--gin.T5Config.remat_policy='ful'")],
        "T5Config.remat_policy = 'ful' is not one of 'none', 'full', 'dots'",
    ),
    "fractional step count": (
        ["train", *memorize_flags("--gin.TRAIN_STEPS=1e3")],
        "TRAIN_STEPS = 1000.0 must be a whole number",
    ),
    "fractional example count": (  # named by its macro, not evaluate's argument num_examples
        ["eval", *memorize_flags("--gin.EVAL_NUM_EXAMPLES=2.5")],
        "EVAL_NUM_EXAMPLES = 2.5 must be None or a whole number >= 1",
    ),
    "unquoted string": (
        ["eval", *memorize_flags("--gin.EVAL_SPLIT=train")],
        "strings need quotes: --gin.EVAL_SPLIT=\"'train'\"",
    ),
    "missing initial checkpoint": (
        [
            "train",
            *memorize_flags(
                "--gin.INITIAL_CHECKPOINT_PATH='/no/such/checkpoint_5'",
                "--gin.MODEL_DIR='{model_dir}/fresh'",  # a resume would not read it
            ),
        ],
        "checkpoint /no/such/checkpoint_5 does not exist",
    ),
    "zero save period": (
        ["train", *memorize_flags("--gin.SAVE_PERIOD=0")],
        "SAVE_PERIOD = 0 must be",
    ),
    "initial checkpoint past TRAIN_STEPS": (
        [
            "train",
            *memorize_flags(
                f"--gin.INITIAL_CHECKPOINT_PATH='{{model_dir}}/checkpoint_{STEPS}'",
                "--gin.TRAIN_STEPS=10",
                "--gin.MODEL_DIR='{model_dir}/fresh'",
            ),
        ],
        f"INITIAL_CHECKPOINT_PATH is at step {STEPS}, not before TRAIN_STEPS=10: steps count on "
        f"from it as in T5X; set TRAIN_STEPS={STEPS + 10}, or train.relative_steps = True",
    ),
    "resume with another optimizer": (
        ["train", *memorize_flags("--gin.train.optimizer=@adamw()")],
        "holds the state of another optimizer or optimizer settings (0/mu/",
    ),
    "MODEL_DIR is a file": (
        ["train", *memorize_flags("--gin.MODEL_DIR='{model_dir}/config.gin'")],
        "config.gin is a file; give a directory",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_is_one_line_exit_2_and_changes_nothing(case, trained_dir):
    model_dir, _ = trained_dir
    args, expected = BAD_INPUTS[case]
    args = [arg.replace("{model_dir}", model_dir) for arg in args]
    before = _digest(model_dir)
    names_model_dir = any("MODEL_DIR" in arg for arg in args) or case == "missing MODEL_DIR"
    run = t5tpu(*args, model_dir=None if names_model_dir else model_dir)
    assert run.returncode == 2, (run.returncode, run.stderr[-2000:])
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("t5tpu: error: "), run.stderr[-2000:]
    assert expected in lines[0]
    assert _digest(model_dir) == before


def test_help_names_the_subcommands_and_flags_and_exits_0():
    run = t5tpu("--help")
    assert run.returncode == 0, run.stderr[-2000:]
    assert "gin subcommands: train, eval, infer, prepare-data, plan" in run.stdout
    assert "--gin_file" in run.stdout and "--gin_search_paths" in run.stdout
