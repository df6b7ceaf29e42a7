"""The chunks of a long `t5tpu infer`: what makes it resumable and shardable.

The predictions of inputs [start, end) go to <final file>.parts/<start>-<end>.jsonl, written
under a temporary name and renamed, so a chunk file is complete or absent. A run (or shard)
skips the chunks already there, and whoever finds every chunk present concatenates them, in
input order, into the final file (temporary name, rename) and removes the folder. The final
file is therefore byte-identical however the work was split or interrupted.

MANIFEST records what the chunks are predictions of (the inputs' fingerprint, the checkpoint
step and every setting that changes a prediction); chunks made for anything else are removed,
said once, and the work starts afresh. END records the number of inputs once a reader has seen
the last one, so a shard knows when the set is complete.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys
from collections.abc import Iterator

from etils import epath

MANIFEST = "MANIFEST.json"
END = "END.json"
_CHUNK = re.compile(r"^(\d{12})-(\d{12})\.jsonl$")


@dataclasses.dataclass(frozen=True)
class Span:
    """Inputs [start, end) of the source, in input order."""

    start: int
    end: int

    def file_name(self) -> str:
        return f"{self.start:012d}-{self.end:012d}.jsonl"


@dataclasses.dataclass(frozen=True)
class Assignment:
    """Which chunks this run decodes: chunk i (inputs [i*size, (i+1)*size)) belongs to shard
    i % num_shards."""

    chunk_size: int
    shard_id: int = 0
    num_shards: int = 1

    def owns(self, index: int) -> bool:
        return (index // self.chunk_size) % self.num_shards == self.shard_id


class ChunkStore:
    """The .parts folder beside one final predictions file."""

    def __init__(self, final_path: str, manifest: dict):
        self.final_path = final_path
        self.folder = epath.Path(f"{final_path}.parts")
        self.manifest = manifest

    def open(self, *, writer: bool) -> list[Span]:
        """The chunks already written for these inputs and settings, in order. Chunks of other
        inputs or settings are removed (by the writer), with one line saying so."""
        recorded = self._read_json(MANIFEST)
        if recorded is not None and recorded != self.manifest:
            if not writer:
                return []
            print(
                f"t5tpu: the inputs or settings changed since the chunks in {self.folder} "
                "were written; starting afresh",
                file=sys.stderr,
                flush=True,
            )
            self.folder.rmtree(missing_ok=True)
            recorded = None
        if recorded is None:
            if writer:
                self.folder.mkdir(parents=True, exist_ok=True)
                self._write(MANIFEST, json.dumps(self.manifest, sort_keys=True) + "\n")
            return []
        return self.done()

    def done(self) -> list[Span]:
        if not self.folder.is_dir():
            return []
        spans = []
        for path in self.folder.iterdir():
            if match := _CHUNK.match(path.name):
                spans.append(Span(int(match[1]), int(match[2])))
        return sorted(spans, key=lambda s: s.start)

    def write(self, span: Span, lines: list[str]) -> None:
        self._write(span.file_name(), "".join(lines))

    def record_end(self, total: int) -> None:
        self._write(END, json.dumps({"inputs": total}) + "\n")

    def complete(self) -> list[Span] | None:
        """The chunks, when they cover every input without a gap; else None."""
        end = self._read_json(END)
        spans = self.done()
        if end is None or not _covers(spans, end["inputs"]):
            return None
        return spans

    def merge(self, spans: list[Span]) -> None:
        """The chunks concatenated into the final file, then the folder removed. Two shards
        finishing at once both write the same bytes; the second finds the folder gone."""
        tmp = epath.Path(f"{self.final_path}.tmp-{os.getpid()}")
        try:
            with tmp.open("w") as out:
                for span in spans:
                    out.write((self.folder / span.file_name()).read_text())
        except FileNotFoundError:
            tmp.unlink(missing_ok=True)
            if not epath.Path(self.final_path).exists():
                raise
            return
        tmp.replace(self.final_path)
        self.folder.rmtree(missing_ok=True)

    def _write(self, name: str, text: str) -> None:
        tmp = self.folder / f".{name}.tmp-{os.getpid()}"
        tmp.write_text(text)
        tmp.replace(self.folder / name)

    def _read_json(self, name: str) -> dict | None:
        path = self.folder / name
        try:
            return json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except ValueError:
            return {"unreadable": name}  # a damaged manifest is some other run's: start afresh


def _covers(spans: list[Span], total: int) -> bool:
    position = 0
    for span in spans:
        if span.start != position:
            return False
        position = span.end
    return position == total


def pieces(
    records: Iterator, *, assignment: Assignment, done: list[Span]
) -> Iterator[tuple[Span, list]]:
    """(span, records) of each piece this run has to decode, in input order: the inputs of its
    own chunks that no chunk file covers yet, cut at chunk boundaries. Other inputs are read
    past (the stream has no random access) but not kept."""
    covered = sorted((s.start, s.end) for s in done)
    piece: list = []
    start = 0
    next_cover = 0
    for index, record in enumerate(records):
        while next_cover < len(covered) and covered[next_cover][1] <= index:
            next_cover += 1
        inside = next_cover < len(covered) and covered[next_cover][0] <= index
        wanted = assignment.owns(index) and not inside
        boundary = index % assignment.chunk_size == 0
        if piece and (not wanted or boundary):
            yield Span(start, start + len(piece)), piece
            piece = []
        if wanted:
            if not piece:
                start = index
            piece.append(record)
    if piece:
        yield Span(start, start + len(piece)), piece
