"""The t5tpu command line: `t5tpu COMMAND [FLAGS]`, dispatched through the command table.

The gin commands (train, eval, infer, prepare-data, plan) take T5X's flags (--gin_file,
--gin.NAME=VALUE, ...) and run a runner whose every argument gin supplies; the tools parse their
own flags. Help and bad flags are answered before jax, TensorFlow or seqio is imported, so they
answer at once.
"""

from __future__ import annotations

import atexit
import contextlib
import logging as std_logging
import os
import sys
import threading

from absl import app, flags, logging

from t5tpu.cli import commands, gin_flags, help_text
from t5tpu.errors import EnvironmentFault, UserError, environment_fault, one_line_message
from t5tpu.runtime import host_memory, lazy_imports, multihost
from t5tpu.storage import compilation_cache

HELP_WORDS = frozenset({"-h", "--help", "--helpshort", "help"})
# Exit codes: the user's input (fix it and rerun) versus the machine (a full disk, a failing
# device: the input was fine).
USER_INPUT, ENVIRONMENT = 2, 1


def fail(message: str, code: int = USER_INPUT) -> None:
    print(f"t5tpu: error: {message}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    # os._exit, not sys.exit: nothing is being written at this point, and interpreter teardown
    # would let orbax's and TensorFlow's background threads print tracebacks after our line.
    os._exit(code)


def interrupted(training: bool) -> None:
    """Ctrl-C: one line instead of a traceback. Checkpoints and result files are written to
    temporary names and renamed, so whatever was cut short leaves nothing half-written."""
    line = "\nt5tpu: interrupted; what was saved is complete, rerun the same command to continue"
    if training:
        line += " (to stop training with a checkpoint at the current step, send SIGTERM instead)"
    print(line, file=sys.stderr)
    sys.stderr.flush()
    os._exit(130)  # 128 + SIGINT, as a shell reports it


def parse_flags(argv: list[str]) -> list[str]:
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        fail(f"{e}. {commands.USAGE}")


def main(argv: list[str]) -> None:
    """Runs the gin command named by what absl left of the command line."""
    command = commands.GIN_COMMANDS.get(argv[1]) if len(argv) == 2 else None
    if command is None:
        fail(commands.unknown_command(argv[1:]))
    if command.compilation_cache:
        compilation_cache.enable()
    from t5tpu.config import gin_setup

    try:
        multihost.initialize_distributed(
            coordinator_address=gin_flags.COORDINATOR_ADDRESS.value,
            num_processes=gin_flags.NUM_PROCESSES.value,
            process_id=gin_flags.PROCESS_ID.value,
        )
        gin_files = gin_flags.GIN_FILE.value
        gin_setup.parse(
            # No --gin_file stays an error: defaults alone describe no run.
            gin_files=[*command.defaults_files, *gin_files] if gin_files else [],
            bindings=gin_flags.GIN_BINDINGS.value,
            search_paths=gin_flags.GIN_SEARCH_PATHS.value,
        )
        # A run from a prepared file (PREPARED_DATA) reads no task: TensorFlow stays out, as
        # on a machine that lacks it. Else it is loaded now, quietly, as the task will need it.
        if command.tensorflow and not gin_setup.bound_value("%PREPARED_DATA"):
            lazy_imports.import_tensorflow_quietly()
        command.load_runner()()
    except UserError as e:
        fail(one_line_message(e))
    except KeyboardInterrupt:
        interrupted(training=command.trains)
    except RuntimeError as e:
        # gin reports a configurable's unbound gin.REQUIRED argument when it is called.
        message = one_line_message(e)
        if message.startswith("Required bindings"):
            fail(f"{message} Bind it in a gin file or with --gin.NAME=VALUE")
        raise
    except (EnvironmentFault, OSError) as e:
        fault = environment_fault(e)
        if fault is None:
            raise
        fail(one_line_message(fault), ENVIRONMENT)


def run_tool(command: commands.ToolCommand, argv: list[str]) -> None:
    """Parses a tool's flags (argparse prints its --help and exits 0 here), then sets the
    process up for it and runs it."""
    try:
        args = command.module.parse_args(argv)
        if command.tensorflow:
            lazy_imports.import_tensorflow_quietly()
        if command.compilation_cache:
            compilation_cache.enable()
        code = command.module.run(args)
    except UserError as e:
        fail(one_line_message(e))
    except KeyboardInterrupt:
        interrupted(training=command.trains)
    except (EnvironmentFault, OSError) as e:
        fault = environment_fault(e)
        if fault is None:
            raise
        fail(one_line_message(fault), ENVIRONMENT)
    sys.exit(code or 0)


def print_help(words: list[str]) -> None:
    """`t5tpu --help` or `t5tpu help`: every command; `t5tpu help COMMAND` or
    `t5tpu COMMAND --help`: that command's own help."""
    if words[0] == "help":
        named = next((w for w in words[1:] if not w.startswith("-")), None)
    elif not words[0].startswith("-"):
        named = words[0]
    else:  # flags first
        named = first_command_word(words)
    if named is None or named == "help":
        print(help_text.overview())
        return
    command = commands.find(named)
    if command is None:
        fail(commands.unknown_command(words))
    if isinstance(command, commands.ToolCommand):
        command.module.parser().print_help()
    else:
        print(help_text.gin_command(command))


def first_command_word(words: list[str]) -> str | None:
    """The first word naming a command, if any (absl takes flags anywhere, before it too)."""
    return next((w for w in words if commands.find(w)), None)


def trains(words: list[str]) -> bool:
    """Whether the command line runs train steps."""
    word = first_command_word(words)
    return word is not None and commands.find(word).trains


def finish(code) -> None:
    """Exits as sys.exit(code) does once the work is written, but skips the interpreter's
    teardown (freeing TensorFlow's and XLA's modules: 1-2 s after every command). As at a
    normal exit, other threads are joined and the atexit handlers (orbax, jax.distributed,
    absl) run first."""
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    status = code or 0
    if not isinstance(status, int):  # sys.exit("message")
        print(status, file=sys.stderr)
        status = 1
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe or stream
            stream.flush()
    os._exit(status)


def run() -> None:
    """Console-script entry point: the command, then the process's exit."""
    try:
        dispatch()
    except SystemExit as done:
        finish(done.code)


def dispatch() -> None:
    """Runs the command sys.argv names; ends in SystemExit as sys.exit does (help, a tool, or
    a gin command's end), or in os._exit with a one-line error."""
    words = sys.argv[1:]
    if trains(words):
        host_memory.keep_freed_memory()  # before jax or TensorFlow start their threads
    # Whoever imports TensorFlow first (seqio, etils' gs:// client), it prints nothing.
    lazy_imports.quiet_tensorflow_imports()
    # Our progress and results are printed; orbax, seqio and gin log routine notes as warnings
    # and errors (gin logs every search path it tries), so only fatal library logs show.
    logging.set_verbosity(logging.FATAL)
    # Before absl's app starts (the helper commands, `t5tpu serve` among them, run without it),
    # Python's root logger, which gin logs to, would print through its last-resort handler.
    std_logging.getLogger().setLevel(std_logging.CRITICAL)
    if words and words[0] in commands.TOOLS:
        run_tool(commands.TOOLS[words[0]], words[1:])
    if HELP_WORDS & set(words):
        print_help(words)
        sys.exit(0)
    app.run(main, argv=gin_flags.rewrite_gin_shorthand(sys.argv), flags_parser=parse_flags)


if __name__ == "__main__":
    run()
