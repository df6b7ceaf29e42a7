"""A SentencePiece vocabulary whose Python side needs neither seqio nor TensorFlow.

`t5tpu infer` of inputs given on the command line, and `t5tpu.load(...).predict`, only encode
and decode text; importing seqio for that (it imports TensorFlow) would be most of their start.
This class reads the model with sentencepiece alone, giving exactly the ids and text of
seqio.SentencePieceVocabulary with the same file and extra ids (tests/test_startup.py compares
them). Anything else a task's pipeline asks of it (encode_tf, decode_tf, ...) is answered by
that seqio vocabulary, made on first use, so it goes wherever seqio wants a vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterable

import sentencepiece
from google.protobuf import message
from sentencepiece import sentencepiece_model_pb2

from t5tpu.errors import UserError
from t5tpu.runtime.lazy_imports import seqio
from t5tpu.storage import user_files

PAD_ID = 0  # seqio's, and every T5 vocabulary's
WHAT = "SentencePiece vocabulary"
# The largest published models (mT5's 250k pieces) are a few MB: anything far larger is not one.
MAX_MODEL_BYTES = 64 << 20


def _processor(model_file: str, extra_ids: int) -> sentencepiece.SentencePieceProcessor:
    """The model with `extra_ids` sentinels appended as seqio appends them: <extra_id_0> is the
    last id (T5's span corruption counts them down from the end). A file that is not a usable
    SentencePiece model is refused in one line."""
    model = user_files.read_bytes(model_file, what=WHAT, max_bytes=MAX_MODEL_BYTES)
    proto = _checked_proto(model, model_file)
    if extra_ids:
        for i in reversed(range(extra_ids)):
            proto.pieces.add(
                piece=f"▁<extra_id_{i}>",
                score=0.0,
                type=sentencepiece_model_pb2.ModelProto.SentencePiece.USER_DEFINED,
            )
        model = proto.SerializeToString()
    processor = sentencepiece.SentencePieceProcessor()
    try:
        processor.LoadFromSerializedProto(model)
    except RuntimeError as e:  # sentencepiece's own checks (no <unk>, duplicate pieces, ...)
        raise _damaged(model_file, str(e).strip().splitlines()[0]) from None
    if processor.eos_id() < 0:
        raise UserError(
            f"{WHAT}: {model_file} has no end-of-sequence piece, which T5 ends every text with; "
            "give a model trained with an EOS id (T5's is 1)"
        )
    return processor


def _checked_proto(model: bytes, model_file: str) -> sentencepiece_model_pb2.ModelProto:
    """The model's proto, parsed in Python first: sentencepiece's loader accepts pieces that are
    not UTF-8, which then fail every decode that reaches them."""
    try:
        proto = sentencepiece_model_pb2.ModelProto.FromString(model)
    except message.DecodeError:
        raise _damaged(model_file, "not a SentencePiece model proto") from None
    if not proto.pieces:
        raise _damaged(model_file, "no pieces")
    # upb hands a proto2 string that is not UTF-8 back as bytes.
    bad = next((i for i, p in enumerate(proto.pieces) if not isinstance(p.piece, str)), None)
    if bad is not None:
        raise _damaged(model_file, f"piece {bad} is not UTF-8")
    return proto


def _damaged(model_file: str, why: str) -> UserError:
    return UserError(
        f"{WHAT}: {model_file} is not a usable SentencePiece model ({why}); bind "
        "default_vocabulary.sentencepiece_model_file to an undamaged .model file"
    )


class SentencePieceVocabulary:
    """seqio.SentencePieceVocabulary(model_file, extra_ids)'s ids and text, without seqio."""

    def __init__(self, model_file: str, extra_ids: int = 0):
        self.sentencepiece_model_file = model_file
        self.extra_ids = extra_ids
        self._tokenizer = None
        self._seqio = None

    @property
    def tokenizer(self) -> sentencepiece.SentencePieceProcessor:
        # Read on first use, as seqio does: a model built for its shapes alone (a gs:// file,
        # no network) reads nothing.
        if self._tokenizer is None:
            self._tokenizer = _processor(self.sentencepiece_model_file, self.extra_ids)
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.GetPieceSize()  # the sentinels included, as seqio counts

    @property
    def pad_id(self) -> int:
        return PAD_ID

    @property
    def eos_id(self) -> int:
        return self.tokenizer.eos_id()

    @property
    def unk_id(self) -> int:
        return self.tokenizer.unk_id()

    def encode(self, text: str) -> list[int]:
        """The ids of `text`, without EOS."""
        return self.tokenizer.EncodeAsIds(text)

    def decode(self, ids: Iterable[int]) -> str:
        """The text of `ids` up to the first EOS; ids past the vocabulary read as UNK."""
        ids = [int(i) for i in ids]
        if self.eos_id in ids:
            ids = ids[: ids.index(self.eos_id) + 1]
        return self.tokenizer.DecodeIds([i if i < self.vocab_size else self.unk_id for i in ids])

    def __getstate__(self):
        # gin may deep-copy what a configurable is given: the model is read again instead.
        return self.sentencepiece_model_file, self.extra_ids

    def __setstate__(self, state) -> None:
        self.__init__(*state)

    @property
    def seqio_vocabulary(self):
        """seqio.SentencePieceVocabulary of the same model (imports seqio and TensorFlow)."""
        if self._seqio is None:
            # Read here first: seqio's own read of a damaged file ends in TensorFlow's traceback.
            _ = self.tokenizer
            self._seqio = seqio.SentencePieceVocabulary(
                self.sentencepiece_model_file, self.extra_ids
            )
        return self._seqio

    def __getattr__(self, name: str):
        # Reached only for what this class lacks: the TensorFlow side that tasks' pipelines
        # use. Private and special names are not forwarded (copy and pickle probe for those).
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.seqio_vocabulary, name)
