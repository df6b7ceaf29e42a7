"""tests/built_once.py: what two pytest-xdist workers asking at once get (one build, the same
folder and result), and a failed build is not run again."""

import json
import os
import subprocess
import sys

import pytest
from built_once import built_once

HERE = os.path.dirname(os.path.abspath(__file__))
# One process of a run: asks for "model" (its build takes a second and counts its calls) and
# prints the folder and the result it got.
ASK = """
import json, os, pathlib, sys, time
sys.path.insert(0, sys.argv[1])
from built_once import built_once

class Factory:
    def getbasetemp(self):
        return pathlib.Path(sys.argv[2]) / f"popen-{os.environ['PYTEST_XDIST_WORKER']}"

def build(folder):
    with open(pathlib.Path(sys.argv[2]) / "builds", "a") as f:
        f.write("built\\n")
    time.sleep(1)
    (folder / "weights").write_text("trained")
    return {"steps": 2}

folder, result = built_once(Factory(), "model", build, "--gin.TRAIN_STEPS=2")
print(json.dumps([str(folder), (folder / "weights").read_text(), result]))
"""


def test_two_workers_asking_at_once_get_one_build(tmp_path):
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", ASK, HERE, str(tmp_path)],
            env=dict(os.environ, PYTEST_XDIST_WORKER=worker),
            stdout=subprocess.PIPE,
            text=True,
        )
        for worker in ("gw0", "gw1")
    ]
    answers = [json.loads(proc.communicate(timeout=60)[0]) for proc in procs]
    assert all(proc.returncode == 0 for proc in procs)
    assert (tmp_path / "builds").read_text() == "built\n"
    folder = answers[0][0]
    assert answers == [[folder, "trained", {"steps": 2}]] * 2
    # In the directory both workers share, named by its key.
    assert os.path.dirname(os.path.dirname(folder)) == str(tmp_path)


class _Factory:
    def __init__(self, path):
        self.path = path

    def getbasetemp(self):
        return self.path


def test_other_keys_build_apart_and_a_failed_build_is_not_repeated(tmp_path, monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)  # one process: its own base
    factory, calls = _Factory(tmp_path), []

    def build(folder):
        calls.append(folder)
        return len(calls)

    first, one = built_once(factory, "run", build, 1)
    assert built_once(factory, "run", build, 1) == (first, one) and one == 1
    other, two = built_once(factory, "run", build, 2)
    assert other != first and two == 2 and other.parent == tmp_path / "built_once"

    def broken(folder):
        calls.append(folder)
        raise ValueError("no such experiment")

    with pytest.raises(ValueError):
        built_once(factory, "bad", broken)
    with pytest.raises(RuntimeError, match="bad failed earlier in this run(.|\n)*no such exp"):
        built_once(factory, "bad", broken)
    assert len(calls) == 3
