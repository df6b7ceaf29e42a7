"""The vocabulary a checkpoint carries, as the converters read it and write it on: a SentencePiece
model file with its number of extra ids (T5, mT5, Flan-T5), UTF-8 bytes (ByT5: no file), or none
(T5X and Mesh TF checkpoints do not record theirs; the experiment's model gin binds it).

It is a plain record, so `t5tpu convert` can carry it from a Hugging Face directory into model.gin
without loading it: seqio, and with it TensorFlow, is imported only by `load`.
"""

from __future__ import annotations

import dataclasses

SENTENCEPIECE, BYTES, NONE = "sentencepiece", "bytes", "none"


@dataclasses.dataclass(frozen=True)
class VocabularySource:
    kind: str = NONE
    model_file: str | None = None  # the SentencePiece model, for kind 'sentencepiece'
    extra_ids: int = 0  # sentinels added after the model's own ids (<extra_id_0> is the last)

    def gin_bindings(self) -> list[str]:
        """The lines of a model gin file that bind this vocabulary (none for NONE)."""
        if self.kind == SENTENCEPIECE:
            return [
                f"default_vocabulary.sentencepiece_model_file = {self.model_file!r}",
                f"default_vocabulary.extra_ids = {self.extra_ids}",
            ]
        if self.kind == BYTES:
            return [
                "default_vocabulary.kind = 'bytes'",
                f"default_vocabulary.extra_ids = {self.extra_ids}",
            ]
        return []

    def load(self):
        """The seqio vocabulary, or None for NONE."""
        if self.kind == NONE:
            return None
        from t5tpu.data import vocab  # seqio and TensorFlow: only when one is wanted

        return vocab.default_vocabulary(self.model_file, self.extra_ids, kind=self.kind)


def of_vocabulary(vocabulary) -> VocabularySource:
    """The source of a loaded seqio vocabulary (None gives NONE)."""
    if vocabulary is None:
        return VocabularySource()
    model_file = getattr(vocabulary, "sentencepiece_model_file", None)
    if model_file:
        return VocabularySource(SENTENCEPIECE, model_file, vocabulary.extra_ids)
    # seqio's ByteVocabulary is the only other kind t5tpu's gins bind (data/vocab.py).
    return VocabularySource(BYTES, None, vocabulary.extra_ids)
