"""T5X's flags for the gin commands, and its --gin.NAME=VALUE shorthand.

absl parses them, as in T5X, so that T5X command lines work unchanged. Their help strings here are
also what `t5tpu --help` and `t5tpu train --help` print.
"""

from __future__ import annotations

from absl import flags

# (flag as help writes it, its help): absl appends its own notes to the help of repeatable
# flags, so help prints these rather than absl's.
_GIN_FILE = (
    "--gin_file=FILE",
    "a gin file; repeat it for several, parsed in order (configs/... resolves from any "
    "directory: t5tpu ships them)",
)
_SHORTHAND = (
    "--gin.NAME=VALUE",
    "one gin binding, as --gin_bindings='NAME = VALUE' (strings quoted: "
    "--gin.MODEL_DIR=\"'/tmp/x'\"); repeatable",
)
_GIN_BINDINGS = (
    "--gin_bindings='NAME = VALUE'",
    "a gin binding in gin's syntax; repeatable, applied after the files",
)
_GIN_SEARCH_PATHS = (
    "--gin_search_paths=DIR[,DIR...]",
    "more directories to find --gin_file and included files in",
)
_COORDINATOR_ADDRESS = (
    "--coordinator_address=HOST:PORT",
    "host:port of process 0, for multi-process runs off Cloud TPU (a pod slice finds its own)",
)
_NUM_PROCESSES = ("--num_processes=N", "number of processes (with --coordinator_address)")
_PROCESS_ID = ("--process_id=I", "this process's id, 0 to N-1 (with --coordinator_address)")

GIN_FILE = flags.DEFINE_multi_string("gin_file", [], _GIN_FILE[1])
GIN_BINDINGS = flags.DEFINE_multi_string("gin_bindings", [], _GIN_BINDINGS[1])
GIN_SEARCH_PATHS = flags.DEFINE_list("gin_search_paths", [], _GIN_SEARCH_PATHS[1])
COORDINATOR_ADDRESS = flags.DEFINE_string("coordinator_address", None, _COORDINATOR_ADDRESS[1])
NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, _NUM_PROCESSES[1])
PROCESS_ID = flags.DEFINE_integer("process_id", None, _PROCESS_ID[1])
SHORTHAND = _SHORTHAND[0]


def help_rows() -> list[tuple[str, str]]:
    """(flag as written, what it does) for every flag of the gin commands, in the order a user
    needs them."""
    return [
        _GIN_FILE,
        _SHORTHAND,
        _GIN_BINDINGS,
        _GIN_SEARCH_PATHS,
        _COORDINATOR_ADDRESS,
        _NUM_PROCESSES,
        _PROCESS_ID,
    ]


def rewrite_gin_shorthand(argv: list[str]) -> list[str]:
    """--gin.NAME=VALUE -> --gin_bindings=NAME = VALUE (T5X's shorthand)."""
    out = []
    for arg in argv:
        if arg.startswith("--gin.") and "=" in arg:
            name, value = arg[len("--gin.") :].split("=", 1)
            out.append(f"--gin_bindings={name} = {value}")
        else:
            out.append(arg)
    return out
