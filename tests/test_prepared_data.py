"""The CPU twin of scripts/accelerator_check.sh's run without TensorFlow: `t5tpu prepare-data`
writes the tiny Quora run's batches and eval examples; train (stopped by SIGTERM and resumed),
eval, infer and serve then run from that file with tensorflow, seqio and clu absent
(scripts/without_tensorflow.py), and the run ends with the parameters, metrics and eval
examples of the same run fed by the seqio pipeline, bit for bit (CPU, float32)."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys

import numpy as np
import orbax.checkpoint as ocp
import pytest
from cli_runs import ROOT, TINY_EXPERIMENT, free_port, read_json, read_jsonl, succeeded, t5tpu

from t5tpu.data import prepared
from t5tpu.errors import UserError

STEPS = 8
SIGNALLED_AT = 3
FLAGS = [
    f"--gin_file={TINY_EXPERIMENT}",
    f"--gin.TRAIN_STEPS={STEPS}",
    "--gin.BATCH_SIZE=8",
    f"--gin.SAVE_PERIOD={STEPS}",
    "--gin.EVAL_PERIOD=0",
    "--gin.EVAL_NUM_EXAMPLES=16",
    "--gin.train.log_period=1",
]
WITHOUT_TENSORFLOW = [sys.executable, os.path.join(ROOT, "scripts", "without_tensorflow.py")]


def _without_tensorflow(report, *args) -> list[str]:
    return [*WITHOUT_TENSORFLOW, str(report), *args]


def _imported(report) -> list[str]:
    return json.loads(pathlib.Path(report).read_text())["imported"]


def _checkpoint(model_dir, step=STEPS) -> dict:
    checkpointer = ocp.StandardCheckpointer()
    return {
        item: checkpointer.restore(os.path.join(model_dir, f"checkpoint_{step}", item))
        for item in ("params", "opt_state")
    }


def _train_with_sigterm(report, flags) -> str:
    """Trains from the prepared file, sends SIGTERM once step SIGNALLED_AT is reported."""
    proc = subprocess.Popen(
        _without_tensorflow(report, "train", *flags),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith(f"step {SIGNALLED_AT}/"):
            proc.send_signal(signal.SIGTERM)
            break
    lines.extend(proc.stdout)
    assert proc.wait(timeout=300) == 0, "".join(lines)[-3000:]
    return "".join(lines)


def _run(report, *args) -> subprocess.CompletedProcess:
    argv = _without_tensorflow(report, *args)
    run = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    return succeeded(run)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The seqio-fed run (MODEL_DIR a) and the prepared one (b), each trained and evaluated."""
    root = tmp_path_factory.mktemp("prepared")
    data, fed, from_file = root / "qp.npz", str(root / "a"), str(root / "b")
    succeeded(t5tpu("prepare-data", *FLAGS, f"--gin.PREPARED_DATA='{data}'"))
    succeeded(t5tpu("train", *FLAGS, model_dir=fed))
    succeeded(t5tpu("eval", *FLAGS, model_dir=fed))
    flags = [*FLAGS, f"--gin.PREPARED_DATA='{data}'", f"--gin.MODEL_DIR='{from_file}'"]
    stopped = _train_with_sigterm(root / "train1.json", flags)
    resumed = _run(root / "train2.json", "train", *flags).stdout
    _run(root / "eval.json", "eval", *flags)
    return dict(root=root, data=data, fed=fed, from_file=from_file, out=(stopped, resumed))


@pytest.mark.slow  # the command line in fresh interpreters, several times
def test_the_prepared_file_holds_the_runs_batches_and_eval_examples(runs):
    data = prepared.read(str(runs["data"]))
    assert data.num_batches == STEPS
    assert data.batches["encoder_input_tokens"].shape == (STEPS, 8, 96)
    assert data.batches["decoder_target_tokens"].shape == (STEPS, 8, 4)
    (task,) = data.eval_tasks
    assert task.name == "qp_is_duplicate" and len(task.examples) == 16
    assert {ex.reference for ex in task.examples} <= {"0", "1"}
    assert task.metric_fns == ("t5tpu.tasks.metrics:accuracy", "t5tpu.tasks.metrics:f1_duplicate")


@pytest.mark.slow
def test_without_tensorflow_train_and_eval_equal_the_seqio_fed_run(runs):
    stopped, resumed = runs["out"]
    saved = [line for line in stopped.splitlines() if line.startswith("SIGTERM: saved")]
    assert saved and f"checkpoint_{STEPS}" not in saved[0], stopped
    assert "resuming from" in resumed
    for name in ("train1.json", "train2.json", "eval.json"):
        assert _imported(runs["root"] / name) == [], name
    fed, from_file = _checkpoint(runs["fed"]), _checkpoint(runs["from_file"])
    for item in ("params", "opt_state"):
        flat_a = jax_leaves(fed[item])
        flat_b = jax_leaves(from_file[item])
        assert len(flat_a) == len(flat_b) > 0
        for a, b in zip(flat_a, flat_b, strict=True):
            np.testing.assert_array_equal(a, b)
    metrics = read_json(os.path.join(runs["from_file"], "eval_metrics.json"))
    assert metrics == read_json(os.path.join(runs["fed"], "eval_metrics.json"))
    assert metrics[str(STEPS)]["qp_is_duplicate"]["num_examples"] == 16
    assert 0 <= metrics[str(STEPS)]["qp_is_duplicate"]["accuracy"] <= 100
    examples = f"eval_examples/qp_is_duplicate-{STEPS}.jsonl"
    lines = read_jsonl(os.path.join(runs["from_file"], examples))
    assert lines == read_jsonl(os.path.join(runs["fed"], examples)) and len(lines) == 16
    scalars = read_jsonl(os.path.join(runs["from_file"], "train", "scalars.jsonl"))
    assert [row["step"] for row in scalars] == list(range(1, STEPS + 1))


def jax_leaves(tree) -> list:
    import jax

    return [np.asarray(leaf) for leaf in jax.tree_util.tree_leaves(tree)]


@pytest.mark.slow
def test_without_tensorflow_infer_and_serve_answer_from_the_run(runs, tmp_path):
    inputs = tmp_path / "inputs.txt"
    lines = pathlib.Path(ROOT, "examples", "questions.txt").read_text().splitlines()[:3]
    inputs.write_text("\n".join(lines) + "\n")
    model_dir = runs["from_file"]
    flags = [f"--gin_file={TINY_EXPERIMENT}", f"--gin.MODEL_DIR='{model_dir}'"]
    _run(tmp_path / "infer.json", "infer", *flags, f"--gin.INFER_INPUT_FILE='{inputs}'")
    assert _imported(tmp_path / "infer.json") == []
    (written,) = os.listdir(os.path.join(model_dir, "inference"))
    rows = read_jsonl(os.path.join(model_dir, "inference", written))
    assert [row["input"] for row in rows] == lines
    port = free_port()
    report = tmp_path / "serve.json"
    with open(tmp_path / "serve.log", "w") as log:
        server = subprocess.Popen(
            _without_tensorflow(
                report, "serve", f"--model={model_dir}", f"--port={port}", "--no_warmup"
            ),
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        answer = _first_answer(port, server, lines)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
    assert answer["predictions"] == [row["prediction"] for row in rows]
    assert _imported(report) == [], (tmp_path / "serve.log").read_text()[-2000:]


def _first_answer(port: int, server, texts: list[str]) -> dict:
    """The server's answer to one /v1/predict once /health says it is ready."""
    import http.client
    import time

    for _ in range(600):
        assert server.poll() is None, "the server exited"
        try:
            connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            connection.request("GET", "/health")
            if connection.getresponse().status == 200:
                break
        except OSError:
            pass
        time.sleep(0.2)
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = json.dumps({"instances": texts})
    connection.request("POST", "/v1/predict", body, {"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200
    return json.loads(response.read())


@pytest.mark.slow
def test_a_run_with_other_settings_is_refused_before_anything_is_written(runs, tmp_path):
    model_dir = tmp_path / "run"
    flags = [*FLAGS, f"--gin.PREPARED_DATA='{runs['data']}'", f"--gin.MODEL_DIR='{model_dir}'"]
    run = t5tpu("train", *flags, "--gin.BATCH_SIZE=16")
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        f"t5tpu: error: PREPARED_DATA: {runs['data']} holds batches made with BATCH_SIZE=8, this "
        "run has BATCH_SIZE=16; set BATCH_SIZE to the file's or run `t5tpu prepare-data` again "
        "with this run's settings"
    ]
    assert not model_dir.exists()
    run = t5tpu("train", *flags, "--gin.TRAIN_STEPS=9")
    assert run.returncode == 2 and "holds 8 batches, this run trains on 9" in run.stderr


def _small(batches: int = 3) -> prepared.PreparedData:
    rng = np.random.default_rng(0)
    shapes = {"encoder_input_tokens": 5, "decoder_target_tokens": 2, "decoder_input_tokens": 2}
    example = prepared.EvalExample((4, 5, 1), (7, 1), "is duplicate: a <SEP> b", "1", "1")
    return prepared.PreparedData(
        settings=prepared.BatchSettings(
            task="qp_is_duplicate",
            lengths={"inputs": 5, "targets": 2},
            batch_size=4,
            seed=0,
            packing=False,
        ),
        tasks=("qp_is_duplicate",),
        batches={
            name: rng.integers(0, 100, (batches, 4, length), dtype=np.int32)
            for name, length in shapes.items()
        },
        eval_split="validation",
        eval_num_examples=None,
        eval_tasks=(
            prepared.EvalTask(
                name="qp_is_duplicate",
                metric_fns=("t5tpu.tasks.metrics:accuracy",),
                postprocess_fn="t5tpu.tasks.quora:strip_output",
                examples=(example, example),
            ),
        ),
    )


def test_a_prepared_file_reads_back_as_written(tmp_path):
    path = str(tmp_path / "data.npz")
    prepared.write(path, _small())
    back = prepared.read(path)
    assert back.path == path and back.settings == _small().settings
    assert back.eval_tasks == _small().eval_tasks and back.tasks == ("qp_is_duplicate",)
    for name, array in _small().batches.items():
        np.testing.assert_array_equal(back.batches[name], array)
    stream = prepared.stream(back, skip=1, needed=3)
    np.testing.assert_array_equal(next(stream)["encoder_input_tokens"], array_at(back, 1))
    with pytest.raises(UserError, match="holds 3 batches, this run trains on 4; run"):
        prepared.stream(back, skip=0, needed=4)


def array_at(data: prepared.PreparedData, index: int) -> np.ndarray:
    return data.batches["encoder_input_tokens"][index]


def test_a_damaged_or_missing_file_is_one_line(tmp_path):
    path = tmp_path / "data.npz"
    prepared.write(str(path), _small())
    whole = path.read_bytes()
    for damaged in (whole[: len(whole) // 2], b"not a zip", whole[:100]):
        path.write_bytes(damaged)
        with pytest.raises(UserError, match="is not a file `t5tpu prepare-data` wrote") as e:
            prepared.read(str(path))
        assert "\n" not in str(e.value)
    with pytest.raises(UserError, match="no file"):
        prepared.read(str(tmp_path / "missing.npz"))


def test_other_settings_are_refused_naming_the_macro(tmp_path):
    data = _small()
    for field, macro, value in (
        ("batch_size", "BATCH_SIZE", 8),
        ("seed", "RANDOM_SEED", 1),
        ("lengths", "TASK_FEATURE_LENGTHS", {"inputs": 6, "targets": 2}),
        ("packing", "USE_PACKING", True),
    ):
        other = prepared.BatchSettings(**{**data.settings.__dict__, field: value})
        with pytest.raises(UserError, match=f"made with {macro}=.*this run has {macro}="):
            prepared.check_settings(data, other)
    prepared.check_settings(data, data.settings)
    with pytest.raises(
        UserError, match="EVAL_NUM_EXAMPLES=None, this run asks EVAL_NUM_EXAMPLES=8"
    ):
        prepared.check_eval(data, split="validation", num_examples=8)
