"""The tokenizer files of a Hugging Face T5 directory, read on import and written on export.

A SentencePiece vocabulary is spiece.model plus T5Tokenizer's tokenizer_config.json (its number
of extra ids); ByT5's byte vocabulary has no model file, only ByT5Tokenizer's config. Both keep
seqio's sentinel order, <extra_id_0> the highest id: T5Tokenizer does so itself, while
ByT5Tokenizer numbers its additional special tokens in the order listed, so they are listed last
sentinel first. transformers' AutoTokenizer and pipeline("text2text-generation") load the
written files offline (tests/test_hf_format.py, tests/test_api.py).
"""

from __future__ import annotations

import json
import os

from etils import epath

from t5tpu.errors import UserError
from t5tpu.formats.vocabulary_source import BYTES, SENTENCEPIECE, VocabularySource

VOCABULARY_FILE = "spiece.model"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_FILE = "special_tokens_map.json"
CONFIG_FILE = "config.json"
BYTE_TOKENIZER = "ByT5Tokenizer"
# T5Tokenizer's and ByT5Tokenizer's defaults, which the published checkpoints use.
DEFAULT_EXTRA_IDS = {SENTENCEPIECE: 100, BYTES: 125}
_SPECIAL_TOKENS = {"pad_token": "<pad>", "eos_token": "</s>", "unk_token": "<unk>"}


def _json(path: epath.Path) -> dict:
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not valid JSON ({e})") from None


def read(directory: str) -> VocabularySource:
    """The vocabulary a Hugging Face directory carries (NONE when it has no tokenizer files)."""
    folder = epath.Path(directory)
    tokenizer = _json(folder / TOKENIZER_CONFIG_FILE)
    # Published ByT5 directories name their tokenizer in config.json, not always beside it.
    tokenizer_class = tokenizer.get("tokenizer_class") or _json(folder / CONFIG_FILE).get(
        "tokenizer_class"
    )
    if tokenizer_class == BYTE_TOKENIZER:
        return VocabularySource(BYTES, None, tokenizer.get("extra_ids", DEFAULT_EXTRA_IDS[BYTES]))
    if not (folder / VOCABULARY_FILE).exists():
        return VocabularySource()
    extra_ids = tokenizer.get("extra_ids", DEFAULT_EXTRA_IDS[SENTENCEPIECE])
    return VocabularySource(SENTENCEPIECE, os.path.join(directory, VOCABULARY_FILE), extra_ids)


def write(output: epath.Path, source: VocabularySource) -> None:
    """Writes the tokenizer files of `source` into `output` (nothing for NONE)."""
    if source.kind not in (SENTENCEPIECE, BYTES):
        return
    sentinels = [f"<extra_id_{i}>" for i in range(source.extra_ids)]
    if source.kind == BYTES:
        sentinels.reverse()
    special = {**_SPECIAL_TOKENS, "additional_special_tokens": sentinels}
    tokenizer = {
        "tokenizer_class": BYTE_TOKENIZER if source.kind == BYTES else "T5Tokenizer",
        "extra_ids": source.extra_ids,
        "model_max_length": 512,
        **special,
    }
    if source.kind == SENTENCEPIECE:
        epath.Path(source.model_file).copy(output / VOCABULARY_FILE, overwrite=True)
        tokenizer["legacy"] = True  # as the published T5 tokenizers: sentencepiece's own pieces
    write_json(output / TOKENIZER_CONFIG_FILE, tokenizer)
    write_json(output / SPECIAL_TOKENS_FILE, special)


def write_json(path: epath.Path, content: dict) -> None:
    path.write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")
