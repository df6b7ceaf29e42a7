"""The processes of a multi-host run joined before a command's work starts: given a coordinator
(--coordinator_address and friends), or found from a Cloud TPU pod slice's environment."""

from __future__ import annotations

import os


def initialize_distributed(
    *, coordinator_address: str | None, num_processes: int | None, process_id: int | None
) -> None:
    import jax  # here: a command asked only for --help never imports it

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
