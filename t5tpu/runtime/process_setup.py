"""What a command's process needs before its code runs: TensorFlow loaded without its start-up
noise, JAX's on-disk compilation cache, and the processes of a multi-host run joined.

Each step imports what it sets up, so a command that was only asked for --help never pays for it.
"""

from __future__ import annotations

import os

from t5tpu.runtime import compilation_cache, lazy_imports


def import_tensorflow_quietly() -> None:
    """TensorFlow loaded now, without its start-up noise (lazy_imports.py), for a command that
    reads inputs or files through it: before jax starts its threads, as it always was."""
    lazy_imports.import_tensorflow_quietly()


def enable_compilation_cache() -> None:
    """Compiled programs kept on disk, so a second command or a restarted run loads them
    instead of compiling again (compilation_cache.py says where and how to turn it off)."""
    compilation_cache.enable()


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
