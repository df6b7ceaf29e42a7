"""Exact resume: a run killed (SIGKILL) or preempted (SIGTERM) at arbitrary steps and restarted
with the same command ends with the same parameters and optimizer state, bit for bit, as a run
that was never interrupted. Also: damaged checkpoints are skipped, a NaN loss stops cleanly."""

import glob
import os
import random
import shutil
import signal
import subprocess

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from cli_runs import TINY_EXPERIMENT, start, succeeded, t5tpu

# Every test trains the tiny model through the command line, some of them several times.
pytestmark = pytest.mark.slow

STEPS = 16
FLAGS = [
    f"--gin_file={TINY_EXPERIMENT}",
    f"--gin.TRAIN_STEPS={STEPS}",
    "--gin.BATCH_SIZE=8",
    "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 4}",
    "--gin.SAVE_PERIOD=4",
    "--gin.EVAL_PERIOD=0",
    "--gin.DROPOUT_RATE=0.1",  # so the dropout randomness must resume exactly too
    "--gin.train.log_period=1",
]


def train(model_dir, *extra):
    return succeeded(t5tpu("train", *FLAGS, *extra, model_dir=model_dir, timeout=600))


def interrupt(model_dir, at_step, sig, stderr=subprocess.DEVNULL):
    """Starts training and sends `sig` once step `at_step` has been reported."""
    proc = start("train", *FLAGS, f"--gin.MODEL_DIR='{model_dir}'", stderr=stderr)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith(f"step {at_step}/"):
            proc.send_signal(sig)
            break
    lines.extend(proc.stdout)
    return proc.wait(timeout=120), "".join(lines)


def load(model_dir, step=STEPS):
    checkpointer = ocp.StandardCheckpointer()
    return {
        item: checkpointer.restore(os.path.join(model_dir, f"checkpoint_{step}", item))
        for item in ("params", "opt_state")
    }


def assert_bitwise_equal(a, b):
    flat_a, tree_a = jax.tree_util.tree_flatten(a)
    flat_b, tree_b = jax.tree_util.tree_flatten(b)
    assert tree_a == tree_b
    for x, y in zip(flat_a, flat_b, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    model_dir = str(tmp_path_factory.mktemp("uninterrupted"))
    train(model_dir)
    return load(model_dir)


def test_sigkill_at_random_steps_then_restart_is_bitwise_exact(uninterrupted, tmp_path):
    model_dir = str(tmp_path)
    kill_steps = sorted(random.Random(4).sample(range(2, STEPS), 3))
    for step in kill_steps:
        code, _ = interrupt(model_dir, step, signal.SIGKILL)
        assert code == -signal.SIGKILL
    train(model_dir)
    assert_bitwise_equal(load(model_dir), uninterrupted)


@pytest.mark.smoke
def test_sigterm_saves_current_step_and_exits_0_then_resumes_exactly(uninterrupted, tmp_path):
    model_dir = str(tmp_path)
    code, out = interrupt(model_dir, 6, signal.SIGTERM)
    assert code == 0
    saved = [line for line in out.splitlines() if line.startswith("SIGTERM: saved checkpoint_")]
    assert saved, out
    step = int(saved[0].split("checkpoint_")[1].split(";")[0])
    assert 6 <= step < STEPS and os.path.isdir(os.path.join(model_dir, f"checkpoint_{step}"))
    position = os.listdir(f"{model_dir}/checkpoint_{step}/input_position")
    assert any(name.startswith("process_0.") and name.endswith(".index") for name in position)
    resumed = train(model_dir)
    assert f"resuming from {model_dir}/checkpoint_{step}" in resumed.stdout
    assert "input position" not in resumed.stderr  # restored, not skipped
    assert not glob.glob(f"{model_dir}/config_to_step_*")  # the same config: nothing to keep
    assert_bitwise_equal(load(model_dir), uninterrupted)


def test_ctrl_c_says_so_in_one_line_and_the_rerun_resumes_exactly(uninterrupted, tmp_path):
    model_dir = str(tmp_path / "model")
    with open(tmp_path / "stderr", "w+") as stderr:
        code, _ = interrupt(model_dir, 6, signal.SIGINT, stderr)
        stderr.seek(0)
        lines = [line for line in stderr.read().splitlines() if line.strip()]
    assert code == 130
    assert lines[-1].startswith("t5tpu: interrupted; what was saved is complete, rerun")
    assert lines[-1].endswith(
        "(to stop training with a checkpoint at the current step, send SIGTERM instead)"
    )
    assert not any("Traceback" in line for line in lines), lines
    train(model_dir)
    assert_bitwise_equal(load(model_dir), uninterrupted)


def test_unreadable_input_position_falls_back_to_skipping_exactly(uninterrupted, tmp_path):
    model_dir = str(tmp_path)
    train(model_dir, "--gin.TRAIN_STEPS=8")
    position = os.path.join(model_dir, "checkpoint_8", "input_position")
    for name in os.listdir(position):
        if ".data-" in name:
            with open(os.path.join(position, name), "wb") as f:
                f.write(b"not a tensor bundle")
    run = train(model_dir)
    assert "does not fit this pipeline" in run.stderr and "skipping 8 batches" in run.stderr
    assert_bitwise_equal(load(model_dir), uninterrupted)


def test_resume_with_another_batch_size_skips_instead_of_restoring(tmp_path):
    """The saved position holds buffered batches of the old size: it must not be restored."""
    model_dir = str(tmp_path)
    train(model_dir, "--gin.TRAIN_STEPS=4")
    run = train(model_dir, "--gin.TRAIN_STEPS=6", "--gin.BATCH_SIZE=4")
    assert "training steps 4..6" in run.stdout and "input from batch 4" in run.stdout
    assert "was saved by another input pipeline (batch size, task" in run.stderr
    assert "skipping 4 batches of the new shape" in run.stderr
    # config.gin is the resumed run's; the one that trained steps 1-4 is kept beside it.
    config = (tmp_path / "config.gin").read_text()
    earlier = (tmp_path / "config_to_step_4.gin").read_text()
    assert "BATCH_SIZE = 4" in config and "BATCH_SIZE = 8" in earlier


def test_damaged_newest_checkpoint_is_skipped_with_a_warning(uninterrupted, tmp_path):
    model_dir = str(tmp_path)
    train(model_dir, "--gin.TRAIN_STEPS=8")
    # Damage checkpoint_8 the way a partial copy would: the metadata file is gone.
    os.remove(os.path.join(model_dir, "checkpoint_8", "_CHECKPOINT_METADATA"))
    shutil.rmtree(os.path.join(model_dir, "checkpoint_8", "opt_state"))
    run = train(model_dir)
    assert "skipping incomplete" in run.stderr and "checkpoint_8" in run.stderr
    assert f"resuming from {model_dir}/checkpoint_4" in run.stdout
    assert_bitwise_equal(load(model_dir), uninterrupted)
    # Step 8 was saved again; the damaged one is kept aside, not deleted.
    assert "moved" in run.stdout and os.path.isdir(f"{model_dir}/checkpoint_8.incomplete")
    assert set(load(model_dir, step=8)) == {"params", "opt_state"}


def test_nan_loss_stops_with_exit_2_and_saves_nothing(tmp_path):
    model_dir = str(tmp_path)
    train(model_dir, "--gin.TRAIN_STEPS=4")
    before = sorted(os.listdir(model_dir))
    # A learning rate of 1e30 blows the parameters up within a step or two.
    run = t5tpu("train", *FLAGS, "--gin.LEARNING_RATE=1e30", model_dir=model_dir, timeout=600)
    assert run.returncode == 2, run.stderr[-2000:]
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and ("loss is nan" in lines[0] or "loss is inf" in lines[0]), lines
    assert sorted(os.listdir(model_dir)) == before  # no checkpoint after step 4 was written


def test_fine_tuning_reads_the_input_from_its_first_batch(uninterrupted, tmp_path):
    """From a pretrained checkpoint (T5 1.1's is at step 1,000,000) the step count goes on from
    its step but the input starts at the first batch, and a resume skips only the batches the
    fine-tuning used."""
    from t5tpu.formats import conversion

    pretrained = conversion.save_params(str(tmp_path / "pretrained"), 1000, uninterrupted["params"])
    model_dir = tmp_path / "fine_tuned"
    start = f"--gin.INITIAL_CHECKPOINT_PATH='{pretrained}'"
    run = train(model_dir, start, "--gin.TRAIN_STEPS=1002")
    assert "training steps 1000..1002" in run.stdout
    assert "input from batch 0" in run.stdout
    # The resume needs only MODEL_DIR: the pretrained checkpoint may be gone (a recreated VM).
    shutil.rmtree(tmp_path / "pretrained")
    run = train(model_dir, start, "--gin.TRAIN_STEPS=1003")
    assert "training steps 1002..1003" in run.stdout
    assert "input from batch 2" in run.stdout
