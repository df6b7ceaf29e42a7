"""Answers as they decode: text pieces of each input's answer whose concatenation is the answer
`predict` gives, for `T5Model.stream` and `t5tpu serve`'s streamed predictions."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

# SentencePiece's text for ids that end inside a character (a byte piece of several).
_CUT_CHARACTER = "\ufffd"


@dataclasses.dataclass(frozen=True)
class Piece:
    """The next `text` of input `index`'s answer; its last piece also carries the whole answer
    (`prediction`, what predict gives) and why it ended: "stop" (EOS) or "length"."""

    index: int
    text: str
    prediction: str | None = None
    finish_reason: str | None = None


class TextDeltas:
    """One row's answer as it decodes, given out in pieces: the text of the ids so far, less
    what was given out already. Nothing is given out while that text does not begin with what
    was (a vocabulary may decode a prefix otherwise) or ends inside a character, so the pieces
    join to the text so far."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self._decode = decode
        self.sent = ""

    def update(self, ids) -> str:
        """The new text of `ids`, the row's ids so far (zeros after)."""
        text = self._decode([int(i) for i in ids])
        if not text.startswith(self.sent) or text.endswith(_CUT_CHARACTER):
            return ""
        piece, self.sent = text[len(self.sent) :], text
        return piece

    def finish(self, answer: str) -> str:
        """What of the whole `answer` is left to give out ('' if what was given out is not its
        start: the last Piece's prediction is whole all the same)."""
        piece = answer[len(self.sent) :] if answer.startswith(self.sent) else ""
        self.sent = answer
        return piece


def finish_reason(ids, eos_id: int) -> str:
    """ "stop" when the row ended with EOS, else "length" (it reached its length limit)."""
    return "stop" if eos_id in [int(i) for i in ids] else "length"
