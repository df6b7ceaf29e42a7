"""The t5tpu command line: `t5tpu SUBCOMMAND --gin_file=... [--gin.NAME=VALUE ...]`.

Flags are T5X's: --gin_file (repeatable), --gin_bindings (repeatable), --gin.NAME=VALUE as a
shorthand for --gin_bindings='NAME = VALUE', and --gin_search_paths. The subcommand picks the
runner; gin supplies every argument of it.
"""

from __future__ import annotations

import os
import sys

from absl import app, flags, logging

from t5tpu.cli import host_memory
from t5tpu.errors import UserError, one_line_message

# gin subcommands -> (module, runner function); gin supplies every argument.
RUNNERS = {
    "train": ("t5tpu.runners.train", "train"),
    "eval": ("t5tpu.runners.evaluate", "evaluate"),
    "infer": ("t5tpu.runners.infer", "infer"),
    "plan": ("t5tpu.runners.plan", "plan"),
}
# Helper subcommands with their own argparse flags -> (module, function(argv) -> exit code).
TOOLS = {
    "prepare-quora": ("t5tpu.data.quora_csv", "main"),
    "convert": ("t5tpu.formats.convert", "main"),
    "bench": ("t5tpu.tools.bench", "main"),
}
USAGE = (
    f"usage: t5tpu {{{','.join(RUNNERS)}}} --gin_file=FILE [--gin.NAME=VALUE ...] | "
    f"t5tpu {{{','.join(TOOLS)}}} --help"
)

flags.DEFINE_multi_string("gin_file", [], "gin config files, parsed in order.")
flags.DEFINE_multi_string("gin_bindings", [], "gin bindings, applied after the files.")
flags.DEFINE_list("gin_search_paths", [], "Extra directories to resolve --gin_file and includes.")
flags.DEFINE_string(
    "coordinator_address", None, "host:port of process 0, for multi-process runs off Cloud TPU."
)
flags.DEFINE_integer("num_processes", None, "Number of processes (with --coordinator_address).")
flags.DEFINE_integer("process_id", None, "This process's id (with --coordinator_address).")


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


def fail(message: str) -> None:
    print(f"t5tpu: error: {message}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    # os._exit, not sys.exit: nothing is being written at this point, and interpreter teardown
    # would let orbax's and TensorFlow's background threads print tracebacks after our line.
    os._exit(2)


def interrupted() -> None:
    """Ctrl-C: one line instead of a traceback. Checkpoints and result files are written to
    temporary names and renamed, so whatever was cut short leaves nothing half-written."""
    print(
        "\nt5tpu: interrupted; what was saved is complete, rerun the same command to continue "
        "(to stop training with a checkpoint at the current step, send SIGTERM instead)",
        file=sys.stderr,
    )
    sys.stderr.flush()
    os._exit(130)  # 128 + SIGINT, as a shell reports it


def parse_flags(argv: list[str]) -> list[str]:
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        fail(f"{e}. {USAGE}")


def _import_tensorflow_quietly() -> None:
    """TensorFlow (used only for input pipelines) prints CUDA-probing lines from C++ at import,
    which TF_CPP_MIN_LOG_LEVEL no longer silences; mute file descriptor 2 while it loads.
    An import error still raises normally once stderr is back."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        import tensorflow as tf

        tf.config.set_visible_devices([], "GPU")  # leave accelerators to JAX
    finally:
        os.dup2(saved, 2)
        os.close(devnull)
        os.close(saved)


# Compiled programs are kept on disk, so a restarted run or a second command reuses them instead
# of compiling again. T5TPU_COMPILATION_CACHE names the directory ('off' disables it); JAX's own
# JAX_COMPILATION_CACHE_DIR, when set, wins.
COMPILATION_CACHE_ENV = "T5TPU_COMPILATION_CACHE"
DEFAULT_COMPILATION_CACHE = os.path.join("~", ".cache", "t5tpu", "jax")


def _enable_compilation_cache() -> None:
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return
    directory = os.environ.get(COMPILATION_CACHE_ENV, DEFAULT_COMPILATION_CACHE)
    if directory.strip().lower() in ("", "off", "none", "0", "false"):
        return
    import jax

    jax.config.update("jax_compilation_cache_dir", os.path.expanduser(directory))


def _initialize_distributed() -> None:
    import jax

    if flags.FLAGS.coordinator_address:
        jax.distributed.initialize(
            flags.FLAGS.coordinator_address, flags.FLAGS.num_processes, flags.FLAGS.process_id
        )
    elif _cloud_tpu_hosts() > 1:
        # A pod slice: every worker runs this same command; jax finds the coordinator and this
        # worker's process id from the TPU environment.
        jax.distributed.initialize()


def _cloud_tpu_hosts() -> int:
    """Hosts in this Cloud TPU slice as its worker environment lists them (0 off Cloud TPU)."""
    hosts = os.environ.get("TPU_WORKER_HOSTNAMES") or os.environ.get("TPU_PROCESS_ADDRESSES", "")
    slices = int(os.environ.get("MEGASCALE_NUM_SLICES", "1") or 1)
    return len([h for h in hosts.split(",") if h.strip()]) * slices


def main(argv: list[str]) -> None:
    if len(argv) != 2 or argv[1] not in RUNNERS:
        given = " ".join(argv[1:]) or "nothing"
        fail(f"expected one subcommand of {', '.join([*RUNNERS, *TOOLS])}, got {given}. {USAGE}")
    import importlib

    _import_tensorflow_quietly()
    if argv[1] != "plan":
        # plan's compiles are measured, never run: an executable for compile-only TPU devices
        # cannot be loaded back from the cache, and a pod slice's is large.
        _enable_compilation_cache()
    from t5tpu import gin_setup

    try:
        _initialize_distributed()
        gin_setup.parse(
            flags.FLAGS.gin_file, flags.FLAGS.gin_bindings, flags.FLAGS.gin_search_paths
        )
        module_name, function_name = RUNNERS[argv[1]]
        runner = getattr(importlib.import_module(module_name), function_name)
        runner()
    except UserError as e:
        fail(one_line_message(e))
    except KeyboardInterrupt:
        interrupted()
    except RuntimeError as e:
        # gin reports a configurable's unbound gin.REQUIRED argument when it is called.
        message = one_line_message(e)
        if message.startswith("Required bindings"):
            fail(f"{message} Bind it in a gin file or with --gin.NAME=VALUE")
        raise


def run_tool(name: str, argv: list[str]) -> None:
    """Runs a helper subcommand; it parses its own flags (argparse exits 2 on bad ones)."""
    import importlib

    _import_tensorflow_quietly()
    _enable_compilation_cache()
    module_name, function_name = TOOLS[name]
    try:
        code = getattr(importlib.import_module(module_name), function_name)(argv)
    except UserError as e:
        fail(one_line_message(e))
    except KeyboardInterrupt:
        interrupted()
    sys.exit(code or 0)


def print_help() -> None:
    # absl's own --help describes the console-script wrapper, not t5tpu, and exits 1.
    print(__doc__.strip(), USAGE, sep="\n\n")
    print(f"\ngin subcommands: {', '.join(RUNNERS)}; tools: {', '.join(TOOLS)}")
    print(flags.FLAGS.module_help(sys.modules[__name__]))


def run() -> None:
    """Console-script entry point."""
    host_memory.keep_freed_memory()  # before jax or TensorFlow start their threads
    # Our progress and results are printed; orbax, seqio and gin log routine notes as warnings
    # and errors (gin logs every search path it tries), so only fatal library logs show.
    logging.set_verbosity(logging.FATAL)
    if len(sys.argv) > 1 and sys.argv[1] in TOOLS:
        run_tool(sys.argv[1], sys.argv[2:])
    if {"-h", "--help", "--helpshort", "help"} & set(sys.argv[1:]):
        print_help()
        sys.exit(0)
    app.run(main, argv=rewrite_gin_shorthand(sys.argv), flags_parser=parse_flags)


if __name__ == "__main__":
    run()
