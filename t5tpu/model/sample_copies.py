"""Several samples of one input (num_return_sequences with sampling): the input's copies, each
decoded as a row of its own by the same programs, and gathered back.

Copy j of a row of index i samples with the key of index i * n + j, so each sample is the one a
row of that index draws alone, in any batch. A row is done when its last copy is; the engine
then ranks its samples by the model's log-likelihood of each (Engine.score's), best first.
"""

from __future__ import annotations

import dataclasses

import numpy as np


class Copies:
    """A Feed of n copies of each row of `feed`, handed out in order; `original` tells which
    row a copy is of (rows are told apart by identity, as the engine hands them back)."""

    def __init__(self, feed, n: int):
        self._feed, self._n = feed, n
        self._waiting: list = []  # copies of rows taken, not yet handed out
        self._bucket = 0
        self._originals: dict[int, object] = {}

    def next_bucket(self) -> int | None:
        return self._bucket if self._waiting else self._feed.next_bucket()

    def take(self, count: int, bucket: int) -> list:
        if not self._waiting:
            self._bucket = bucket
        if bucket == self._bucket and len(self._waiting) < count:
            wanted = -(-(count - len(self._waiting)) // self._n)
            for row in self._feed.take(wanted, bucket):
                self._waiting += [self._copy(row, j) for j in range(self._n)]
        taken, self._waiting = self._waiting[:count], self._waiting[count:]
        return taken

    def _copy(self, row, j: int):
        copy = dataclasses.replace(row, index=row.index * self._n + j)
        self._originals[id(copy)] = row
        return copy

    def original(self, copy):
        """The row `copy` is of; asked once per copy, when the engine is done with it."""
        return self._originals.pop(id(copy))


@dataclasses.dataclass
class _Samples:
    ids: list
    seen: int = 0
    left: bool = False


class Gathered:
    """Each row's samples as its copies finish (or leave, when the row's caller has gone)."""

    def __init__(self, n: int):
        self._n = n
        self._rows: dict[int, _Samples] = {}

    def add(self, row, ids: np.ndarray, state: str) -> list | str | None:
        """ "left" for the first copy of a row that leaves (its caller has gone), the row's
        samples when its last copy is done and none left, else None."""
        samples = self._rows.setdefault(id(row), _Samples(ids=[]))
        samples.seen += 1
        answer = None
        if state == "left":
            answer = None if samples.left else "left"
            samples.left = True
        else:
            samples.ids.append(ids)
        if samples.seen == self._n:
            del self._rows[id(row)]
            if not samples.left:
                answer = samples.ids
        return answer


def trimmed(ids: np.ndarray, eos_id: int) -> tuple[int, ...]:
    """A decoded row's tokens: up to its first EOS, included (the whole row if it has none)."""
    ends = np.flatnonzero(ids == eos_id)
    return tuple(int(i) for i in (ids[: ends[0] + 1] if len(ends) else ids))
