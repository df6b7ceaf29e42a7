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
import re
import sys
from collections.abc import Iterator

from etils import epath

from t5tpu.storage import atomic_files, remote, user_files

# What moves the predictions elsewhere, named when they cannot be written (MODEL_DIR too).
OUTPUT_SETTING = "INFER_OUTPUT_DIR"
MANIFEST = "MANIFEST.json"
END = "END.json"
_CHUNK = re.compile(r"^(\d{12})-(\d{12})\.jsonl$")
# MANIFEST and END hold a few settings: a far larger file there is damaged, and not read whole.
_MAX_JSON_BYTES = 1 << 20


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
            with atomic_files.write_faults(str(self.folder), OUTPUT_SETTING):
                self.folder.rmtree(missing_ok=True)
            recorded = None
        if recorded is None:
            if writer:
                with atomic_files.write_faults(str(self.folder), OUTPUT_SETTING):
                    self.folder.mkdir(parents=True, exist_ok=True)
                self._write(MANIFEST, json.dumps(self.manifest, sort_keys=True) + "\n")
            return []
        return self._sound(self.done(), writer=writer)

    def done(self) -> list[Span]:
        if not self.folder.is_dir():
            return []
        spans = []
        for path in self.folder.iterdir():
            if match := _CHUNK.match(path.name):
                spans.append(Span(int(match[1]), int(match[2])))
        return sorted(spans, key=lambda s: (s.start, s.end))

    def write(self, span: Span, lines: list[str]) -> None:
        self._write(span.file_name(), "".join(lines))

    def record_end(self, total: int) -> None:
        self._write(END, json.dumps({"inputs": total}) + "\n")

    def complete(self) -> list[Span] | None:
        """The chunks, when they cover every input without a gap; else None."""
        total = (self._read_json(END) or {}).get("inputs")
        spans = self.done()
        if type(total) is not int or not _covers(spans, total):  # bool and float are not counts
            return None
        return spans

    def merge(self, spans: list[Span]) -> None:
        """The chunks concatenated into the final file, then the folder removed. Two shards
        finishing at once both write the same bytes; the second finds the folder gone."""
        try:
            with atomic_files.atomic_file(self.final_path, setting=OUTPUT_SETTING) as out:
                for span in spans:
                    out.write((self.folder / span.file_name()).read_text())
        except FileNotFoundError:
            if not epath.Path(self.final_path).exists():
                raise
            return
        self.folder.rmtree(missing_ok=True)

    def _write(self, name: str, text: str) -> None:
        atomic_files.write_atomically(self.folder / name, text, setting=OUTPUT_SETTING)

    def _read_json(self, name: str) -> dict | None:
        """The JSON object in `name`; None when there is none, and a dict no run writes when
        it is damaged (some other run's, or cut: a fresh start). A file that cannot be read at
        all is refused in one line, and nothing is removed."""
        path = str(self.folder / name)
        if not remote.answered(epath.Path(path).exists, path=path, setting=OUTPUT_SETTING):
            return None
        data = user_files.read_bytes(path, what="infer chunks", max_bytes=_MAX_JSON_BYTES)
        try:
            value = json.loads(data.decode("utf-8"))
        except (ValueError, RecursionError):  # not UTF-8 or not JSON
            value = None
        return value if isinstance(value, dict) else {"unreadable": name}

    def _sound(self, spans: list[Span], *, writer: bool) -> list[Span]:
        """The chunks whose files hold one complete line of text per input, in order; a damaged
        one (cut, overlapping another, not text) is left out, and the writer removes it, saying
        so in one line, so that its inputs are decoded again instead of merged damaged."""
        sound, position = [], 0
        for span in spans:
            problem = self._problem(span, after=position)
            if problem is None:
                sound.append(span)
                position = span.end
            elif writer:
                print(
                    f"t5tpu: {self.folder / span.file_name()} {problem}; decoding again",
                    file=sys.stderr,
                    flush=True,
                )
                (self.folder / span.file_name()).unlink(missing_ok=True)
        return sound

    def _problem(self, span: Span, *, after: int) -> str | None:
        if span.end <= span.start:
            return "names no inputs"
        if span.start < after:
            return "overlaps another chunk"
        path = str(self.folder / span.file_name())
        data = user_files.read_bytes(path, what="infer chunks")
        if data.count(b"\n") != span.end - span.start or not data.endswith(b"\n"):
            return f"does not hold {span.end - span.start} complete lines"
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            return "is not UTF-8 text"
        return "holds a NUL byte" if "\0" in text else None


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
