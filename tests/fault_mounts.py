"""Filesystems for fault-injection tests: a small tmpfs (a full disk) and a read-only view of a
folder (a read-only bind mount; root ignores permission bits, so chmod cannot make one).

Each is a context manager that mounts under a test's own tmp_path and always unmounts on the
way out. Where mounting is not permitted (not root, no CAP_SYS_ADMIN, no `mount` binary, a
container without it), the test is skipped with the reason. The other faults of a writer need
no mount: a folder where it writes a file, a file where it makes a folder.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator

import pytest


def _run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


def _mount_or_skip(*argv: str) -> None:
    if shutil.which("mount") is None:
        pytest.skip("no `mount` command on this machine")
    if hasattr(os, "geteuid") and os.geteuid() != 0:
        pytest.skip(f"mounting needs root; these tests run as uid {os.geteuid()}")
    done = _run("mount", *argv)
    if done.returncode != 0:
        pytest.skip(f"mount {' '.join(argv)} not permitted: {done.stderr.strip()}")


def _unmount(path: str) -> None:
    """Unmounts `path`; lazily if a process still holds a file there, so a failed test never
    leaves a mount behind in its tmp directory."""
    if _run("umount", path).returncode != 0:
        done = _run("umount", "-l", path)
        assert done.returncode == 0, f"could not unmount {path}: {done.stderr.strip()}"


@contextlib.contextmanager
def tmpfs(path, size_bytes: int) -> Iterator[str]:
    """A tmpfs of `size_bytes` mounted at `path` (created if needed)."""
    path = str(path)
    os.makedirs(path, exist_ok=True)
    _mount_or_skip("-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", path)
    try:
        yield path
    finally:
        _unmount(path)


@contextlib.contextmanager
def read_only_view(source, path) -> Iterator[str]:
    """`source` seen read-only at `path` (a bind mount, remounted ro): every write there fails
    with EROFS, for root too, while `source` itself stays writable for the test's set-up."""
    source, path = str(source), str(path)
    os.makedirs(path, exist_ok=True)
    _mount_or_skip("--bind", source, path)
    try:
        done = _run("mount", "-o", "remount,bind,ro", path)
        if done.returncode != 0:
            pytest.skip(f"remounting {path} read-only not permitted: {done.stderr.strip()}")
        yield path
    finally:
        _unmount(path)


def fill(folder, leave_free_bytes: int) -> str:
    """Writes a filler file in `folder` until its filesystem has about `leave_free_bytes`
    free; returns the filler's path (put it outside the folder under test)."""
    stat = os.statvfs(folder)
    free = stat.f_bavail * stat.f_frsize
    filler = os.path.join(str(folder), "filler")
    size = max(free - leave_free_bytes, 0)
    with open(filler, "wb") as f:
        block = b"\0" * (1 << 20)
        while size > 0:
            f.write(block[: min(size, len(block))])
            size -= len(block)
    return filler


def free_bytes(folder) -> int:
    stat = os.statvfs(folder)
    return stat.f_bavail * stat.f_frsize


def folder_where_file(path) -> str:
    """Makes `path`, where a writer puts a file, a folder holding a file of its own (so a
    writer that removed it would lose something); returns that file's path."""
    os.makedirs(path)
    held = os.path.join(str(path), "kept.txt")
    with open(held, "w") as f:
        f.write("a file inside the folder in the way\n")
    return held


def file_where_folder(path) -> str:
    """Makes `path`, where a writer makes a folder, a file; returns its path."""
    os.makedirs(os.path.dirname(str(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write("a file in the way of a folder\n")
    return str(path)


def remove(path) -> None:
    """Removes a file or a folder: the fault taken away before a rerun."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.remove(path)
