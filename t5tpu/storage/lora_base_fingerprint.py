"""The base checkpoint a LoRA run adapts: its path and a fingerprint of its files, recorded with
every adapter checkpoint and checked before the base is read again.

Reading a whole base (tens of GB for T5 11B) only to hash it would double every resume and
eval, so the fingerprint hashes each file's name, size and first and last 64 KiB: a re-saved or
retrained checkpoint differs there (other sizes, other data at both ends), and a copy of the same
files elsewhere has the same fingerprint. A Mesh TF checkpoint is a prefix (model.ckpt-N), its
files the ones starting with it.
"""

from __future__ import annotations

import dataclasses
import hashlib

from etils import epath

from t5tpu.errors import UserError
from t5tpu.storage import remote

_SAMPLE = 64 * 1024


def _walk(folder: epath.Path, prefix: str = ""):
    # epath refuses a recursive glob (on GCS it would be one request per folder anyway).
    for entry in folder.iterdir():
        if entry.is_dir():
            yield from _walk(entry, f"{prefix}{entry.name}/")
        else:
            yield f"{prefix}{entry.name}", entry


def _files(path: str) -> list[tuple[str, epath.Path]]:
    """(name relative to `path`, file) of every file the checkpoint at `path` holds, sorted."""
    root = epath.Path(path)
    if root.is_dir():
        return sorted(_walk(root))
    if root.exists():
        return [(root.name, root)]
    found = [p for p in root.parent.glob(f"{root.name}*") if p.is_file()]
    return sorted((p.name, p) for p in found)


def _file_digest(file: epath.Path, digest) -> None:
    size = file.stat().length
    digest.update(f"{size}\n".encode())
    with file.open("rb") as f:
        digest.update(f.read(_SAMPLE))
        if size > 2 * _SAMPLE:
            f.seek(size - _SAMPLE)
            digest.update(f.read(_SAMPLE))


def fingerprint(path: str) -> str | None:
    """The hex fingerprint of the checkpoint at `path`; None when it holds no file."""
    files = remote.answered(lambda: _files(path), path=path, setting="the base checkpoint")
    if not files:
        return None
    digest = hashlib.sha256()
    for name, file in files:
        digest.update(f"{name}\n".encode())
        _file_digest(file, digest)
    return digest.hexdigest()


@dataclasses.dataclass(frozen=True)
class BaseReference:
    """A base checkpoint as a LoRA run found it: where, and its fingerprint."""

    path: str
    fingerprint: str

    @classmethod
    def of(cls, path: str) -> BaseReference:
        found = fingerprint(path)
        if found is None:
            raise UserError(f"the base checkpoint {path} holds no file; give a trained checkpoint")
        return cls(path, found)

    def record(self) -> dict:
        return {"path": self.path, "fingerprint": self.fingerprint}

    @classmethod
    def from_record(cls, record: dict) -> BaseReference:
        return cls(record["path"], record["fingerprint"])

    def check(self, adapters: str) -> None:
        """Refuses, in one line, a base that is gone or is no longer the one `adapters` (a
        checkpoint directory) were trained on."""
        found = fingerprint(self.path)
        if found is None:
            raise UserError(
                f"{adapters} holds LoRA adapters of the base checkpoint {self.path}, which is "
                "missing; put that checkpoint back there, the adapters only work with it"
            )
        if found != self.fingerprint:
            raise UserError(
                f"the base checkpoint {self.path} has changed since {adapters} was trained on it "
                f"(fingerprint {self.fingerprint[:12]}, now {found[:12]}); put the original "
                "back, or fine-tune new adapters on this one"
            )
