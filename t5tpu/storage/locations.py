"""Where a path points, decided here once for every module: remote storage (`scheme://...`:
gs://, the emulator's, any scheme epath's clients know) or this machine's file system.

A `file://PATH` is local: it names a file on this machine, which the os functions, orbax and
epath (which has no file:// scheme) reach as PATH alone, so `absolute` drops the scheme and a
path that goes through it reaches them all as a plain one. Nothing else here reads or asks
storage: remote.py asks buckets, within a deadline.
"""

from __future__ import annotations

import os

_SCHEME_MARK = "://"
_LOCAL_SCHEME = "file://"


def is_remote(path: str | os.PathLike | None) -> bool:
    """Whether `path` is on remote storage: `scheme://...` but file://; None and '' are not."""
    text = str(path) if path else ""
    return _SCHEME_MARK in text and not text.startswith(_LOCAL_SCHEME)


def is_absolute(path: str | os.PathLike | None) -> bool:
    """Whether `path` names its place without a folder to start from: a remote path, a
    file:// one, or an absolute local one."""
    text = str(path) if path else ""
    return _SCHEME_MARK in text or os.path.isabs(text)


def absolute(path: str | os.PathLike) -> str:
    """`path` as any process reads it from any folder: a remote path as given, a local one
    made absolute (a file:// one without its scheme)."""
    text = str(path)
    if is_remote(text):
        return text
    if text.startswith(_LOCAL_SCHEME):
        text = text[len(_LOCAL_SCHEME) :]
    return os.path.abspath(text)


def bucket_of(path: str) -> str:
    """The `scheme://bucket` of a remote path."""
    scheme, rest = str(path).split(_SCHEME_MARK, 1)
    return f"{scheme}{_SCHEME_MARK}{rest.split('/', 1)[0]}"
