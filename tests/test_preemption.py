"""SIGTERM on one host of two (simulated on localhost with jax.distributed) makes both stop at
the same step, through jax's preemption sync point."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SIGNALLED_AT = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def test_sigterm_on_one_host_stops_both_at_the_same_step():
    port = str(_free_port())
    workers = [
        subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), str(pid), port],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for pid in range(2)
    ]
    outputs = [w.communicate(timeout=120) for w in workers]
    for w, (_, stderr) in zip(workers, outputs, strict=True):
        assert w.returncode == 0, stderr[-2000:]
    stops = [int(stdout.split()[-1]) for stdout, _ in outputs]
    assert stops[0] == stops[1] >= SIGNALLED_AT, stops


def _worker(process_id: int, port: str) -> None:
    import jax

    jax.distributed.initialize(f"localhost:{port}", 2, process_id)
    from t5tpu.preemption import PreemptionWatch

    watch = PreemptionWatch()
    for step in range(1, 200):
        if process_id == 1 and step == SIGNALLED_AT:
            os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)  # a train step
        if watch.requested(step):
            print("stopped at", step)
            break
    else:
        print("never stopped", -1)
    watch.close()
    jax.distributed.shutdown()


if __name__ == "__main__":
    _worker(int(sys.argv[1]), sys.argv[2])
