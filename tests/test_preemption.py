"""The signals that stop training: SIGTERM on one host of two (simulated on localhost with
jax.distributed) makes both stop at the same step, through jax's preemption sync point; Ctrl-C
is held through a checkpoint save, and in the train loop until the step's work is done."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

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
    from t5tpu.training.preemption import PreemptionWatch

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


@pytest.fixture
def ctrl_c_raises():
    """Python's Ctrl-C handler, as in a terminal (a background job starts with SIGINT ignored)."""
    handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, handler)


def test_ctrl_c_during_a_checkpoint_save_is_raised_once_the_save_is_complete(
    tmp_path, ctrl_c_raises
):
    """orbax's wait_until_finished catches a KeyboardInterrupt that lands while it waits (logs
    it, forgets the step) and training went on; checkpoints.save holds Ctrl-C until the save is
    complete, then raises it."""
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    from t5tpu.storage import checkpoints

    mngr = checkpoints.manager(str(tmp_path))
    wait, waited = mngr.wait_until_finished, []

    def ctrl_c_while_waiting():
        os.kill(os.getpid(), signal.SIGINT)  # without the hold, raised here, before the wait
        wait()
        waited.append(True)

    mngr.wait_until_finished = ctrl_c_while_waiting
    params = {"w": jnp.arange(4.0)}
    with pytest.raises(KeyboardInterrupt):
        checkpoints.save(mngr, 3, params, {"m": jnp.zeros(4)}, "float32", 0)
    assert waited
    restored = ocp.StandardCheckpointer().restore(tmp_path / "checkpoint_3" / "params")
    assert (restored["w"] == params["w"]).all()  # complete before Ctrl-C was raised
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored


def test_ctrl_c_in_the_train_loop_waits_for_the_steps_work_and_twice_stops_at_once(
    ctrl_c_raises,
):
    """A KeyboardInterrupt raised inside TensorFlow while it wrote the input position was seen to
    abort the process (a corrupted heap); in the train loop Ctrl-C takes effect between steps."""
    from t5tpu.storage import save_guards
    from t5tpu.training.preemption import CtrlCBetweenSteps

    work_done = []
    ctrl_c = CtrlCBetweenSteps()
    try:
        with save_guards.ctrl_c_after_the_save():
            os.kill(os.getpid(), signal.SIGINT)  # during the save: handed on, not raised
            work_done.append("saved")
        work_done.append("input position written")
        with pytest.raises(KeyboardInterrupt):
            ctrl_c.check()
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)  # pressed again: at once
            time.sleep(5)
    finally:
        ctrl_c.close()
    assert work_done == ["saved", "input position written"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_background_job_keeps_ignoring_ctrl_c():
    from t5tpu.storage import save_guards
    from t5tpu.training.preemption import CtrlCBetweenSteps

    handler = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        ctrl_c = CtrlCBetweenSteps()
        with save_guards.ctrl_c_after_the_save():
            os.kill(os.getpid(), signal.SIGINT)
        ctrl_c.check()
        ctrl_c.close()
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, handler)
