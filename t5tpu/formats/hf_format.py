"""Hugging Face T5 directories in and out: config.json + model.safetensors (or pytorch_model.bin,
either possibly sharded with an index file), and the tokenizer files (hf_tokenizer.py).

Covers t5-small ... t5-11b (T5 1.0: ReLU, output layer tied to the embedding and scaled by
1/sqrt(d_model)), google/t5-v1_1-*, google/flan-t5-* and google/mt5-* (gated-GELU, separate
lm_head). Hugging Face names follow the `t5` library's: block i, sublayer k, q/k/v/o, wi/wo,
and keeps the relative position bias in block 0 where t5tpu has one per stack. Its kernels are
torch Linear weights, [out, in]: the transpose of T5X's flat layout.

Safetensors is read and written here from its published layout (8-byte little-endian header
length, a JSON header of {name: dtype, shape, data_offsets}, then the raw little-endian bytes), so
gs:// directories are read tensor by tensor and no extra package is needed; pytorch_model.bin
needs torch, which is only imported for it. Files go through etils' epath, as everything t5tpu
reads and writes beside its checkpoints (TensorFlow's gs:// client on a TPU VM, gcsfs elsewhere).
"""

from __future__ import annotations

import functools
import json
import os
import struct

import flax.linen as nn
import ml_dtypes
import numpy as np
from etils import epath
from flax import traverse_util

from t5tpu.errors import UserError
from t5tpu.formats import hf_tokenizer, param_mapping
from t5tpu.formats.vocabulary_source import VocabularySource
from t5tpu.model.network import T5Config

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
SAFETENSORS_FILE = "model.safetensors"
TORCH_FILE = "pytorch_model.bin"
INDEX_SUFFIX = ".index.json"
LAYER_NORM_EPSILON = 1e-6  # t5tpu's RMSNorm epsilon, as in every published T5

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


def config_from_hf(hf: dict, source: str = CONFIG_FILE) -> T5Config:
    """The T5Config of a Hugging Face T5 config.json (as a dict)."""
    if hf.get("model_type", "t5") not in ("t5", "mt5"):
        raise UserError(f"{source} is a {hf.get('model_type')!r} model; t5tpu imports t5 and mt5")
    epsilon = hf.get("layer_norm_epsilon", LAYER_NORM_EPSILON)
    if not np.isclose(epsilon, LAYER_NORM_EPSILON, rtol=1e-6, atol=0):
        raise UserError(f"{source} has layer_norm_epsilon={epsilon}; t5tpu uses 1e-6 as T5 does")
    required = ("vocab_size", "d_model", "num_heads", "d_kv", "d_ff", "num_layers")
    missing = [key for key in required if key not in hf]
    if missing:
        raise UserError(f"{source} lacks {', '.join(missing)}; is it a T5 config.json?")
    return T5Config(
        vocab_size=hf["vocab_size"],
        emb_dim=hf["d_model"],
        num_heads=hf["num_heads"],
        head_dim=hf["d_kv"],
        mlp_dim=hf["d_ff"],
        num_encoder_layers=hf["num_layers"],
        num_decoder_layers=hf.get("num_decoder_layers") or hf["num_layers"],
        mlp_activations=_activations(hf.get("feed_forward_proj", "relu")),
        logits_via_embedding=hf.get("tie_word_embeddings", True),
        relative_attention_num_buckets=hf.get("relative_attention_num_buckets", 32),
        relative_attention_max_distance=hf.get("relative_attention_max_distance", 128),
    )


def hf_config(config: T5Config) -> dict:
    """A config.json for transformers' T5ForConditionalGeneration with this geometry."""
    activations = tuple(config.mlp_activations)
    if activations not in _ACTIVATIONS_TO_HF:
        raise UserError(
            f"mlp_activations={activations} has no Hugging Face T5 equivalent; export supports "
            f"{', '.join(map(str, _ACTIVATIONS_TO_HF))}"
        )
    return {
        "architectures": ["T5ForConditionalGeneration"],
        "model_type": "t5",
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


def _read_json(path: str) -> dict:
    return json.loads(epath.Path(path).read_text())


# ---------------------------------------------------------------------------------------------
# names and layouts


# Hugging Face's name of each t5tpu parameter: the `t5` library's, spelled as torch modules.
NAMES = param_mapping.T5Names(
    embedding="shared.weight",
    logits="lm_head.weight",
    relpos_bias="{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
    final_norm="{stack}.final_layer_norm.weight",
    layer_norm="{stack}.block.{index}.layer.{sublayer}.layer_norm.weight",
    mlp="{stack}.block.{index}.layer.{sublayer}.DenseReluDense.{part}.weight",
    attention="{stack}.block.{index}.layer.{sublayer}.{module}.{part}.weight",
)


def _transposed(name: str, flat_shape: tuple[int, ...]) -> bool:
    """torch Linear weights are [out, in]; the embedding is [vocab, embed] in both."""
    return len(flat_shape) == 2 and name != _EMBEDDING


def to_hf(name: str, array) -> np.ndarray:
    flat = param_mapping.to_flat_layout(name, param_mapping.as_float32(array))
    return np.ascontiguousarray(flat.T if _transposed(name, flat.shape) else flat)


# ---------------------------------------------------------------------------------------------
# weight files


class SafetensorsFile:
    """Reads one .safetensors file tensor by tensor (local or gs://)."""

    def __init__(self, path: str):
        self.path = path
        self._file = epath.Path(path).open("rb")
        (header_size,) = struct.unpack("<Q", self._file.read(8))
        try:
            header = json.loads(self._file.read(header_size))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise UserError(f"{path} is not a safetensors file (unreadable header)") from None
        header.pop("__metadata__", None)
        self.entries = header
        self._data_start = 8 + header_size

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(entry["shape"]) for name, entry in self.entries.items()}

    def read(self, name: str) -> np.ndarray:
        entry = self.entries[name]
        if entry["dtype"] not in _SAFETENSORS_DTYPES:
            raise UserError(f"{self.path}: {name} has dtype {entry['dtype']}, not a float type")
        begin, end = entry["data_offsets"]
        self._file.seek(self._data_start + begin)
        data = self._file.read(end - begin)
        return np.frombuffer(data, _SAFETENSORS_DTYPES[entry["dtype"]]).reshape(entry["shape"])


def write_safetensors(path: str, tensors: dict[str, np.ndarray]) -> None:
    """Writes float32 tensors as one .safetensors file, in the order given."""
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
    with epath.Path(path).open("wb") as f:
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
        with epath.Path(path).open("rb") as f:
            self._tensors = torch.load(f, map_location="cpu", weights_only=True)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(t.shape) for name, t in self._tensors.items()}

    def read(self, name: str) -> np.ndarray:
        return self._tensors[name].float().numpy()


def _shard_files(directory: str, base: str) -> list[str]:
    """[base] if the single file exists, else the files its index lists, else []."""
    if epath.Path(directory, base).exists():
        return [base]
    index = os.path.join(directory, base + INDEX_SUFFIX)
    if epath.Path(index).exists():
        return sorted(set(_read_json(index)["weight_map"].values()))
    return []


# ---------------------------------------------------------------------------------------------
# import and export


class HFCheckpoint(param_mapping.CheckpointReader):
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
        return config_from_hf(self._config_json, os.path.join(self.directory, CONFIG_FILE))

    def vocabulary(self) -> VocabularySource:
        """spiece.model, ByT5's bytes, or none."""
        return hf_tokenizer.read(self.directory)

    def stored_name(self, name: str) -> str:
        return NAMES(name)

    def source(self, name: str, shape: tuple[int, ...]) -> param_mapping.Source:
        flat = param_mapping.flat_layout_shape(name, shape)
        if not _transposed(name, flat):
            return super().source(name, shape)
        return param_mapping.Source(NAMES(name), flat[::-1], lambda array: array.T.reshape(shape))

    def shapes(self) -> dict[str, tuple[int, ...]]:
        tied = self._config_json.get("tie_word_embeddings", True)
        ignored = set(_ALWAYS_IGNORED) | ({"lm_head.weight"} if tied else set())
        return {
            name: opened.shapes()[name]
            for name, opened in self._files.items()
            if name not in ignored
        }

    def read(self, stored_name: str) -> np.ndarray:
        return self._files[stored_name].read(stored_name)

    @functools.cached_property
    def _config_json(self) -> dict:
        path = os.path.join(self.directory, CONFIG_FILE)
        if not epath.Path(path).exists():
            raise UserError(
                f"no {CONFIG_FILE} in {self.directory}; point at a Hugging Face T5 directory"
            )
        try:
            return _read_json(path)
        except json.JSONDecodeError as e:
            raise UserError(f"{path} is not valid JSON ({e})") from None

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
) -> None:
    """Writes config.json + model.safetensors, generation_config.json and the vocabulary's
    tokenizer files, which transformers' from_pretrained, AutoTokenizer and
    pipeline("text2text-generation") load offline. The tensors are the ones save_pretrained
    writes: no per-stack copies of the embedding, lm_head only when it is not tied."""
    flat = traverse_util.flatten_dict(nn.unbox(params), sep="/")
    tensors = {NAMES(name): to_hf(name, array) for name, array in flat.items()}
    output = epath.Path(output_dir)
    output.mkdir(parents=True, exist_ok=True)
    hf_tokenizer.write_json(output / CONFIG_FILE, hf_config(config))
    hf_tokenizer.write_json(output / GENERATION_CONFIG_FILE, _GENERATION_CONFIG)
    write_safetensors(os.path.join(output_dir, SAFETENSORS_FILE), dict(sorted(tensors.items())))
    hf_tokenizer.write(output, vocabulary or VocabularySource())


# T5's ids: 0 pads and starts the decoder, 1 ends a sequence, 2 is unknown; every T5 vocabulary
# (and t5tpu's decoding) uses them.
_GENERATION_CONFIG = {"decoder_start_token_id": 0, "eos_token_id": 1, "pad_token_id": 0}
