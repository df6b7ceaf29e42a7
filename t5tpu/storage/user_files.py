"""Every file the user names is read through here: checked to be there (a remote one within the
storage answer time, through storage.remote), sized before it is read, and refused in one line
naming it when it is missing, a folder, unreadable or not what it should be.

Parsers of binary formats check each length they read from a file against `limit` before they
allocate anything: a damaged header then ends in one line instead of a MemoryError.
"""

from __future__ import annotations

import errno
import json

from etils import epath

from t5tpu import validators
from t5tpu.errors import EnvironmentFault, UserError
from t5tpu.storage import remote

# Reads fail for the machine, not the input, with these; anything else an OSError says about a
# file the user named (no such file, a folder, permission) is the user's to fix.
_MACHINE_ERRNOS = frozenset({errno.EIO, errno.ENOMEM, errno.ENOBUFS})


def _refused(error: OSError, path: str, what: str) -> Exception:
    if error.errno in _MACHINE_ERRNOS:
        return EnvironmentFault(path, error.strerror or str(error))
    if isinstance(error, FileNotFoundError):
        return UserError(f"{what}: no file {path}; check the path")
    if isinstance(error, IsADirectoryError):
        return UserError(f"{what}: {path} is a folder where a file should be; give the file")
    if isinstance(error, PermissionError):
        return UserError(f"{what}: {path} cannot be read (permission denied); fix its mode")
    return UserError(f"{what}: {path} cannot be read ({error.strerror or error}); check it")


def size(path: str, *, what: str) -> int:
    """The size in bytes of the file at `path`, which must exist and be a file."""

    def ask() -> int:
        p = epath.Path(path)
        if p.is_dir():
            raise IsADirectoryError(errno.EISDIR, "is a folder", path)
        return p.stat().length

    try:
        return remote.answered(ask, path=path, setting=what)
    except OSError as e:
        raise _refused(e, path, what) from None


def read_bytes(path: str, *, what: str, max_bytes: int | None = None) -> bytes:
    """The bytes of `path`; refused in one line when it is missing or larger than `max_bytes`
    (files that are read whole, and should be small: configs, vocabularies, indexes)."""
    found = size(path, what=what)
    if max_bytes is not None and found > max_bytes:
        raise UserError(
            f"{what}: {path} is {found:,} bytes, more than the {max_bytes:,} such a file can "
            "be; is it the right file?"
        )
    try:
        return remote.answered(epath.Path(path).read_bytes, path=path, setting=what)
    except OSError as e:
        raise _refused(e, path, what) from None


def read_text(path: str, *, what: str, max_bytes: int | None = None) -> str:
    """The UTF-8 text of `path`; a binary file is refused naming the line where it stops
    being text."""
    data = read_bytes(path, what=what, max_bytes=max_bytes)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise UserError(
            f"{what}: {path} is not UTF-8 text (line {line}); give a text file"
        ) from None


def read_json(path: str, *, what: str, expect: type = dict, max_bytes: int | None = None):
    """The JSON document of `path`, which must be of type `expect` (an object by default)."""
    text = read_text(path, what=what, max_bytes=max_bytes)
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as e:  # RecursionError: brackets nested thousands deep
        raise UserError(
            f"{what}: {path} is not valid JSON ({e}); give the file as written"
        ) from None
    if not isinstance(value, expect):
        raise UserError(
            f"{what}: {path} holds a JSON {type(value).__name__}, not a {expect.__name__}; "
            "is it the right file?"
        )
    return value


def check_length(declared: int, *, available: int, path: str, what: str) -> int:
    """A length or count read from `path` (a header's size, a tensor's byte count), refused
    unless 0 <= declared <= available: checked before anything of that size is allocated."""
    if not 0 <= declared <= available:
        raise UserError(
            f"{what}: {path} is damaged (it declares {declared:,} bytes where {available:,} "
            "remain); give an undamaged copy"
        )
    return declared


def field(mapping: dict, key: str, expect: type | tuple[type, ...], *, path: str, what: str):
    """`mapping[key]`, which must be there and of type `expect` (a JSON file's field)."""
    if not isinstance(mapping, dict) or key not in mapping:
        raise UserError(f"{what}: {path} lacks {key!r}; is it the right file?")
    value = mapping[key]
    if not validators.is_instance(value, _types(expect)):  # a JSON true is not a number
        raise UserError(
            f"{what}: {path} has {key!r} of type {type(value).__name__}, where "
            f"{' or '.join(t.__name__ for t in _types(expect))} is expected; fix the file"
        )
    return value


def _types(expect) -> tuple[type, ...]:
    return expect if isinstance(expect, tuple) else (expect,)


def read_range(path: str, start: int, length: int, *, what: str) -> bytes:
    """`length` bytes of `path` from offset `start` (a binary file's header or index, read
    without reading the rest); refused in one line when the file ends before them. Check
    `length` against the file's size first (check_length) when it was read from the file."""

    def ask() -> bytes:
        with epath.Path(path).open("rb") as f:
            f.seek(start)
            return f.read(length)

    try:
        data = remote.answered(ask, path=path, setting=what)
    except OSError as e:
        raise _refused(e, path, what) from None
    if len(data) != length:
        raise UserError(
            f"{what}: {path} is cut short (it ends {length - len(data):,} bytes before the "
            f"{length:,} at offset {start:,}); give a complete copy"
        )
    return data


def open_binary(path: str, *, what: str):
    """`path` opened for reading bytes, for readers that stream a file too large to read whole
    (input lines, predictions); refused in one line as read_bytes refuses."""
    try:
        return remote.answered(lambda: epath.Path(path).open("rb"), path=path, setting=what)
    except OSError as e:
        raise _refused(e, path, what) from None
