"""What a command's process needs before its code runs: TensorFlow loaded without its start-up
noise, JAX's on-disk compilation cache, and the processes of a multi-host run joined.

Each step imports what it sets up, so a command that was only asked for --help never pays for it.
"""

from __future__ import annotations

import os
import sys

# Compiled programs are kept on disk, so a restarted run or a second command reuses them instead
# of compiling again. T5TPU_COMPILATION_CACHE names the directory ('off' disables it); JAX's own
# JAX_COMPILATION_CACHE_DIR, when set, wins.
COMPILATION_CACHE_ENV = "T5TPU_COMPILATION_CACHE"
DEFAULT_COMPILATION_CACHE = os.path.join("~", ".cache", "t5tpu", "jax")


def import_tensorflow_quietly() -> None:
    """TensorFlow (used only for input pipelines and file access) prints CUDA-probing lines from
    C++ at import, which TF_CPP_MIN_LOG_LEVEL no longer silences; mute file descriptor 2 while it
    loads. An import error still raises normally once stderr is back."""
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


def enable_compilation_cache() -> None:
    if os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return
    directory = os.environ.get(COMPILATION_CACHE_ENV, DEFAULT_COMPILATION_CACHE)
    if directory.strip().lower() in ("", "off", "none", "0", "false"):
        return
    import jax

    jax.config.update("jax_compilation_cache_dir", os.path.expanduser(directory))


def initialize_distributed(
    *, coordinator_address: str | None, num_processes: int | None, process_id: int | None
) -> None:
    import jax

    if coordinator_address:
        jax.distributed.initialize(coordinator_address, num_processes, process_id)
    elif cloud_tpu_hosts() > 1:
        # A pod slice: every worker runs this same command; jax finds the coordinator and this
        # worker's process id from the TPU environment.
        jax.distributed.initialize()


def cloud_tpu_hosts() -> int:
    """Hosts in this Cloud TPU slice as its worker environment lists them (0 off Cloud TPU)."""
    hosts = os.environ.get("TPU_WORKER_HOSTNAMES") or os.environ.get("TPU_PROCESS_ADDRESSES", "")
    slices = int(os.environ.get("MEGASCALE_NUM_SLICES", "1") or 1)
    return len([h for h in hosts.split(",") if h.strip()]) * slices
