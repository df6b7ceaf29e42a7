"""A process that has imported what every `t5tpu` command imports (TensorFlow, seqio, jax, flax,
orbax, the runners) and forks a child per command line, so that the tests' hundreds of command
runs skip ~5 s of imports each. cli_runs.t5tpu starts one per pytest worker.

A child is the command as `python -m t5tpu.cli.main ARGS` runs it, in a process of its own: its
own stdout and stderr files, working directory, exit code, and jax backend (the zygote never
starts one, so nothing but this thread is forked). Runs that depend on how a process starts
(its environment at import, what TensorFlow prints while importing) use real processes.

Protocol, one JSON object a line: requests {"id", "argv", "cwd", "env", "stdout", "stderr"} on
stdin (stdout and stderr are paths: files, FIFOs the caller reads, or /dev/null); answers
{"id", "pid"} once forked, then {"id", "returncode"}, on stdout. Commands run side by side
(the processes of one multi-process run, a second writer): each has a monitor process that
forks it, waits for it and answers for it.
"""

from __future__ import annotations

import json
import os
import signal
import sys


def _preload() -> None:
    from t5tpu.runtime import host_memory, lazy_imports

    # Before any thread starts, as the CLI does for commands that train: it only keeps freed
    # memory in the process, and a child could not apply it after the imports.
    host_memory.keep_freed_memory()
    lazy_imports.quiet_tensorflow_imports()
    import seqio  # noqa: F401  (imports TensorFlow)

    import t5tpu.cli.main  # noqa: F401
    import t5tpu.runners.evaluate  # noqa: F401
    import t5tpu.runners.infer  # noqa: F401
    import t5tpu.runners.train  # noqa: F401


def _become(request: dict) -> None:
    """In the child: the command's files, directory and argv, then the CLI as `python -m`."""
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.path[0] = request["cwd"]  # as `python -m` puts the working directory first
    # As an interpreter started from a terminal: Ctrl-C raises KeyboardInterrupt.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(out, fd)
        os.close(out)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    import t5tpu.cli.main

    sys.argv = [t5tpu.cli.main.__file__, *request["argv"]]
    t5tpu.cli.main.run()


def serve() -> dict | None:
    """Answers requests until stdin closes; returns the request in a forked command."""
    requests = os.fdopen(os.dup(0), "r")
    answers = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # the commands' fds 1 and 2 are their own files
    os.close(devnull)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the monitors
    for line in requests:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        if os.fork() == 0:
            requests.close()
            if _monitor(request, answers):
                os.close(answers)
                return request
    return None


def _monitor(request: dict, answers: int) -> bool:
    """In the monitor: forks the command (True in it), answers its pid, waits for it, answers
    its exit code and exits."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # to wait for the command
    pid = os.fork()
    if pid == 0:
        return True

    def answer(**fields):  # one write a line: the monitors share the pipe
        os.write(answers, (json.dumps({"id": request["id"], **fields}) + "\n").encode())

    answer(pid=pid)
    _, status = os.waitpid(pid, 0)
    answer(returncode=os.waitstatus_to_exitcode(status))
    os._exit(0)


if __name__ == "__main__":
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout
    _preload()
    child_request = serve()
    if child_request is not None:
        _become(child_request)
