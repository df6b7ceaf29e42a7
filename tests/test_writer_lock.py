"""storage.writer_lock: one training run per MODEL_DIR; a dead holder's lock is taken over."""

import json
import os
import socket
import subprocess
import sys

import pytest

from t5tpu.errors import UserError
from t5tpu.storage.writer_lock import Holder, WriterLock


def _holder_file(path, holder: Holder) -> None:
    path.write_text(json.dumps({"host": holder.host, "pid": holder.pid, "started": 0.0}))


def test_a_second_writer_is_refused_while_the_first_holds_it(tmp_path):
    lock = tmp_path / "train.lock"
    with WriterLock(str(lock)):
        content = lock.read_text()
        assert json.loads(content)["pid"] == os.getpid()
        other = WriterLock(str(lock), holder=Holder(socket.gethostname(), os.getpid(), 1.0))
        with pytest.raises(UserError, match=rf"being trained by pid {os.getpid()} on "):
            other.acquire()
        assert lock.read_text() == content  # the holder's file is untouched
    assert not lock.exists()  # released on exit


def test_a_live_process_on_this_host_keeps_its_lock(tmp_path):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock = tmp_path / "train.lock"
        _holder_file(lock, Holder(socket.gethostname(), sleeper.pid, 0.0))
        with pytest.raises(UserError, match=rf"pid {sleeper.pid}.*delete {lock}"):
            WriterLock(str(lock)).acquire()
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_dead_holder_on_this_host_is_taken_over(tmp_path, capsys):
    finished = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead_pid = int(finished.stdout)
    lock = tmp_path / "train.lock"
    _holder_file(lock, Holder(socket.gethostname(), dead_pid, 0.0))
    with WriterLock(str(lock)):
        assert json.loads(lock.read_text())["pid"] == os.getpid()
    assert f"took over {lock} from pid {dead_pid}" in capsys.readouterr().out
    assert not lock.exists()


def test_another_hosts_lock_is_never_taken_over(tmp_path):
    lock = tmp_path / "train.lock"
    _holder_file(lock, Holder("some-other-tpu-vm", 12345, 0.0))
    before = lock.read_text()
    with pytest.raises(UserError, match="pid 12345 on some-other-tpu-vm"):
        WriterLock(str(lock)).acquire()
    assert lock.read_text() == before


def test_an_unreadable_lock_is_replaced(tmp_path):
    lock = tmp_path / "train.lock"
    lock.write_bytes(b"\x00\x01 not json")
    with WriterLock(str(lock)):
        assert json.loads(lock.read_text())["pid"] == os.getpid()
    assert not lock.exists()


def test_release_leaves_a_lock_that_another_run_took(tmp_path):
    lock = tmp_path / "train.lock"
    mine = WriterLock(str(lock))
    mine.acquire()
    _holder_file(lock, Holder("elsewhere", 7, 0.0))  # e.g. removed by hand and re-taken
    mine.release()
    assert json.loads(lock.read_text())["host"] == "elsewhere"


def test_a_directory_that_cannot_be_written_is_a_user_error_naming_it(tmp_path):
    # A missing directory stands in for a read-only one (root ignores permission bits);
    # tests/test_faults.py checks a read-only mount through the command line.
    folder = tmp_path / "missing"
    with pytest.raises(UserError, match=rf"cannot write to MODEL_DIR {folder} \("):
        WriterLock(str(folder / "train.lock")).acquire()
    assert not folder.exists()
