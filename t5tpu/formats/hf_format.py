"""Hugging Face T5 directories in and out: config.json + model.safetensors (or pytorch_model.bin,
either possibly sharded with an index file), and the tokenizer files (hf_tokenizer.py).

Covers t5-small ... t5-11b (T5 1.0: ReLU, output layer tied to the embedding and scaled by
1/sqrt(d_model)), google/t5-v1_1-*, google/flan-t5-* and google/mt5-* (gated-GELU, separate
lm_head), and google/umt5-* (model_type 'umt5': mT5's with a position bias in every layer).
Hugging Face names follow the `t5` library's: block i, sublayer k, q/k/v/o, wi/wo, and keeps
the relative position bias in block 0 where t5tpu has one per stack (umT5: in each block's
self-attention). Its kernels are torch Linear weights, [out, in]: the transpose of T5X's flat
layout.

Safetensors is read and written here from its published layout (8-byte little-endian header
length, a JSON header of {name: dtype, shape, data_offsets}, then the raw little-endian bytes), so
gs:// directories are read tensor by tensor and no extra package is needed; pytorch_model.bin
needs torch, which is only imported for it. Files go through etils' epath, as everything t5tpu
reads and writes beside its checkpoints (TensorFlow's gs:// client on a TPU VM, gcsfs elsewhere).
"""

from __future__ import annotations

import functools
import json
import math
import os
import struct

import flax.linen as nn
import ml_dtypes
import numpy as np
from etils import epath
from flax import traverse_util

from t5tpu import validators
from t5tpu.errors import UserError, one_line_message
from t5tpu.formats import checkpoint_reader, hf_run_record, hf_tokenizer
from t5tpu.formats.vocabulary_source import VocabularySource
from t5tpu.model.network import T5Config
from t5tpu.storage import atomic_files, remote, user_files
from t5tpu.storage.run_record import RunRecord

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
SAFETENSORS_FILE = "model.safetensors"
TORCH_FILE = "pytorch_model.bin"
INDEX_SUFFIX = ".index.json"
LAYER_NORM_EPSILON = 1e-6  # t5tpu's RMSNorm epsilon, as in every published T5

# Bytes per element of every dtype safetensors defines: each header entry is checked against
# the file with them; only the float ones below are read.
_SAFETENSORS_ITEMSIZES = {
    **dict.fromkeys(("BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3"), 1),
    **dict.fromkeys(("I16", "U16", "F16", "BF16"), 2),
    **dict.fromkeys(("I32", "U32", "F32"), 4),
    **dict.fromkeys(("I64", "U64", "F64"), 8),
}
_SAFETENSORS_DTYPES = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
}
# Tensors Hugging Face stores that t5tpu does not keep: the embedding again for each stack
# (tied to shared.weight), and a cross-attention position bias that T5 never uses.
_ALWAYS_IGNORED = (
    "encoder.embed_tokens.weight",
    "decoder.embed_tokens.weight",
    "decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight",
)
_EMBEDDING = "token_embedder/embedding"
# How errors name the files read here.
_CONFIG_WHAT = "Hugging Face checkpoint"
_WEIGHTS_WHAT = "safetensors file"
# config.json and the index files are a few kilobytes; safetensors' own reader refuses headers
# beyond 100 MB, which no T5's few hundred tensors come near.
_MAX_JSON_BYTES = 64 * 2**20
_MAX_HEADER_BYTES = 100_000_000

# ---------------------------------------------------------------------------------------------
# config.json <-> T5Config

# Hugging Face's activation names (as T5Config derives them from feed_forward_proj) -> t5tpu's.
_ACTIVATIONS_FROM_HF = {"relu": "relu", "gelu_new": "gelu", "silu": "silu", "swish": "silu"}
_ACTIVATIONS_TO_HF = {
    ("relu",): "relu",
    ("gelu",): "gelu_new",
    ("silu",): "silu",
    ("gelu", "linear"): "gated-gelu",
    ("silu", "linear"): "gated-silu",
    ("relu", "linear"): "gated-relu",
}


def _activations(feed_forward_proj: str) -> tuple[str, ...]:
    gated = feed_forward_proj.startswith("gated-")
    # Hugging Face runs 'gated-gelu' with the tanh approximation ('gelu_new'), as T5 1.1 does;
    # a plain 'gelu' is the exact erf GELU, which t5tpu does not implement.
    hf_name = "gelu_new" if feed_forward_proj == "gated-gelu" else feed_forward_proj.split("-")[-1]
    if hf_name not in _ACTIVATIONS_FROM_HF or feed_forward_proj.count("-") > int(gated):
        raise UserError(
            f"feed_forward_proj={feed_forward_proj!r} in {CONFIG_FILE} is not supported; t5tpu "
            f"runs {', '.join(sorted(set(_ACTIVATIONS_TO_HF.values())))}"
        )
    activation = _ACTIVATIONS_FROM_HF[hf_name]
    return (activation, "linear") if gated else (activation,)


# model_type -> (transformers' class, the feed_forward_proj its config class defaults to).
_MODEL_TYPES = {
    "t5": ("T5ForConditionalGeneration", "relu"),
    "mt5": ("MT5ForConditionalGeneration", "gated-gelu"),
    "umt5": ("UMT5ForConditionalGeneration", "gated-gelu"),
}


def _model_type(get, source: str) -> str:
    """config.json's model_type; google/umt5-*'s name none, only their UMT5 architecture."""
    model_type = get("model_type", str)
    if model_type is None:
        architectures = get("architectures", list, [])
        umt5 = any(str(name).startswith("UMT5") for name in architectures)
        model_type = "umt5" if umt5 else "t5"
    if model_type not in _MODEL_TYPES:
        raise UserError(
            f"{source} is a {model_type!r} model; t5tpu imports {', '.join(_MODEL_TYPES)}"
        )
    return model_type


def config_from_hf(hf: dict, source: str = CONFIG_FILE) -> T5Config:
    """The T5Config of a Hugging Face T5 config.json (as a dict); wrong types and sizes that
    are not positive integers are refused in one line naming `source`."""
    required = ("vocab_size", "d_model", "num_heads", "d_kv", "d_ff", "num_layers")
    missing = [key for key in required if hf.get(key) is None]
    if missing:
        raise UserError(f"{source} lacks {', '.join(missing)}; is it a T5 config.json?")

    def get(key: str, expect, default=None):
        # null counts as absent, as transformers reads it
        if hf.get(key) is None:
            return default
        value = user_files.field(hf, key, expect, path=source, what=_CONFIG_WHAT)
        if expect is int and value < 1:
            raise UserError(f"{source} has {key}={value}; a T5 config.json's sizes are positive")
        return value

    model_type = _model_type(get, source)
    epsilon = get("layer_norm_epsilon", (int, float), LAYER_NORM_EPSILON)
    if not np.isclose(epsilon, LAYER_NORM_EPSILON, rtol=1e-6, atol=0):
        raise UserError(f"{source} has layer_norm_epsilon={epsilon}; t5tpu uses 1e-6 as T5 does")
    sizes = {key: get(key, int) for key in required}
    return T5Config(
        vocab_size=sizes["vocab_size"],
        emb_dim=sizes["d_model"],
        num_heads=sizes["num_heads"],
        head_dim=sizes["d_kv"],
        mlp_dim=sizes["d_ff"],
        num_encoder_layers=sizes["num_layers"],
        num_decoder_layers=get("num_decoder_layers", int, sizes["num_layers"]),
        mlp_activations=_activations(get("feed_forward_proj", str, _MODEL_TYPES[model_type][1])),
        logits_via_embedding=get("tie_word_embeddings", bool, True),
        relative_attention_num_buckets=get("relative_attention_num_buckets", int, 32),
        relative_attention_max_distance=get("relative_attention_max_distance", int, 128),
        relative_bias_per_layer=model_type == "umt5",
    )


def hf_config(config: T5Config) -> dict:
    """A config.json for transformers' T5ForConditionalGeneration with this geometry
    (UMT5ForConditionalGeneration with a position bias in every layer)."""
    activations = tuple(config.mlp_activations)
    if activations not in _ACTIVATIONS_TO_HF:
        raise UserError(
            f"mlp_activations={activations} has no Hugging Face T5 equivalent; export supports "
            f"{', '.join(map(str, _ACTIVATIONS_TO_HF))}"
        )
    model_type = "umt5" if config.relative_bias_per_layer else "t5"
    return {
        "architectures": [_MODEL_TYPES[model_type][0]],
        "model_type": model_type,
        "vocab_size": config.vocab_size,
        "d_model": config.emb_dim,
        "d_kv": config.head_dim,
        "d_ff": config.mlp_dim,
        "num_heads": config.num_heads,
        "num_layers": config.num_encoder_layers,
        "num_decoder_layers": config.num_decoder_layers,
        "feed_forward_proj": _ACTIVATIONS_TO_HF[activations],
        "tie_word_embeddings": config.logits_via_embedding,
        "relative_attention_num_buckets": config.relative_attention_num_buckets,
        "relative_attention_max_distance": config.relative_attention_max_distance,
        "layer_norm_epsilon": LAYER_NORM_EPSILON,
        "dropout_rate": config.dropout_rate,
        "initializer_factor": 1.0,
        "is_encoder_decoder": True,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "decoder_start_token_id": 0,
        "torch_dtype": "float32",
        "use_cache": True,
    }


def _relpos_name(config: T5Config) -> str:
    """The encoder's (first) position-bias table: the stack's, or layer 0's (umT5)."""
    if config.relative_bias_per_layer:
        return "encoder/layers_0/relpos_bias/rel_embedding"
    return "encoder/relpos_bias/rel_embedding"


def _read_json(path: str) -> dict:
    return user_files.read_json(path, what=_CONFIG_WHAT, max_bytes=_MAX_JSON_BYTES)


# ---------------------------------------------------------------------------------------------
# names and layouts


# Hugging Face's name of each t5tpu parameter: the `t5` library's, spelled as torch modules.
NAMES = checkpoint_reader.T5Names(
    embedding="shared.weight",
    logits="lm_head.weight",
    relpos_bias="{stack}.block.{index}.layer.0.SelfAttention.relative_attention_bias.weight",
    final_norm="{stack}.final_layer_norm.weight",
    layer_norm="{stack}.block.{index}.layer.{sublayer}.layer_norm.weight",
    mlp="{stack}.block.{index}.layer.{sublayer}.DenseReluDense.{part}.weight",
    attention="{stack}.block.{index}.layer.{sublayer}.{module}.{part}.weight",
)


def _transposed(name: str, flat_shape: tuple[int, ...]) -> bool:
    """torch Linear weights are [out, in]; the embedding is [vocab, embed] in both."""
    return len(flat_shape) == 2 and name != _EMBEDDING


def to_hf(name: str, array) -> np.ndarray:
    flat = checkpoint_reader.to_flat_layout(name, checkpoint_reader.as_float32(array))
    return np.ascontiguousarray(flat.T if _transposed(name, flat.shape) else flat)


# ---------------------------------------------------------------------------------------------
# weight files


class SafetensorsFile:
    """Reads one .safetensors file tensor by tensor (local or gs://). The header is checked
    against the file before anything it declares is read: its length against the file's size,
    and each tensor's dtype, shape and data_offsets against each other and the data's size."""

    def __init__(self, path: str):
        self.path = path
        size = user_files.size(path, what=_WEIGHTS_WHAT)
        if size < 8:
            raise UserError(f"{_WEIGHTS_WHAT}: {path} is {size} bytes, too short for its header")
        (header_size,) = struct.unpack("<Q", user_files.read_range(path, 0, 8, what=_WEIGHTS_WHAT))
        available = min(size - 8, _MAX_HEADER_BYTES)
        user_files.check_length(header_size, available=available, path=path, what=_WEIGHTS_WHAT)
        header = self._header(user_files.read_range(path, 8, header_size, what=_WEIGHTS_WHAT))
        self._data_start = 8 + header_size
        data_size = size - self._data_start
        self.entries = {name: self._entry(name, entry, data_size) for name, entry in header.items()}
        self._file = None

    def _header(self, raw: bytes) -> dict:
        try:
            header = json.loads(raw.decode("utf-8"))
        except ValueError:  # UnicodeDecodeError included
            header = None
        if not isinstance(header, dict):
            raise UserError(
                f"{_WEIGHTS_WHAT}: {self.path} is not a safetensors file (its header is not a "
                "JSON object); give an undamaged copy"
            )
        header.pop("__metadata__", None)
        return header

    def _entry(self, name: str, entry, data_size: int) -> tuple[str, tuple[int, ...], int, int]:
        """(dtype, shape, begin, end) of tensor `name`, consistent with the file."""
        where = f"{self.path} (tensor {name!r})"

        def damaged(what: str):
            return UserError(f"{_WEIGHTS_WHAT}: {where} {what}; give an undamaged copy")

        if not isinstance(entry, dict):
            raise damaged(f"is a JSON {type(entry).__name__}, not an object")
        dtype = user_files.field(entry, "dtype", str, path=where, what=_WEIGHTS_WHAT)
        shape = user_files.field(entry, "shape", list, path=where, what=_WEIGHTS_WHAT)
        offsets = user_files.field(entry, "data_offsets", list, path=where, what=_WEIGHTS_WHAT)
        if dtype not in _SAFETENSORS_ITEMSIZES:
            raise damaged(f"has dtype {dtype!r}, which is not a safetensors dtype")
        if not all(_is_count(d) for d in shape):
            raise damaged(f"has shape {shape}, not a list of sizes")
        if len(offsets) != 2 or not all(_is_count(o) for o in offsets) or offsets[0] > offsets[1]:
            raise damaged(f"has data_offsets {offsets}, not [begin, end]")
        begin, end = offsets
        user_files.check_length(end, available=data_size, path=where, what=_WEIGHTS_WHAT)
        if end - begin != math.prod(shape) * _SAFETENSORS_ITEMSIZES[dtype]:
            raise damaged(f"holds {end - begin:,} bytes, not those of a {dtype} {shape}")
        return dtype, tuple(shape), begin, end

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: entry[1] for name, entry in self.entries.items()}

    def read(self, name: str) -> np.ndarray:
        dtype, shape, begin, end = self.entries[name]
        if dtype not in _SAFETENSORS_DTYPES:
            raise UserError(f"{self.path}: {name} has dtype {dtype}, not a float type")
        if self._file is None:
            self._file = user_files.open_binary(self.path, what=_WEIGHTS_WHAT)
        self._file.seek(self._data_start + begin)
        data = self._file.read(end - begin)
        if len(data) != end - begin:  # the file was cut after its header was read
            raise UserError(f"{_WEIGHTS_WHAT}: {self.path} is cut short in {name}")
        return np.frombuffer(data, _SAFETENSORS_DTYPES[dtype]).reshape(shape)


def _is_count(value) -> bool:
    return validators.is_whole(value, low=0)


def write_safetensors(
    path: str, tensors: dict[str, np.ndarray], *, setting: str = "--output_dir"
) -> None:
    """Writes float32 tensors as one .safetensors file, in the order given, atomically
    (storage.atomic_files; `setting` is named when it cannot be written)."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    arrays = {name: np.ascontiguousarray(a, dtype="<f4") for name, a in tensors.items()}
    for name, array in arrays.items():
        header[name] = {
            "dtype": "F32",
            "shape": list(array.shape),
            "data_offsets": [offset, offset + array.nbytes],
        }
        offset += array.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    with atomic_files.atomic_file(path, setting=setting, mode="wb") as f:
        f.write(struct.pack("<Q", len(encoded)) + encoded)
        for array in arrays.values():
            f.write(array.tobytes())


class TorchFile:
    """A pytorch_model.bin state dict (needs torch, which t5tpu does not depend on)."""

    def __init__(self, path: str):
        try:
            import torch
        except ImportError:
            raise UserError(
                f"{path} is a PyTorch file and torch is not installed; pip install torch, or "
                "use a directory with model.safetensors"
            ) from None
        user_files.size(path, what=_CONFIG_WHAT)  # there, and a file
        try:
            with epath.Path(path).open("rb") as f:
                tensors = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as e:  # torch raises many unrelated types on damaged bytes
            raise UserError(
                f"{_CONFIG_WHAT}: {path} is not a readable PyTorch state dict "
                f"({one_line_message(e)[:160]}); give an undamaged copy"
            ) from None
        if not isinstance(tensors, dict) or not all(
            isinstance(name, str) and isinstance(t, torch.Tensor) for name, t in tensors.items()
        ):
            raise UserError(f"{_CONFIG_WHAT}: {path} is not a state dict of named tensors")
        self._tensors = tensors

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(t.shape) for name, t in self._tensors.items()}

    def read(self, name: str) -> np.ndarray:
        return self._tensors[name].float().numpy()


def _exists(path: str) -> bool:
    return remote.answered(epath.Path(path).exists, path=path, setting=_CONFIG_WHAT)


def _shard_files(directory: str, base: str) -> list[str]:
    """[base] if the single file exists, else the files its index lists, else []."""
    if _exists(os.path.join(directory, base)):
        return [base]
    index = os.path.join(directory, base + INDEX_SUFFIX)
    if not _exists(index):
        return []
    weight_map = user_files.field(
        _read_json(index), "weight_map", dict, path=index, what=_CONFIG_WHAT
    )
    shards = set(weight_map.values())
    if not shards or not all(isinstance(s, str) and s and "/" not in s for s in shards):
        raise UserError(
            f"{_CONFIG_WHAT}: {index}'s weight_map does not name the files beside it; give an "
            "undamaged copy"
        )
    return sorted(shards)


# ---------------------------------------------------------------------------------------------
# import and export


def directory_run_record(directory: str) -> RunRecord | None:
    """What config.json, generation_config.json and tokenizer_config.json of a Hugging Face
    directory say of the run (hf_run_record.py; a t5tpu export carries its whole record)."""
    files = {}
    for name in (CONFIG_FILE, GENERATION_CONFIG_FILE, hf_tokenizer.TOKENIZER_CONFIG_FILE):
        path = os.path.join(directory, name)
        files[name] = _read_json(path) if _exists(path) else {}
    return hf_run_record.record_from_files(
        files[CONFIG_FILE],
        files[GENERATION_CONFIG_FILE],
        files[hf_tokenizer.TOKENIZER_CONFIG_FILE],
        where=os.path.join(directory, CONFIG_FILE),
    )


class HFCheckpoint(checkpoint_reader.CheckpointReader):
    """A Hugging Face T5 directory. config.json and the weight files are read when first
    needed (a pytorch_model.bin is read whole): the step and the vocabulary need neither."""

    step = 0  # Hugging Face directories do not record a training step

    def __init__(self, directory: str):
        self.directory = directory
        self.description = f"Hugging Face checkpoint {directory}"

    @staticmethod
    def recognizes(path: str) -> bool:
        return epath.Path(path, CONFIG_FILE).exists()

    def config(self) -> T5Config:
        """config.json's geometry, once checked against the weight files' shapes: a damaged
        size or depth would otherwise build (and trace) a model of any size before the
        weights are compared with it."""
        config = self._hf_config
        shapes = self.shapes()
        model = {
            _EMBEDDING: (config.vocab_size, config.emb_dim),
            "encoder/layers_0/attention/query/kernel": (
                config.emb_dim,
                config.num_heads,
                config.head_dim,
            ),
            _relpos_name(config): (
                config.num_heads,
                config.relative_attention_num_buckets,
            ),
            "encoder/layers_0/mlp/wo/kernel": (config.mlp_dim, config.emb_dim),
        }
        found = [self.source(name, shape) for name, shape in model.items()]
        wrong = [
            f"{s.name} is {shapes[s.name]}, not {s.shape}"
            for s in found
            if s.name in shapes and shapes[s.name] != s.shape
        ]
        for stack, layers in (
            ("encoder", config.num_encoder_layers),
            ("decoder", config.num_decoder_layers),
        ):
            blocks = {n.split(".")[2] for n in shapes if n.startswith(f"{stack}.block.")}
            if len(blocks) != layers:
                wrong.append(f"{len(blocks)} {stack} blocks, not {layers}")
        if wrong:
            raise UserError(
                f"{os.path.join(self.directory, CONFIG_FILE)} does not describe the weights "
                f"beside it ({'; '.join(sorted(wrong)[:4])}); give the config.json saved with them"
            )
        return config

    def vocabulary(self) -> VocabularySource:
        """spiece.model, ByT5's bytes, or none."""
        return hf_tokenizer.read(self.directory)

    def run_record(self) -> RunRecord | None:
        return directory_run_record(self.directory)

    def stored_name(self, name: str) -> str:
        return NAMES(name)

    def source(self, name: str, shape: tuple[int, ...]) -> checkpoint_reader.Source:
        flat = checkpoint_reader.flat_layout_shape(name, shape)
        if not _transposed(name, flat):
            return super().source(name, shape)
        return checkpoint_reader.Source(
            NAMES(name), flat[::-1], lambda array: array.T.reshape(shape)
        )

    def shapes(self) -> dict[str, tuple[int, ...]]:
        tied = self._hf_config.logits_via_embedding
        ignored = set(_ALWAYS_IGNORED) | ({"lm_head.weight"} if tied else set())
        return {
            name: opened.shapes()[name]
            for name, opened in self._files.items()
            if name not in ignored
        }

    def read(self, stored_name: str) -> np.ndarray:
        return self._files[stored_name].read(stored_name)

    @functools.cached_property
    def _hf_config(self) -> T5Config:
        """config.json as it is, not yet compared with the weights."""
        path = os.path.join(self.directory, CONFIG_FILE)
        if not _exists(path):
            raise UserError(
                f"no {CONFIG_FILE} in {self.directory}; point at a Hugging Face T5 directory"
            )
        return config_from_hf(_read_json(path), path)

    @functools.cached_property
    def _files(self) -> dict:
        """Tensor name -> the SafetensorsFile or TorchFile holding it, across the shards."""
        for base, reader in ((SAFETENSORS_FILE, SafetensorsFile), (TORCH_FILE, TorchFile)):
            shards = _shard_files(self.directory, base)
            if shards:
                files = {}
                for shard in shards:
                    opened = reader(os.path.join(self.directory, shard))
                    files.update(dict.fromkeys(opened.shapes(), opened))
                return files
        raise UserError(
            f"no {SAFETENSORS_FILE} or {TORCH_FILE} (or their {INDEX_SUFFIX}) in {self.directory}"
        )


def export(
    params,
    config: T5Config,
    output_dir: str,
    vocabulary: VocabularySource | None = None,
    *,
    record: RunRecord | None = None,
    setting: str = "--output_dir",
) -> None:
    """Writes config.json + model.safetensors, generation_config.json and the vocabulary's
    tokenizer files, which transformers' from_pretrained, AutoTokenizer and
    pipeline("text2text-generation") load offline; the run's `record` in their own fields
    (hf_run_record.py), so they answer as t5tpu does. The tensors are the ones save_pretrained
    writes: no per-stack copies of the embedding, lm_head only when it is not tied. Each file
    is written atomically; `setting` is named when `output_dir` cannot be written."""
    flat = traverse_util.flatten_dict(nn.unbox(params), sep="/")
    tensors = {NAMES(name): to_hf(name, array) for name, array in flat.items()}
    output = epath.Path(output_dir)
    with atomic_files.write_faults(output_dir, setting):
        output.mkdir(parents=True, exist_ok=True)
    described = {**hf_config(config), **hf_run_record.config_fields(record)}
    hf_tokenizer.write_json(output / CONFIG_FILE, described, setting=setting)
    generation = hf_run_record.generation_config(record)
    hf_tokenizer.write_json(output / GENERATION_CONFIG_FILE, generation, setting=setting)
    tensors = dict(sorted(tensors.items()))
    write_safetensors(os.path.join(output_dir, SAFETENSORS_FILE), tensors, setting=setting)
    max_length = hf_run_record.model_max_length(record)
    hf_tokenizer.write(
        output, vocabulary or VocabularySource(), model_max_length=max_length, setting=setting
    )
