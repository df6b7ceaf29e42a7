"""Running the t5tpu command line from the tests: the subprocess runners (one command, or the
processes of one multi-process run), the tiny experiment most of them train, and what they read
back (JSON files, digests of a directory's files).

Plain functions, not fixtures: test_multihost.py's worker processes (its own file run as a
script) import this module too."""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import itertools
import json
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

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
    zygote = None if program or fresh else _Zygote.for_env(env)
    if zygote is not None:
        return zygote.run(list(args), cwd=str(cwd), env=env or os.environ, timeout=timeout)
    argv = [*program, *args] if program else cli_command(*args)
    return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def start(*args, env=None, stderr=subprocess.PIPE):
    """`t5tpu ARGS` started from the repository root and not waited for: what
    subprocess.Popen(cli_command(*args), stdout=PIPE, stderr=stderr, text=True) returns, or
    the same calls on a command forked from the zygote (stderr: PIPE, DEVNULL or an open
    file)."""
    zygote = _Zygote.for_env(env)
    if zygote is not None:
        return zygote.start(list(args), cwd=ROOT, env=env or os.environ, stderr=stderr)
    return subprocess.Popen(
        cli_command(*args),
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        # A shell without job control starts background jobs (`cmd &`, a CI runner's) with
        # SIGINT ignored, and children inherit that: Python then never raises
        # KeyboardInterrupt. Give the command the default, as a terminal would (as the
        # zygote's children have).
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


class _Zygote:
    """This process's tests/cli_zygote.py, which forks each command from imports done once.
    Used for environments that differ from the one it started with only where no import reads
    them (PYTEST_CURRENT_TEST)."""

    _started: _Zygote | None = None
    # Read in the forked command, not by the imports: XLA_FLAGS (fake devices for a
    # multi-process run) when a backend starts; the storage clients' settings (the GCS
    # emulator's, tests/gcs_emulator.py) when a client is made or a bucket asked.
    _IGNORED = frozenset(
        {
            "PYTEST_CURRENT_TEST",
            "XLA_FLAGS",
            "STORAGE_EMULATOR_HOST",
            "EPATH_USE_TF",
            "TENSORSTORE_GCS_HTTP_URL",
            "GOOGLE_AUTH_TOKEN_FOR_TESTING",
            "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT",
            "T5TPU_STORAGE_ANSWER_SECONDS",
        }
    )

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
        self.answers: dict[int, dict] = {}  # by request id: its pid, then its returncode
        self.answered = threading.Condition()
        self.requests = itertools.count()
        threading.Thread(target=self._read_answers, daemon=True).start()
        atexit.register(self.stop)

    @classmethod
    def for_env(cls, env: dict | None) -> _Zygote | None:
        """The zygote (started at the first call) for a command run with `env` (None: this
        process's), or None where a fresh process must run it: T5TPU_TEST_FORK=0, or an
        environment that differs where imports read it."""
        if os.environ.get("T5TPU_TEST_FORK", "1") == "0":
            return None
        if cls._started is None or cls._started.proc.poll() is not None:
            cls._started = cls()
        if cls._imported(os.environ if env is None else env) != cls._imported(cls._started.env):
            return None
        return cls._started

    @classmethod
    def _imported(cls, environ) -> dict:
        return {k: v for k, v in environ.items() if k not in cls._IGNORED}

    def run(self, args: list[str], cwd: str, env, timeout: float) -> subprocess.CompletedProcess:
        command = self._fork(args, cwd, env, stdout=None, stderr=None)
        try:
            returncode = command.wait(timeout)
        except subprocess.TimeoutExpired:
            command.kill()
            command.wait(60)
            raise
        read = [pathlib.Path(path).read_text(errors="replace") for path in command.files]
        for path in command.files:
            os.remove(path)
        return subprocess.CompletedProcess(command.args, returncode, *read)

    def start(self, args: list[str], cwd: str, env, stderr) -> ForkedCommand:
        return self._fork(args, cwd, env, stdout=subprocess.PIPE, stderr=stderr)

    def _fork(self, args, cwd, env, stdout, stderr) -> ForkedCommand:
        """Asks for `args` to be forked; outputs: None (a file read after), PIPE (a FIFO),
        DEVNULL or an open file (its path)."""
        request_id = next(self.requests)
        paths = []
        for name, how in (("stdout", stdout), ("stderr", stderr)):
            path = os.path.join(self.outputs, f"{request_id}.{name}")
            if how == subprocess.PIPE:
                os.mkfifo(path)
            elif how == subprocess.DEVNULL:
                path = os.devnull
            elif how is not None:
                path = how.name
            paths.append(path)
        request = {"id": request_id, "argv": args, "cwd": cwd, "env": dict(env)}
        request |= {"stdout": paths[0], "stderr": paths[1]}
        self.proc.stdin.write(json.dumps(request).encode() + b"\n")
        pid = self.answer(request_id, "pid", timeout=60)
        pipes = []
        for path, how in zip(paths, (stdout, stderr), strict=True):
            pipes.append(open(path) if how == subprocess.PIPE else None)  # noqa: SIM115
            if how == subprocess.PIPE:
                os.remove(path)  # open at both ends now
        return ForkedCommand(self, request_id, cli_command(*args), pid, paths, *pipes)

    def answer(self, request_id: int, key: str, timeout: float | None):
        """The zygote's answer `key` for the request, once given."""
        with self.answered:
            given = self.answered.wait_for(
                lambda: key in self.answers.get(request_id, {}) or self.proc.poll() is not None,
                timeout,
            )
            if key in self.answers.get(request_id, {}):
                return self.answers[request_id][key]
        if not given:
            raise subprocess.TimeoutExpired("cli_zygote", timeout)
        raise RuntimeError("tests/cli_zygote.py exited")

    def _read_answers(self):
        for line in self.proc.stdout:
            answer = json.loads(line)
            with self.answered:
                self.answers.setdefault(answer.pop("id"), {}).update(answer)
                self.answered.notify_all()
        with self.answered:
            self.answered.notify_all()

    def stop(self):
        self.proc.kill()
        self.proc.wait()
        shutil.rmtree(self.outputs, ignore_errors=True)


class ForkedCommand:
    """What tests use of subprocess.Popen, for a command forked from the zygote."""

    def __init__(self, zygote: _Zygote, request_id: int, args, pid: int, files, stdout, stderr):
        self.zygote, self.request_id, self.args, self.pid = zygote, request_id, args, pid
        self.files, self.stdout, self.stderr = files, stdout, stderr
        self.returncode = None
        self._read: dict[str, str] = {}
        self._readers: list[threading.Thread] | None = None

    def poll(self):
        return self.wait(0) if self.returncode is None else self.returncode

    def wait(self, timeout=None):
        if self.returncode is None:
            try:
                self.returncode = self.zygote.answer(self.request_id, "returncode", timeout)
            except subprocess.TimeoutExpired:
                if timeout == 0:
                    return None
                raise subprocess.TimeoutExpired(self.args, timeout) from None
        return self.returncode

    def send_signal(self, sig):
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # exited, not yet answered for
                os.kill(self.pid, sig)

    def kill(self):
        self.send_signal(signal.SIGKILL)

    def terminate(self):
        self.send_signal(signal.SIGTERM)

    def communicate(self, timeout=None):
        """Reads the pipes to their ends (each in a thread, as Popen does), then waits."""
        if self._readers is None:
            self._readers = [
                threading.Thread(target=self._read_all, args=(name, pipe), daemon=True)
                for name, pipe in (("stdout", self.stdout), ("stderr", self.stderr))
                if pipe is not None
            ]
            for reader in self._readers:
                reader.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        for reader in self._readers:
            reader.join(None if deadline is None else max(0, deadline - time.monotonic()))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        if self.wait(remaining) is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._read.get("stdout"), self._read.get("stderr")

    def _read_all(self, name, pipe):
        self._read[name] = pipe.read()
        pipe.close()


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
    forever), and the list ends with the failed one. The checkout's t5tpu commands are forked
    (start)."""
    cli = cli_command()
    procs = [
        start(*argv[len(cli) :], env=env)
        if argv[: len(cli)] == cli
        else subprocess.Popen(
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
