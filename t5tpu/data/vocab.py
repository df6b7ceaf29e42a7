"""The vocabulary of the model being run.

Model gin files bind `default_vocabulary.sentencepiece_model_file`: the T5 ones bind the public
cc_all.32000.100extra model (with extra_ids=100), the tiny CPU ones bind
`@bundled_vocabulary_file()`, the 1,024-piece model that scripts/train_cpu_vocab.py trains on the
bundled Quora sample. Tasks are registered with this vocabulary after gin has been parsed.
"""

import functools
import os

import gin
import seqio
import tensorflow as tf

from t5tpu import package_files
from t5tpu.errors import UserError


@gin.configurable
def bundled_vocabulary_file() -> str:
    """The absolute path of the small SentencePiece model shipped inside the package."""
    return os.path.abspath(package_files.asset("cpu_vocab.model"))


@gin.configurable
def default_vocabulary(
    sentencepiece_model_file: str | None = None, extra_ids: int = 0
) -> seqio.SentencePieceVocabulary:
    """The vocabulary bound in gin; None means the bundled CPU vocabulary.

    Repeated calls with the same file and extra_ids return the same object, so tasks, feature
    converters and decoders all share one loaded model.
    """
    path = sentencepiece_model_file or bundled_vocabulary_file()
    # Checked here, before anything is loaded, so a typo ends in one clear line; gs:// paths are
    # left to fail when read, since asking the bucket costs a round trip and credentials.
    if not path.startswith("gs://") and not tf.io.gfile.exists(path):
        raise UserError(
            f"vocabulary file not found: {path}; bind default_vocabulary.sentencepiece_model_file"
            " to an existing SentencePiece model"
        )
    return _load_vocabulary(path, extra_ids)


@functools.cache
def _load_vocabulary(path: str, extra_ids: int) -> seqio.SentencePieceVocabulary:
    return seqio.SentencePieceVocabulary(path, extra_ids=extra_ids)
