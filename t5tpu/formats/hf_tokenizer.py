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
from t5tpu.storage import atomic_files, remote, user_files

VOCABULARY_FILE = "spiece.model"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_FILE = "special_tokens_map.json"
CONFIG_FILE = "config.json"
BYTE_TOKENIZER = "ByT5Tokenizer"
# T5Tokenizer's and ByT5Tokenizer's defaults, which the published checkpoints use.
DEFAULT_EXTRA_IDS = {SENTENCEPIECE: 100, BYTES: 125}
# More sentinels than any T5 tokenizer has: a damaged count is refused, not carried into model.gin.
MAX_EXTRA_IDS = 1 << 20
_WHAT = "Hugging Face tokenizer"
_MAX_JSON_BYTES = 64 * 2**20
_SPECIAL_TOKENS = {"pad_token": "<pad>", "eos_token": "</s>", "unk_token": "<unk>"}


def _json(path: str) -> dict:
    """The JSON object in `path`, or {} when there is no such file."""
    if not remote.answered(epath.Path(path).exists, path=path, setting=_WHAT):
        return {}
    return user_files.read_json(path, what=_WHAT, max_bytes=_MAX_JSON_BYTES)


def _optional(settings: dict, key: str, expect, path: str):
    """settings[key], of type `expect`, or None when it is absent or null."""
    if settings.get(key) is None:
        return None
    return user_files.field(settings, key, expect, path=path, what=_WHAT)


def _extra_ids(tokenizer: dict, path: str, kind: str) -> int:
    extra_ids = _optional(tokenizer, "extra_ids", int, path)
    if extra_ids is None:
        return DEFAULT_EXTRA_IDS[kind]
    if not 0 <= extra_ids <= MAX_EXTRA_IDS:
        raise UserError(
            f"{_WHAT}: {path} has extra_ids={extra_ids}; a T5 tokenizer has 0 to "
            f"{MAX_EXTRA_IDS:,} (published ones 100 or 125)"
        )
    return extra_ids


def read(directory: str) -> VocabularySource:
    """The vocabulary a Hugging Face directory carries (NONE when it has no tokenizer files)."""
    tokenizer_path = os.path.join(directory, TOKENIZER_CONFIG_FILE)
    config_path = os.path.join(directory, CONFIG_FILE)
    tokenizer = _json(tokenizer_path)
    # Published ByT5 directories name their tokenizer in config.json, not always beside it.
    tokenizer_class = _optional(tokenizer, "tokenizer_class", str, tokenizer_path) or _optional(
        _json(config_path), "tokenizer_class", str, config_path
    )
    if tokenizer_class == BYTE_TOKENIZER:
        return VocabularySource(BYTES, None, _extra_ids(tokenizer, tokenizer_path, BYTES))
    model_file = os.path.join(directory, VOCABULARY_FILE)
    if not remote.answered(epath.Path(model_file).exists, path=model_file, setting=_WHAT):
        return VocabularySource()
    if not user_files.size(model_file, what=_WHAT):  # a folder is refused here too
        raise UserError(f"{_WHAT}: {model_file} is empty; give the SentencePiece model")
    extra_ids = _extra_ids(tokenizer, tokenizer_path, SENTENCEPIECE)
    return VocabularySource(SENTENCEPIECE, model_file, extra_ids)


def write(
    output: epath.Path,
    source: VocabularySource,
    *,
    model_max_length: int = 512,
    setting: str = "--output_dir",
) -> None:
    """Writes the tokenizer files of `source` into `output` (nothing for NONE), each atomically
    (storage.atomic_files; `setting` is named when `output` cannot be written); the tokenizer
    cuts to `model_max_length` tokens with truncation=True (the run's input length)."""
    if source.kind not in (SENTENCEPIECE, BYTES):
        return
    sentinels = [f"<extra_id_{i}>" for i in range(source.extra_ids)]
    if source.kind == BYTES:
        sentinels.reverse()
    special = {**_SPECIAL_TOKENS, "additional_special_tokens": sentinels}
    tokenizer = {
        "tokenizer_class": BYTE_TOKENIZER if source.kind == BYTES else "T5Tokenizer",
        "extra_ids": source.extra_ids,
        "model_max_length": model_max_length,
        # sentencepiece's decoding as it is: "a , b" stays as the model wrote it.
        "clean_up_tokenization_spaces": False,
        **special,
    }
    if source.kind == SENTENCEPIECE:
        model = epath.Path(source.model_file).read_bytes()  # a few hundred KB to a few MB
        atomic_files.write_atomically(output / VOCABULARY_FILE, model, setting=setting)
        tokenizer["legacy"] = True  # as the published T5 tokenizers: sentencepiece's own pieces
    write_json(output / TOKENIZER_CONFIG_FILE, tokenizer, setting=setting)
    write_json(output / SPECIAL_TOKENS_FILE, special, setting=setting)


def user_defined_pieces(source: VocabularySource) -> list[str]:
    """The SentencePiece model's user-defined pieces (the bundled vocabulary's <SEP>):
    transformers' fast tokenizer, converted from spiece.model, drops the "▁" sentencepiece puts
    before one, so it gives other ids for text holding them (its slow tokenizer does not)."""
    if source.kind != SENTENCEPIECE:
        return []
    from sentencepiece import sentencepiece_model_pb2  # protobuf's, read only here

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(epath.Path(source.model_file).read_bytes())
    user_defined = sentencepiece_model_pb2.ModelProto.SentencePiece.USER_DEFINED
    return [piece.piece for piece in proto.pieces if piece.type == user_defined]


def write_json(path: epath.Path, content: dict, *, setting: str = "--output_dir") -> None:
    text = json.dumps(content, indent=2, sort_keys=True) + "\n"
    atomic_files.write_atomically(path, text, setting=setting)
