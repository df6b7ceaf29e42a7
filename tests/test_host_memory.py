"""host_memory.keep_freed_memory: a large block freed by a worker thread is reused, not unmapped
and faulted in again, in the processes of commands that train (the others keep glibc's
per-thread heaps, where XLA compiles faster). Each case runs in a fresh interpreter, since the
settings are per process and must precede the threads."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A worker thread (as XLA's are) allocates and frees a 100 MiB block three times and reports the
# page faults each allocation took.
SCRIPT = """
import resource, sys, threading
import numpy as np
from t5tpu.cli import main
from t5tpu.runtime import host_memory

if main.trains(sys.argv[1:]):  # as `t5tpu` given this command line decides
    assert host_memory.keep_freed_memory()

def allocate_three_times(faults):
    for _ in range(3):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        block = np.ones(100 * 2**20 // 8)
        del block
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)

faults = []
worker = threading.Thread(target=allocate_three_times, args=(faults,))
worker.start()
worker.join()
print(*faults)
"""


def page_faults_per_allocation(*command_line: str) -> list[int]:
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, *command_line],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    return [int(n) for n in run.stdout.split()]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt is Linux-only")
@pytest.mark.parametrize(
    "command_line", [("train", "--gin_file=a.gin"), ("--gin_file=a.gin", "train"), ("bench",)]
)
def test_freed_block_is_reused_without_page_faults(command_line):
    assert page_faults_per_allocation(*command_line)[1:] == [0, 0]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt is Linux-only")
@pytest.mark.parametrize("command_line", [("serve", "--model=m"), ("infer",), ("eval",), ()])
def test_without_the_settings_every_allocation_faults_again(command_line):
    # The behaviour the settings remove, so the test above can tell them apart.
    assert all(n > 0 for n in page_faults_per_allocation(*command_line)[1:])
