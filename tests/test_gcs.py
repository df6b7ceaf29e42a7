"""gs:// paths against a local GCS emulator (tests/gcs_emulator.py, started once for the module):
MODEL_DIR for train, a killed run's resume, eval and infer; INFER_INPUT_FILE and
INITIAL_CHECKPOINT_PATH on gs://; `t5tpu convert` from and to gs://; a missing bucket and an
unreachable endpoint, each in one line within a bounded time.

What the emulator sees is what goes through etils' epath (gcsfs here, TensorFlow's client on a
TPU VM) and tensorstore (orbax's arrays). Task data read by tf.data is not covered: TensorFlow's
gs:// client cannot be pointed at an emulator, so the task reads the bundled local sample.

The tests share one gs:// run, trained by the module's fixtures; about 3 minutes on 2 cores.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import signal
import struct
import subprocess
import sys
import time

import gcs_emulator
import numpy as np
import pytest
from cli_runs import ROOT, TINY_EXPERIMENT, cli_command, free_port, succeeded, t5tpu

_MISSING = [
    name for name in ("gcp_storage_emulator", "gcsfs") if importlib.util.find_spec(name) is None
]
_WHY = f"{' and '.join(_MISSING)} not installed (pip install -c constraints.txt -e '.[test]')"
pytestmark = [
    # The tests share one run on the emulated bucket, trained through the command line.
    pytest.mark.slow,
    pytest.mark.skipif(bool(_MISSING), reason=_WHY),
]

BUCKET = gcs_emulator.BUCKET
RUN = "run"  # the shared run's MODEL_DIR in the bucket
GS_RUN = f"gs://{BUCKET}/{RUN}"
STEPS = 10
TRAIN = [
    f"--gin_file={TINY_EXPERIMENT}",
    f"--gin.TRAIN_STEPS={STEPS}",
    "--gin.BATCH_SIZE=8",
    "--gin.TASK_FEATURE_LENGTHS={'inputs': 32, 'targets': 4}",
    "--gin.SAVE_PERIOD=5",
    "--gin.EVAL_PERIOD=0",
    "--gin.train.log_period=1",
]
EVAL = [f"--gin_file={TINY_EXPERIMENT}", "--gin.EVAL_NUM_EXAMPLES=8", "--gin.EVAL_BATCH_SIZE=8"]
QUESTIONS = os.path.join(ROOT, "examples", "questions.txt")
COMMAND_SECONDS = 300  # any one command; they take 5-20 s
# How long t5tpu waits for a bucket to answer (T5TPU_STORAGE_ANSWER_SECONDS), and the
# most an unreachable endpoint may take to be reported: that plus start-up.
ANSWER_SECONDS = 5
UNREACHABLE_BOUND_SECONDS = 30


@pytest.fixture(scope="module")
def endpoint():
    with gcs_emulator.running_emulator() as url:
        yield url


def client_env(endpoint_url: str) -> dict:
    return {
        **os.environ,
        **gcs_emulator.client_environment(endpoint_url),
        "T5TPU_STORAGE_ANSWER_SECONDS": str(ANSWER_SECONDS),
    }


@pytest.fixture(scope="module")
def env(endpoint):
    return client_env(endpoint)


def run_ok(*args, env, model_dir=None):
    return succeeded(t5tpu(*args, model_dir=model_dir, env=env, timeout=COMMAND_SECONDS))


def train_until_killed(model_dir: str, env: dict, after_step: int) -> None:
    """Starts training and SIGKILLs it once step `after_step` has been reported."""
    proc = subprocess.Popen(
        cli_command("train", *TRAIN, f"--gin.MODEL_DIR='{model_dir}'"),
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        for line in proc.stdout:
            if line.startswith(f"step {after_step}/"):
                proc.send_signal(signal.SIGKILL)
                break
    finally:
        proc.kill()
        assert proc.wait(timeout=60) == -signal.SIGKILL


@pytest.fixture(scope="module")
def local_run(tmp_path_factory) -> str:
    model_dir = str(tmp_path_factory.mktemp("local") / "run")
    run_ok("train", *TRAIN, model_dir=model_dir, env=None)
    return model_dir


@pytest.fixture(scope="module")
def gcs_run(endpoint, env) -> subprocess.CompletedProcess:
    """The shared run: killed after checkpoint_5, then rerun to resume to step 10."""
    train_until_killed(GS_RUN, env, after_step=6)
    names = gcs_emulator.object_names(endpoint, f"{RUN}/")
    assert f"{RUN}/checkpoint_5/commit_success.txt" in names
    assert not any(name.startswith(f"{RUN}/checkpoint_10/") for name in names)
    return run_ok("train", *TRAIN, model_dir=GS_RUN, env=env)


@pytest.fixture(scope="module")
def evaluated(gcs_run, env) -> subprocess.CompletedProcess:
    return run_ok("eval", *EVAL, model_dir=GS_RUN, env=env)


@pytest.fixture(scope="module")
def inferred(gcs_run, endpoint, env) -> subprocess.CompletedProcess:
    gcs_emulator.upload(endpoint, "inputs/questions.txt", pathlib.Path(QUESTIONS).read_bytes())
    input_file = f"--gin.INFER_INPUT_FILE='gs://{BUCKET}/inputs/questions.txt'"
    return run_ok("infer", f"--gin_file={TINY_EXPERIMENT}", input_file, model_dir=GS_RUN, env=env)


def summary_steps(endpoint: str, folder: str) -> dict[str, set[int]]:
    """{tag: steps} of the TensorBoard event files in `folder` of the bucket (TFRecord framing:
    length, its CRC, an Event proto, its CRC)."""
    from tensorboard.compat.proto import event_pb2

    steps: dict[str, set[int]] = {}
    for name in gcs_emulator.object_names(endpoint, f"{folder}/events.out.tfevents."):
        data, offset = gcs_emulator.read_object(endpoint, name), 0
        while offset < len(data):
            (length,) = struct.unpack_from("<Q", data, offset)
            event = event_pb2.Event.FromString(data[offset + 12 : offset + 12 + length])
            offset += 12 + length + 4
            for value in event.summary.value:
                steps.setdefault(value.tag, set()).add(event.step)
    return steps


def exported_weights(input_path: str, output_dir, env) -> bytes:
    run_ok("convert", "--to=hf", f"--input={input_path}", f"--output_dir={output_dir}", env=env)
    return (pathlib.Path(output_dir) / "model.safetensors").read_bytes()


# --- train, resume, eval, infer, convert ---------------------------------------------------


def test_killed_run_resumes_on_gcs_to_the_parameters_of_an_uninterrupted_local_run(
    gcs_run, local_run, env, endpoint, tmp_path
):
    assert f"resuming from {GS_RUN}/checkpoint_5" in gcs_run.stdout
    assert "input position" not in gcs_run.stderr  # the position was restored, not skipped
    names = gcs_emulator.object_names(endpoint, f"{RUN}/")
    assert f"{RUN}/checkpoint_10/commit_success.txt" in names
    assert any(name.startswith(f"{RUN}/checkpoint_10/input_position/process_0.") for name in names)
    assert f"{RUN}/config.gin" in names
    assert STEPS in summary_steps(endpoint, f"{RUN}/train")["loss"]  # uploaded at the end
    # `convert --to=hf` reads the gs:// checkpoint (and config.gin beside it) like a local one.
    resumed = exported_weights(GS_RUN, tmp_path / "gcs_hf", env)
    assert resumed == exported_weights(local_run, tmp_path / "local_hf", env)


def test_eval_writes_its_metrics_and_summaries_to_gcs(evaluated, endpoint):
    metrics = json.loads(gcs_emulator.read_object(endpoint, f"{RUN}/eval_metrics.json"))
    assert metrics[str(STEPS)]["qp_is_duplicate"]["num_examples"] == 8
    names = gcs_emulator.object_names(endpoint, f"{RUN}/")
    assert f"{RUN}/eval_config.gin" in names
    assert summary_steps(endpoint, f"{RUN}/eval")["qp_is_duplicate/accuracy"] == {STEPS}
    assert not any(name.endswith(".tmp") for name in names)


def test_infer_reads_its_input_file_from_gcs_and_writes_predictions_there(inferred, endpoint):
    name = f"{RUN}/inference/questions-{STEPS}.jsonl"
    rows = [json.loads(line) for line in gcs_emulator.read_object(endpoint, name).splitlines()]
    questions = [line for line in pathlib.Path(QUESTIONS).read_text().splitlines() if line.strip()]
    assert [row["input"] for row in rows] == questions
    assert all("prediction" in row for row in rows)
    assert f"{RUN}/infer_config.gin" in gcs_emulator.object_names(endpoint, f"{RUN}/")


def test_fine_tunes_from_a_hugging_face_directory_on_gcs_into_a_gcs_model_dir(
    gcs_run, endpoint, env
):
    hf_dir = f"gs://{BUCKET}/hf"
    run_ok("convert", "--to=hf", f"--input={GS_RUN}", f"--output_dir={hf_dir}", env=env)
    assert {"hf/config.json", "hf/model.safetensors", "hf/spiece.model"} <= set(
        gcs_emulator.object_names(endpoint, "hf/")
    )
    flags = [*TRAIN, "--gin.TRAIN_STEPS=2", f"--gin.INITIAL_CHECKPOINT_PATH='{hf_dir}'"]
    run = run_ok("train", *flags, model_dir=f"gs://{BUCKET}/finetuned", env=env)
    assert f"initialized parameters from {hf_dir} (step 0)" in run.stdout
    assert "finetuned/checkpoint_2/commit_success.txt" in gcs_emulator.object_names(
        endpoint, "finetuned/"
    )


# Run with the emulator's environment: every parameter of a T5X checkpoint, as float32.
READ_T5X = """
import sys
import numpy as np
from t5tpu.formats import loader, t5x_format
assert loader.detect_format(sys.argv[1]) == "t5x"
checkpoint = t5x_format.T5XCheckpoint(sys.argv[1])
arrays = {name: np.asarray(checkpoint.read(name), np.float32) for name in checkpoint.shapes()}
np.savez(sys.argv[2], step=checkpoint.step, **{k.replace("/", "|"): v for k, v in arrays.items()})
"""


def test_reads_a_t5x_checkpoint_on_gcs_as_it_reads_a_local_one(endpoint, env, tmp_path):
    """The msgpack index through epath, the zarr arrays through tensorstore's gcs driver (one
    spec names T5X's placeholder bucket, which the checkpoint's own bucket replaces)."""
    import t5x_checkpoints as t5x

    params = t5x.random_params(t5x.CONFIGS["1.1"])
    local = t5x.write_t5x_checkpoint(str(tmp_path / "t5x"), params, t5x.STEP)
    for file in pathlib.Path(local).rglob("*"):
        if file.is_file():
            name = f"t5x/{pathlib.Path(local).name}/{file.relative_to(local)}"
            gcs_emulator.upload(endpoint, name, file.read_bytes())
    remote = f"gs://{BUCKET}/t5x/{pathlib.Path(local).name}"
    subprocess.run(
        [sys.executable, "-c", READ_T5X, remote, str(tmp_path / "read.npz")],
        cwd=ROOT,
        env=env,
        check=True,
        timeout=COMMAND_SECONDS,
    )
    read = np.load(tmp_path / "read.npz")
    assert int(read["step"]) == t5x.STEP
    expected = t5x.expected_values(params)
    for name, value in expected.items():
        np.testing.assert_array_equal(read[name.replace("/", "|")], t5x.t5x_layout(name, value))
    assert len(read.files) == len(expected) + 1


def test_a_restart_keeps_what_the_earlier_runs_wrote_beside_the_checkpoints(
    gcs_run, evaluated, inferred, endpoint, env
):
    before = gcs_emulator.object_names(endpoint, f"{RUN}/")
    run_ok("train", *TRAIN, model_dir=GS_RUN, env=env)  # at TRAIN_STEPS already: nothing to do
    after = gcs_emulator.object_names(endpoint, f"{RUN}/")
    assert [name for name in before if name not in after] == []
    trained = [name for name in after if name.startswith(f"{RUN}/train/events.")]
    assert len(trained) == 2  # one per training process that ran steps


# --- failures: one line, exit 2, nothing created -------------------------------------------


def assert_one_line_error(run: subprocess.CompletedProcess, path: str) -> None:
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert run.returncode == 2, run.stderr[-3000:]
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    assert lines[-1].startswith("t5tpu: error: ") and path in lines[-1], lines
    assert len(lines) <= 3, lines


MISSING_BUCKET = "gs://no-such-bucket-t5tpu/run"


# (command, its flags): each names MISSING_BUCKET in one of its paths.
def _run_outputs_local(argv: list[str], tmp_path, *, env, timeout: float):
    """Runs `t5tpu ARGV` with a local MODEL_DIR when the command is not about MODEL_DIR (a
    gs:// one is what the others test), or convert with a local output directory."""
    if argv[0] == "convert":
        local = [f"--output_dir={tmp_path / 'out'}"]
    else:
        local = [] if any("MODEL_DIR" in arg for arg in argv) else [f"--gin.MODEL_DIR='{tmp_path}'"]
    return subprocess.run(
        cli_command(*argv, *local),
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


ON_A_MISSING_BUCKET = {
    "train_model_dir": ["train", *TRAIN, f"--gin.MODEL_DIR='{MISSING_BUCKET}'"],
    "train_initial_checkpoint": [
        "train",
        *TRAIN,
        f"--gin.INITIAL_CHECKPOINT_PATH='{MISSING_BUCKET}/checkpoint_5'",
    ],
    "eval_model_dir": ["eval", *EVAL, f"--gin.MODEL_DIR='{MISSING_BUCKET}'"],
    "infer_input_file": [
        "infer",
        f"--gin_file={TINY_EXPERIMENT}",
        f"--gin.INFER_INPUT_FILE='{MISSING_BUCKET}/questions.txt'",
    ],
    "convert_input": ["convert", "--to=hf", f"--input={MISSING_BUCKET}"],
}


@pytest.mark.parametrize("argv", list(ON_A_MISSING_BUCKET.values()), ids=list(ON_A_MISSING_BUCKET))
def test_a_missing_bucket_is_one_line_and_never_created(argv, endpoint, env, tmp_path):
    run = _run_outputs_local(argv, tmp_path, env=env, timeout=COMMAND_SECONDS)
    assert_one_line_error(run, MISSING_BUCKET)
    assert gcs_emulator.bucket_names(endpoint) == [BUCKET]


UNREACHABLE = {
    "train_model_dir": ["train", *TRAIN, f"--gin.MODEL_DIR='{GS_RUN}'"],
    "train_initial_checkpoint": [
        "train",
        *TRAIN,
        f"--gin.INITIAL_CHECKPOINT_PATH='{GS_RUN}/checkpoint_5'",
    ],
    "convert_input": ["convert", "--to=hf", f"--input={GS_RUN}"],
}


@pytest.mark.parametrize("argv", list(UNREACHABLE.values()), ids=list(UNREACHABLE))
def test_an_unreachable_endpoint_is_one_line_within_a_bounded_time(argv, tmp_path):
    closed = client_env(f"http://127.0.0.1:{free_port()}")  # nothing listens there
    start = time.time()
    run = _run_outputs_local(argv, tmp_path, env=closed, timeout=UNREACHABLE_BOUND_SECONDS)
    assert_one_line_error(run, GS_RUN)
    assert "did not answer" in run.stderr
    assert time.time() - start < UNREACHABLE_BOUND_SECONDS
