"""Running the t5tpu command line from the tests: the subprocess runners (one command, or the
processes of one multi-process run), the tiny experiment most of them train, and what they read
back (JSON files, digests of a directory's files).

Plain functions, not fixtures: test_multihost.py's worker processes (its own file run as a
script) import this module too."""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import pathlib
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The data sets beside the checkout (CI clones with ../shared next to it).
SHARED_DATA = os.path.join(ROOT, "..", "shared", "data")
# A 1M-parameter T5 1.1 on the bundled Quora sample: every subcommand runs in seconds on CPU.
TINY_EXPERIMENT = "configs/experiments/qp_is_duplicate_tiny_cpu.gin"
# The steps of train_tiny's run, which conftest.py's `trained_tiny` fixture shares.
TRAINED_TINY_STEPS = 2


def cli_command(*args: str) -> list[str]:
    """`python -m t5tpu.cli.main ARGS` with this interpreter (the checkout's t5tpu)."""
    return [sys.executable, "-m", "t5tpu.cli.main", *args]


def t5tpu(*args, model_dir=None, program=None, cwd=ROOT, env=None, timeout=900, fresh=False):
    """Runs `t5tpu ARGS` (--gin.MODEL_DIR last when model_dir is given) and returns the finished
    process, its output captured as text. By default the checkout's, from the repository root
    (where relative paths such as examples/questions.txt resolve); `program` is another t5tpu
    to run (an installed console script), `cwd` another directory to run it from, `env` another
    environment. The checkout's runs are forked from tests/cli_zygote.py, which has done the
    imports already; `fresh` starts a new interpreter instead, for what a start prints."""
    if model_dir is not None:
        args = (*args, f"--gin.MODEL_DIR='{model_dir}'")
    zygote = None if program or fresh else _Zygote.of_this_process()
    environ = os.environ if env is None else env
    if zygote is not None and zygote.can_run(env=environ):
        return zygote.run(list(args), cwd=str(cwd), env=environ, timeout=timeout)
    argv = [*program, *args] if program else cli_command(*args)
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


class _Zygote:
    """This process's tests/cli_zygote.py, which forks each command from imports done once.
    Used for environments that differ from the one it started with only where no import reads
    them (PYTEST_CURRENT_TEST)."""

    _started: _Zygote | None = None
    _IGNORED = frozenset({"PYTEST_CURRENT_TEST"})

    def __init__(self):
        self.env = dict(os.environ)
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "tests", "cli_zygote.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            bufsize=0,
        )
        self.outputs = tempfile.mkdtemp(prefix="t5tpu-zygote-")
        atexit.register(self.stop)

    @classmethod
    def of_this_process(cls) -> _Zygote | None:
        """The zygote (started at the first call), or None where T5TPU_TEST_FORK=0 asks for a
        fresh process per command."""
        if os.environ.get("T5TPU_TEST_FORK", "1") == "0":
            return None
        if cls._started is None or cls._started.proc.poll() is not None:
            cls._started = cls()
        return cls._started

    def can_run(self, env) -> bool:
        def imported(environ):
            return {k: v for k, v in environ.items() if k not in self._IGNORED}

        return imported(env) == imported(self.env)

    def run(self, args: list[str], cwd: str, env, timeout: float) -> subprocess.CompletedProcess:
        stdout, stderr = (os.path.join(self.outputs, name) for name in ("stdout", "stderr"))
        request = {"argv": args, "cwd": cwd, "env": dict(env), "stdout": stdout, "stderr": stderr}
        self.proc.stdin.write(json.dumps(request).encode() + b"\n")
        self.proc.stdin.flush()
        pid = self._answer(timeout=60)["pid"]
        try:
            returncode = self._answer(timeout=timeout)["returncode"]
        except subprocess.TimeoutExpired:
            os.kill(pid, signal.SIGKILL)
            self._answer(timeout=60)
            raise subprocess.TimeoutExpired(cli_command(*args), timeout) from None
        read = [pathlib.Path(path).read_text(errors="replace") for path in (stdout, stderr)]
        return subprocess.CompletedProcess(cli_command(*args), returncode, *read)

    def _answer(self, timeout: float) -> dict:
        """The zygote's next line, read unbuffered so that select sees what is still to come."""
        line, fd = b"", self.proc.stdout.fileno()
        while not line.endswith(b"\n"):
            if not select.select([fd], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired("cli_zygote", timeout)
            byte = os.read(fd, 1)
            if not byte:
                raise RuntimeError("tests/cli_zygote.py exited")
            line += byte
        return json.loads(line)

    def stop(self):
        self.proc.kill()
        self.proc.wait()
        shutil.rmtree(self.outputs, ignore_errors=True)


def succeeded(run: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    """The run, once it has exited 0 (else its stderr's end is the failure message)."""
    assert run.returncode == 0, run.stderr[-3000:]
    return run


# C++ log lines of TensorFlow, absl or XLA (glog's "I0000 00:00:..." prefix) and the notices
# TensorFlow prints at import: no t5tpu command, nor t5tpu's Python API, lets one reach stderr.
FOREIGN_LOG = re.compile(
    r"^[IWEF]\d{4} \d\d:\d\d:\d\d|oneDNN|cuInit|cudart|cuDNN|cuBLAS|absl::InitializeLog"
    r"|tensorflow/(core|tsl|compiler)|\.cc:\d+\]"
)


def foreign_log_lines(stderr: str) -> list[str]:
    """The lines of `stderr` that TensorFlow's or absl's C++ logging wrote (FOREIGN_LOG)."""
    return [line for line in stderr.splitlines() if FOREIGN_LOG.search(line)]


def run_together(argvs: list[list[str]], env=None, timeout=600) -> list:
    """Starts every command at once (the processes of one multi-process run) and waits for each
    in turn; after one that fails, the rest are killed, not waited for (they may wait for it
    forever), and the list ends with the failed one."""
    procs = [
        subprocess.Popen(
            argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for argv in argvs
    ]
    done = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
            if proc.returncode != 0:
                break
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return done


def free_port() -> int:
    """A TCP port free on localhost now, for a jax.distributed coordinator."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def quick_training(steps: int) -> list[str]:
    """Flags for `steps` training steps of batch 8 and a checkpoint at the last: something to
    evaluate or decode with, in little more than start-up and compile time."""
    return [f"--gin.TRAIN_STEPS={steps}", "--gin.BATCH_SIZE=8", f"--gin.SAVE_PERIOD={steps}"]


def train_tiny(model_dir) -> subprocess.CompletedProcess:
    """Trains the tiny experiment for TRAINED_TINY_STEPS steps (quick_training) into model_dir:
    the run conftest.py's `trained_tiny` fixture shares."""
    flags = quick_training(TRAINED_TINY_STEPS)
    return succeeded(t5tpu("train", f"--gin_file={TINY_EXPERIMENT}", *flags, model_dir=model_dir))


def read_json(path):
    return json.loads(pathlib.Path(path).read_text(encoding="utf-8"))


def read_jsonl(path) -> list:
    """The rows of a JSON-lines file (predictions)."""
    return [json.loads(line) for line in pathlib.Path(path).read_text().splitlines()]


def file_digests(folder, skip_prefixes: tuple[str, ...] = ()) -> dict[str, str]:
    """sha256 of every file under `folder` by its relative path, but files whose names start
    with one of `skip_prefixes`: to show that a command changed nothing there."""
    digests = {}
    for directory, _, files in os.walk(folder):
        for name in files:
            if name.startswith(skip_prefixes):
                continue
            path = os.path.join(directory, name)
            digests[os.path.relpath(path, folder)] = hashlib.sha256(
                pathlib.Path(path).read_bytes()
            ).hexdigest()
    return digests
