"""Fault injection through the command line: damaged checkpoints, a full disk, a read-only
MODEL_DIR, binary and overlong inputs, bad macro values, a half-copied checkpoint to convert, two
training runs on one MODEL_DIR, and failed eval/infer runs beside earlier successful ones.

Each test runs `t5tpu` as a subprocess on its own copy of one tiny model trained once for the
module, and checks the contract of docs/FAULTS.md: the exit code, a stderr of
at most a few lines that names the cause (no traceback), and every file that was in MODEL_DIR
before still there, byte for byte (a damaged checkpoint may be moved aside, never deleted).

The disk-full and read-only cases mount a tmpfs or a read-only bind mount under the test's
tmp_path (tests/fault_mounts.py); where mounting is not permitted they are skipped.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import threading
import time

import fault_mounts
import pytest
from cli_runs import (
    ROOT,
    TINY_EXPERIMENT,
    cli_command,
    file_digests,
    read_json,
    read_jsonl,
    start,
    t5tpu,
)

# Nearly every test runs the command line on a copy of the trained model.
pytestmark = pytest.mark.slow

STEPS = 6
SAVE_PERIOD = 2
NEWEST = f"checkpoint_{STEPS}"
OLDER = f"checkpoint_{STEPS - SAVE_PERIOD}"
QUESTIONS = os.path.join(ROOT, "examples", "questions.txt")

# The module's training run, rerun as is by a resume; batch 8 and no eval keep it quick.
TRAIN = [
    f"--gin_file={TINY_EXPERIMENT}",
    "--gin.BATCH_SIZE=8",
    f"--gin.SAVE_PERIOD={SAVE_PERIOD}",
    "--gin.EVAL_PERIOD=0",
]
EVAL = [f"--gin_file={TINY_EXPERIMENT}", "--gin.EVAL_NUM_EXAMPLES=8"]
INFER = [f"--gin_file={TINY_EXPERIMENT}", f"--gin.INFER_INPUT_FILE='{QUESTIONS}'"]

TRACEBACK = "Traceback (most recent call last)"
MAX_STDERR_LINES = 3
# "checkpoint_N cannot be read", in any of the usual wordings.
UNREADABLE = re.compile(
    r"(can ?not|can't|could not|couldn't|unable to) (be )?read|unreadable|not readable", re.I
)
ORBAX_TMP = "orbax-checkpoint-tmp"


# --- the shared model ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained_model(tmp_path_factory) -> str:
    """A tiny T5 trained for STEPS steps with checkpoints every SAVE_PERIOD (2, 4, 6), then
    evaluated (on the train split, so validation results of the tests land in a new file) and
    run on examples/questions.txt: eval_config.gin and infer_config.gin of earlier successful
    runs are there too. Tests copy it (`model_dir`) before damaging anything."""
    model_dir = str(tmp_path_factory.mktemp("faults") / "trained")
    for command, args in (
        ("train", [*TRAIN, f"--gin.TRAIN_STEPS={STEPS}"]),
        ("eval", [*EVAL, "--gin.EVAL_SPLIT='train'"]),
        ("infer", INFER),
    ):
        run = t5tpu(command, *args, model_dir=model_dir)
        assert run.returncode == 0, f"{command}: {run.stderr[-3000:]}"
    names = sorted(os.listdir(model_dir))
    assert [n for n in names if n.startswith("checkpoint_")] == [
        "checkpoint_2",
        "checkpoint_4",
        "checkpoint_6",
    ]
    assert {"config.gin", "eval_config.gin", "infer_config.gin"} <= set(names)
    return model_dir


@pytest.fixture
def model_dir(trained_model, tmp_path) -> str:
    """This test's own copy of the trained model."""
    copy = tmp_path / "model"
    shutil.copytree(trained_model, copy)
    return str(copy)


# --- what every fault must look like -------------------------------------------------------


def _stderr_lines(run: subprocess.CompletedProcess) -> list[str]:
    return [line for line in run.stderr.splitlines() if line.strip()]


def _assert_short_stderr(run: subprocess.CompletedProcess) -> list[str]:
    """No traceback, and at most MAX_STDERR_LINES non-empty lines; returns them."""
    assert TRACEBACK not in run.stderr, run.stderr[-3000:]
    lines = _stderr_lines(run)
    assert len(lines) <= MAX_STDERR_LINES, run.stderr[-3000:]
    return lines


def _error_line(run: subprocess.CompletedProcess, code: int = 2) -> str:
    """The run's one `t5tpu: error: ...` line, once it has exited `code` with a short stderr."""
    assert run.returncode == code, (run.returncode, run.stderr[-3000:])
    lines = _assert_short_stderr(run)
    errors = [line for line in lines if line.startswith("t5tpu: error: ")]
    assert len(errors) == 1, run.stderr[-3000:]
    return errors[0]


def _assert_unchanged(before: dict, folder: str, may_change: tuple[str, ...] = ()) -> None:
    """Every file in `before` (file_digests) still in `folder`, byte for byte, but those named
    in `may_change`; new files are allowed."""
    after = file_digests(folder)
    changed = sorted(
        path
        for path, digest in before.items()
        if after.get(path) != digest and path not in may_change
    )
    assert not changed, f"changed or removed in {folder}: {changed[:10]}"


def _assert_nothing_written(before: dict, folder: str) -> None:
    """Not a file changed, removed or added (bad input is refused before any work)."""
    after = file_digests(folder)
    assert after == before, (
        f"added: {sorted(set(after) - set(before))[:10]}; "
        f"changed or removed: {sorted(p for p in before if after.get(p) != before[p])[:10]}"
    )


def _assert_kept_somewhere(before: dict, folder: str, name: str) -> None:
    """Every file of checkpoint `name` in `before` still there, or under a renamed
    `name`.<something> directory (moved aside), byte for byte."""
    after = file_digests(folder)
    aside = [d for d in os.listdir(folder) if d.startswith(f"{name}.")]
    prefix = name + os.sep
    lost = []
    for path, digest in before.items():
        if not path.startswith(prefix):
            continue
        inner = path[len(prefix) :]
        places = [path, *(os.path.join(d, inner) for d in aside)]
        if not any(after.get(place) == digest for place in places):
            lost.append(path)
    assert not lost, f"bytes of {name} gone from {folder} (moved aside to {aside}): {lost[:10]}"


def _assert_complete_checkpoints(folder: str) -> None:
    """Every checkpoint_N has the files restore needs, and no orbax temporary is left."""
    for name in os.listdir(folder):
        assert ORBAX_TMP not in name, f"orbax temporary left behind: {name}"
        if re.fullmatch(r"checkpoint_\d+", name):
            for item in ("_CHECKPOINT_METADATA", "params/_METADATA", "opt_state/_METADATA"):
                assert os.path.isfile(os.path.join(folder, name, item)), f"{name}/{item} missing"


# --- damaged newest checkpoint -------------------------------------------------------------


def _damage(model_dir: str, how: str) -> str:
    """Damages the newest checkpoint's parameters; returns what was damaged."""
    params = pathlib.Path(model_dir, NEWEST, "params")
    if how == "params_file_truncated":  # the largest: the arrays' data
        target = max((p for p in params.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
        data = target.read_bytes()
        target.write_bytes(data[: len(data) // 2])
    elif how == "params_metadata_emptied":
        target = params / "_METADATA"
        target.write_bytes(b"")
    else:
        raise ValueError(how)
    return str(target)


DAMAGES = ("params_file_truncated", "params_metadata_emptied")
LATEST_RUNS = {
    "train": [*TRAIN, f"--gin.TRAIN_STEPS={STEPS}"],  # the same command again: a resume
    "eval": EVAL,  # CHECKPOINT_STEP = 'latest'
    "infer": INFER,  # CHECKPOINT_STEP = 'latest'
}
# The operative config a successful run writes (replacing its own earlier one, by design).
OWN_CONFIG = {"train": "config.gin", "eval": "eval_config.gin", "infer": "infer_config.gin"}


@pytest.mark.parametrize("damage", DAMAGES)
@pytest.mark.parametrize("command", sorted(LATEST_RUNS))
def test_a_damaged_newest_checkpoint_is_skipped_with_one_warning(command, damage, model_dir):
    _damage(model_dir, damage)
    before = file_digests(model_dir)
    run = t5tpu(command, *LATEST_RUNS[command], model_dir=model_dir)

    assert run.returncode == 0, run.stderr[-3000:]
    lines = _assert_short_stderr(run)
    warnings = [line for line in lines if NEWEST in line and UNREADABLE.search(line)]
    assert len(warnings) == 1, f"want one line saying {NEWEST} cannot be read:\n{run.stderr}"
    # The newest readable older checkpoint was used.
    if command == "train":
        assert f"resuming from {os.path.join(model_dir, OLDER)}" in run.stdout, run.stdout
        _assert_complete_checkpoints(model_dir)
    elif command == "eval":
        assert list(read_json(os.path.join(model_dir, "eval_metrics.json"))) == [str(STEPS - 2)]
    else:
        predictions = os.path.join(model_dir, "inference", f"questions-{STEPS - 2}.jsonl")
        assert len(read_jsonl(predictions)) == 3
    # Never deleted: still there, or moved aside whole.
    _assert_kept_somewhere(before, model_dir, NEWEST)
    others = {path: d for path, d in before.items() if not path.startswith(NEWEST + os.sep)}
    # A resume under another MODEL_DIR path rewrites config.gin, keeping the old one
    # (config_to_step_N.gin): its bytes must still be somewhere.
    own = OWN_CONFIG[command]
    _assert_unchanged(others, model_dir, may_change=(own,))
    if command == "train":
        assert before[own] in file_digests(model_dir).values(), "the earlier config.gin is lost"


@pytest.mark.parametrize("damage", DAMAGES)
def test_eval_of_the_damaged_step_named_explicitly_is_one_line_exit_2(damage, model_dir):
    _damage(model_dir, damage)
    before = file_digests(model_dir)
    run = t5tpu("eval", *EVAL, f"--gin.CHECKPOINT_STEP={STEPS}", model_dir=model_dir)
    line = _error_line(run)
    assert NEWEST in line, line
    _assert_nothing_written(before, model_dir)


# --- disk full while saving ----------------------------------------------------------------

# What is left free on the small disk: room for the run's event file, lock and log, not for a
# checkpoint (about 7 MB, 3.8 MB of it one params file).
FREE_FOR_THE_RUN = 1 << 20


def test_disk_full_while_saving_is_one_line_exit_1_and_keeps_the_previous_checkpoint(
    trained_model, tmp_path
):
    size = sum(
        os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(trained_model) for f in fs
    )
    with fault_mounts.tmpfs(tmp_path / "disk", size + (32 << 20)) as disk:
        model_dir = os.path.join(disk, "model")
        shutil.copytree(trained_model, model_dir)
        fault_mounts.fill(disk, FREE_FOR_THE_RUN)  # the filler lies beside MODEL_DIR
        assert fault_mounts.free_bytes(disk) < 2 * FREE_FOR_THE_RUN
        before = file_digests(model_dir)
        run = t5tpu("train", *TRAIN, f"--gin.TRAIN_STEPS={STEPS + 2}", model_dir=model_dir)

        line = _error_line(run, code=1)  # not the user's input
        assert model_dir in line, line
        assert "No space left on device" in line or "disk full" in line.lower(), line
        leftovers = [
            os.path.relpath(os.path.join(d, n), model_dir)
            for d, dirs, files in os.walk(model_dir)
            for n in dirs + files
            if ORBAX_TMP in n
        ]
        assert not leftovers, f"orbax temporaries left behind: {leftovers}"
        assert not os.path.exists(os.path.join(model_dir, f"checkpoint_{STEPS + 2}"))
        _assert_unchanged(before, model_dir)  # checkpoint_6 (and all before it) intact


# --- read-only MODEL_DIR -------------------------------------------------------------------


@pytest.fixture
def read_only_model(model_dir, tmp_path):
    """The test's copy of the model seen through a read-only bind mount: (path, source)."""
    with fault_mounts.read_only_view(model_dir, tmp_path / "read_only") as path:
        yield path, model_dir


def test_train_on_a_read_only_model_dir_is_one_line_exit_2_before_any_work(read_only_model):
    path, source = read_only_model
    before = file_digests(source)
    run = t5tpu("train", *TRAIN, f"--gin.TRAIN_STEPS={STEPS + 2}", model_dir=path)
    line = _error_line(run)
    assert path in line, line
    assert "training steps" not in run.stdout and "resuming from" not in run.stdout, run.stdout
    _assert_nothing_written(before, source)


OUTPUT_DIR_MACRO = {"eval": "EVAL_OUTPUT_DIR", "infer": "INFER_OUTPUT_DIR"}


@pytest.mark.parametrize("command", ["eval", "infer"])
def test_eval_and_infer_on_a_read_only_model_dir_write_to_the_output_dir(
    command, read_only_model, tmp_path
):
    path, source = read_only_model
    before = file_digests(source)
    out = tmp_path / "out"
    args = [*LATEST_RUNS[command], f"--gin.{OUTPUT_DIR_MACRO[command]}='{out}'"]
    run = t5tpu(command, *args, model_dir=path)
    assert run.returncode == 0, run.stderr[-3000:]
    _assert_short_stderr(run)
    if command == "eval":
        results = [read_json(p) for p in out.rglob("*metrics.json")]
        assert any(str(STEPS) in r for r in results), sorted(map(str, out.rglob("*")))
    else:
        results = [read_jsonl(p) for p in out.rglob("*.jsonl")]
        assert any(len(rows) == 3 for rows in results), sorted(map(str, out.rglob("*")))
    _assert_nothing_written(before, source)


@pytest.mark.parametrize("command", ["eval", "infer"])
def test_eval_and_infer_on_a_read_only_model_dir_without_output_dir_are_one_line_exit_2(
    command, read_only_model
):
    path, source = read_only_model
    before = file_digests(source)
    run = t5tpu(command, *LATEST_RUNS[command], model_dir=path)
    line = _error_line(run)
    assert path in line, line
    assert "eval at step" not in run.stdout and "wrote" not in run.stdout, run.stdout
    _assert_nothing_written(before, source)


# --- binary input files --------------------------------------------------------------------


def _binary_file(path: pathlib.Path) -> str:
    path.write_bytes(os.urandom(4096) + b"\xff\xfe\n\xc3\x28")  # never valid UTF-8
    return str(path)


def test_a_binary_infer_input_file_is_one_line_exit_2(model_dir, tmp_path):
    binary = _binary_file(tmp_path / "inputs.txt")
    before = file_digests(model_dir)
    run = t5tpu("infer", *INFER, f"--gin.INFER_INPUT_FILE='{binary}'", model_dir=model_dir)
    line = _error_line(run)
    assert binary in line or "INFER_INPUT_FILE" in line, line
    _assert_nothing_written(before, model_dir)


def test_a_binary_file_given_to_prepare_quora_is_one_line_exit_2(tmp_path):
    binary = _binary_file(tmp_path / "train.csv")
    output_dir = tmp_path / "quora"
    run = t5tpu("prepare-quora", f"--input={binary}", f"--output_dir={output_dir}")
    line = _error_line(run)
    assert binary in line or "--input" in line, line
    assert not output_dir.exists(), sorted(map(str, output_dir.rglob("*")))


# --- bad macro values ----------------------------------------------------------------------

BAD_VALUES = {
    "LEARNING_RATE='fast'": ("LEARNING_RATE", "--gin.LEARNING_RATE='fast'"),
    "LEARNING_RATE=-1": ("LEARNING_RATE", "--gin.LEARNING_RATE=-1"),
    "TRAIN_STEPS=-5": ("TRAIN_STEPS", "--gin.TRAIN_STEPS=-5"),
    "BATCH_SIZE=0": ("BATCH_SIZE", "--gin.BATCH_SIZE=0"),
    "DROPOUT_RATE=1.5": ("DROPOUT_RATE", "--gin.DROPOUT_RATE=1.5"),
    "TASK_FEATURE_LENGTHS with 0": (
        "TASK_FEATURE_LENGTHS",
        "--gin.TASK_FEATURE_LENGTHS={'inputs': 0, 'targets': 4}",
    ),
}


@pytest.mark.parametrize("case", list(BAD_VALUES))
def test_a_bad_macro_value_is_one_line_naming_it_exit_2(case, model_dir):
    macro, flag = BAD_VALUES[case]
    before = file_digests(model_dir)
    # A resume with steps left to train: a run that takes the value trains and saves.
    run = t5tpu("train", *TRAIN, f"--gin.TRAIN_STEPS={STEPS + 2}", flag, model_dir=model_dir)
    line = _error_line(run)
    assert macro in line, line
    _assert_nothing_written(before, model_dir)


# --- overlong infer input ------------------------------------------------------------------

LONG = 100_000  # characters in an input line, far beyond TASK_FEATURE_LENGTHS['inputs'] (96)


def _long_inputs(tmp_path) -> str:
    """examples/questions.txt's three inputs and two of LONG characters."""
    words = "is duplicate: " + "how do i learn python quickly " * (LONG // 30 + 1)
    long_line = words[:LONG]
    lines = pathlib.Path(QUESTIONS).read_text().splitlines()
    path = tmp_path / "long.txt"
    path.write_text("\n".join([lines[0], long_line, lines[1], long_line, lines[2]]) + "\n")
    return str(path)


def test_overlong_infer_inputs_are_truncated_with_one_warning_saying_how_many(model_dir, tmp_path):
    inputs = _long_inputs(tmp_path)
    run = t5tpu("infer", *INFER, f"--gin.INFER_INPUT_FILE='{inputs}'", model_dir=model_dir)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = _assert_short_stderr(run)
    warnings = [line for line in lines if re.search("truncat", line, re.I)]
    assert len(warnings) == 1, run.stderr
    assert re.search(r"(?<![\d.,])2(?![\d.,])", warnings[0]), warnings[0]  # how many
    rows = read_jsonl(os.path.join(model_dir, "inference", f"long-{STEPS}.jsonl"))
    assert len(rows) == 5


def test_overlong_infer_inputs_with_infer_truncation_error_are_one_line_exit_2(model_dir, tmp_path):
    inputs = _long_inputs(tmp_path)
    before = file_digests(model_dir)
    run = t5tpu(
        "infer",
        *INFER,
        f"--gin.INFER_INPUT_FILE='{inputs}'",
        "--gin.INFER_TRUNCATION='error'",
        model_dir=model_dir,
    )
    line = _error_line(run)
    assert re.search(r"truncat|too long|longer|96|TASK_FEATURE_LENGTHS", line, re.I), line
    _assert_nothing_written(before, model_dir)


# --- convert from a checkpoint without its data --------------------------------------------


def test_convert_to_hf_of_a_checkpoint_missing_its_params_data_is_one_line_exit_2(
    model_dir, tmp_path
):
    params = pathlib.Path(model_dir, NEWEST, "params")
    data = [p for p in params.rglob("*") if p.is_file() and p.parent.name == "d"]
    assert data, sorted(map(str, params.rglob("*")))
    for path in data:  # an interrupted copy: metadata there, arrays not
        path.unlink()
    before = file_digests(model_dir)
    output_dir = tmp_path / "hf"
    run = t5tpu("convert", "--to=hf", f"--input={model_dir}/{NEWEST}", f"--output_dir={output_dir}")
    line = _error_line(run)
    assert NEWEST in line, line
    assert not output_dir.exists() or not any(output_dir.iterdir())
    _assert_nothing_written(before, model_dir)


# --- two training runs on one MODEL_DIR ----------------------------------------------------

SECOND_RUN_LIMIT_S = 30  # from its start to its exit: refused at once, not after a first step


class _Lines:
    """A process's stdout, read on a thread (so it never blocks on a full pipe), with a wait for
    a line that starts with some text."""

    def __init__(self, proc: subprocess.Popen):
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._thread.start()

    def _read(self, proc):
        for line in proc.stdout:
            with self._changed:
                self.lines.append(line)
                self._changed.notify_all()
        with self._changed:
            self.lines.append(None)  # end of output
            self._changed.notify_all()

    def wait_for(self, start: str, timeout: float) -> bool:
        def seen():
            return any(line is None or line.startswith(start) for line in self.lines)

        with self._changed:
            self._changed.wait_for(seen, timeout=timeout)
            return any(line is not None and line.startswith(start) for line in self.lines)

    def text(self) -> str:
        self._thread.join(timeout=30)
        return "".join(line for line in self.lines if line is not None)


def test_a_second_train_on_one_model_dir_is_refused_and_eval_beside_it_works(model_dir, tmp_path):
    before = file_digests(model_dir)
    # Far more steps than the test waits for, no save until SIGTERM ends it with one.
    args = ["train", *TRAIN, "--gin.TRAIN_STEPS=100000", "--gin.SAVE_PERIOD=100000"]
    args.append(f"--gin.MODEL_DIR='{model_dir}'")
    argv = cli_command(*args)
    first_err = open(tmp_path / "first.stderr", "w+")  # noqa: SIM115 (closed in finally)
    first = start(*args, stderr=first_err)
    second = None
    try:
        first_out = _Lines(first)
        assert first_out.wait_for("training steps", timeout=180), (
            first_out.text() + (tmp_path / "first.stderr").read_text()[-3000:]
        )

        started = time.time()
        second = start(*args)
        try:
            second_out, second_err = second.communicate(timeout=SECOND_RUN_LIMIT_S + 15)
            second_took = time.time() - started
        except subprocess.TimeoutExpired:
            second.kill()
            second_out, second_err = second.communicate()
            second_took = None
        second_run = subprocess.CompletedProcess(argv, second.returncode, second_out, second_err)

        # eval takes no lock: it reads the checkpoints beside the running training.
        eval_run = t5tpu("eval", *EVAL, model_dir=model_dir, timeout=300)

        first.send_signal(signal.SIGTERM)  # stops with a checkpoint at its current step
        first_code = first.wait(timeout=300)
        first_stdout = first_out.text()
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        first_err.close()
    first_stderr = (tmp_path / "first.stderr").read_text()

    assert second_took is not None, (
        f"the second train was still running after {SECOND_RUN_LIMIT_S + 15} s: "
        f"{second_out[-1500:]}"
    )
    assert second_took <= SECOND_RUN_LIMIT_S, f"refused only after {second_took:.0f} s"
    line = _error_line(second_run)
    assert str(first.pid) in line and socket.gethostname() in line, line
    assert "training steps" not in second_out, second_out

    assert eval_run.returncode == 0, eval_run.stderr[-3000:]
    _assert_short_stderr(eval_run)
    assert str(STEPS) in read_json(os.path.join(model_dir, "eval_metrics.json"))

    assert first_code == 0, first_stderr[-3000:]
    assert TRACEBACK not in first_stderr, first_stderr[-3000:]
    assert "SIGTERM: saved checkpoint_" in first_stdout, first_stdout[-3000:]
    _assert_complete_checkpoints(model_dir)
    checkpoints_before = {p: d for p, d in before.items() if p.startswith("checkpoint_")}
    _assert_unchanged(checkpoints_before, model_dir)
    leftovers = [n for n in os.listdir(model_dir) if "lock" in n.lower()]
    assert not leftovers, f"the first run left {leftovers}"


# --- failed eval / infer keep the configs of earlier runs ----------------------------------

FAILING_RUNS = {
    "eval with NUM_BEAMS=0": ("eval", [*EVAL, "--gin.NUM_BEAMS=0"], "eval_config.gin"),
    "infer with a missing INFER_INPUT_FILE": (
        "infer",
        [*INFER, "--gin.INFER_INPUT_FILE='/no/such/inputs.txt'"],
        "infer_config.gin",
    ),
    # Fails while reading the parameters, after everything else was checked.
    "infer of a damaged step named explicitly": (
        "infer",
        [*INFER, f"--gin.CHECKPOINT_STEP={STEPS}"],
        "infer_config.gin",
    ),
}


@pytest.mark.parametrize("case", list(FAILING_RUNS))
def test_a_failed_eval_or_infer_keeps_the_config_of_the_earlier_run(case, model_dir):
    command, args, config = FAILING_RUNS[case]
    if "damaged" in case:
        _damage(model_dir, "params_file_truncated")
    before = file_digests(model_dir)
    assert config in before
    run = t5tpu(command, *args, model_dir=model_dir)
    _error_line(run)
    after = file_digests(model_dir)
    assert after.get(config) == before[config], f"{config} was replaced by the failed run"
    _assert_nothing_written(before, model_dir)
