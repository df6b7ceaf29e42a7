"""Things the tests build once per test run (a trained model, a compile's results) and share
between test files and between scripts/test.sh's two pytest-xdist workers.

`built_once(tmp_path_factory, name, build, *key)` gives every caller of one test run the same
folder, built by whichever process asks first: the folder is named by `name` and a hash of
`key` (the flags or settings the build depends on, so two configurations never share one), in
a directory that the workers of one run share (the controller's base temporary directory:
each worker's own is a folder inside it) and no other run sees. A lock file serializes the
builders: when both workers ask at once, one builds while the other waits on the lock, then
reads what was built (waiting costs it no more than building the same thing itself would).
A build that failed is not retried by the next caller: it fails at once, naming the first
failure, instead of spending the same minutes failing again.

What `build(folder)` returns (JSON: numbers, text, lists, dicts) is kept beside the folder and
returned to every caller with it. The folder is shared: a test that writes there works on a
copy (shutil.copytree), as conftest.py's `trained_tiny` says.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import pathlib
import shutil
import traceback
from collections.abc import Callable
from typing import Any


def run_directory(tmp_path_factory) -> pathlib.Path:
    """The directory every process of this test run shares: under pytest-xdist the controller's
    base temporary directory (the worker's own is a folder inside it), else this process's."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def built_once(
    tmp_path_factory, name: str, build: Callable[[pathlib.Path], Any], *key: Any
) -> tuple[pathlib.Path, Any]:
    """(the folder, build's result) of `build(folder)` run once in this test run for `name`
    and `key`; every later caller, in any worker, gets the same."""
    digest = hashlib.sha256(json.dumps([name, *key], default=str).encode()).hexdigest()[:12]
    root = run_directory(tmp_path_factory) / "built_once"
    root.mkdir(exist_ok=True)
    folder = root / f"{name}-{digest}"
    result, failure = root / f"{folder.name}.json", root / f"{folder.name}.failed"
    with open(root / f"{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or its process dies
        if failure.exists():
            earlier = failure.read_text()
            raise RuntimeError(f"building {name} failed earlier in this run:\n{earlier}")
        if not result.exists():
            shutil.rmtree(folder, ignore_errors=True)  # left by a process killed mid-build
            folder.mkdir()
            try:
                value = build(folder)
            except BaseException:
                failure.write_text(traceback.format_exc()[-5000:])
                raise
            result.write_text(json.dumps(value))
        return folder, json.loads(result.read_text())
