"""The vocabulary of the model being run.

Model gin files bind `default_vocabulary.sentencepiece_model_file`: the T5 ones bind the public
cc_all.32000 model with extra_ids=100 (as the t5 library and HF do), the mT5 ones mC4's
250k-piece model, the tiny CPU ones `@bundled_vocabulary_file()`, the 1,024-piece model that
scripts/train_cpu_vocab.py trains on the bundled Quora sample. ByT5's bind
`default_vocabulary.kind = 'bytes'` instead: UTF-8 bytes need no model file. A SentencePiece
vocabulary encodes and decodes without seqio or TensorFlow (sentencepiece_vocab.py), so a model
that only decodes given text never imports them; what tasks' pipelines ask beyond that comes from
seqio's vocabulary of the same model, made on first use. Tasks are
registered with this vocabulary after gin has been parsed, so whichever kind the model gin picks
reaches them through this one function.
"""

from __future__ import annotations

import functools
import os

import gin

from t5tpu import package_files
from t5tpu.data.sentencepiece_vocab import SentencePieceVocabulary
from t5tpu.errors import UserError
from t5tpu.runtime.lazy_imports import seqio
from t5tpu.storage import remote

KINDS = ("sentencepiece", "bytes")
# The binding that names a SentencePiece model file, in messages.
SETTING = "default_vocabulary.sentencepiece_model_file"


@gin.configurable
def bundled_vocabulary_file() -> str:
    """The absolute path of the small SentencePiece model shipped inside the package."""
    return os.path.abspath(package_files.asset("cpu_vocab.model"))


@gin.configurable
def default_vocabulary(
    sentencepiece_model_file: str | None = None, extra_ids: int = 0, kind: str = "sentencepiece"
) -> seqio.Vocabulary:
    """The vocabulary bound in gin: a SentencePiece model (None means the bundled CPU one; ids
    and text as seqio.SentencePieceVocabulary's) or, with kind='bytes', seqio's ByteVocabulary
    (3 special ids, then the 256 byte values).

    Repeated calls with the same arguments return the same object, so tasks, feature
    converters and decoders all share one loaded model.
    """
    if kind not in KINDS:
        raise UserError(f"default_vocabulary.kind = {kind!r}; use one of {', '.join(KINDS)}")
    if kind == "bytes":
        # A model file bound beside kind='bytes' would be ignored: say so rather than guess.
        if sentencepiece_model_file:
            raise UserError(
                "default_vocabulary.kind = 'bytes' reads no model file; unbind "
                "default_vocabulary.sentencepiece_model_file or use kind = 'sentencepiece'"
            )
        return _byte_vocabulary(extra_ids)
    return _load_vocabulary(sentencepiece_model_file or bundled_vocabulary_file(), extra_ids)


@functools.cache
def _load_vocabulary(path: str, extra_ids: int) -> SentencePieceVocabulary:
    _check_model_file(path)
    return SentencePieceVocabulary(path, extra_ids=extra_ids)


def _check_model_file(path: str) -> None:
    """Checked before anything is loaded (once per file: the vocabulary is cached), so a typo
    ends in one clear line. A gs:// file is asked through the storage layer, bucket first,
    within the storage answer time: seqio's vocabulary reads it later through TensorFlow's own
    client, which cannot be bounded and ends in its own traceback."""
    if not remote.is_file(path, SETTING):
        raise UserError(
            f"vocabulary file not found: {path}; bind {SETTING} to an existing SentencePiece model"
        )


@functools.cache
def _byte_vocabulary(extra_ids: int) -> seqio.ByteVocabulary:
    return seqio.ByteVocabulary(extra_ids=extra_ids)
