"""Hugging Face T5Gemma directories (model_type 't5gemma', T5GemmaForConditionalGeneration) in
and out: config.json <-> T5GemmaConfig, and the tensors of model.safetensors <-> t5tpu's
parameter tree (t5gemma_network.py).

Hugging Face keeps an embedding per stack (model.encoder.embed_tokens, model.decoder.
embed_tokens) and ties lm_head.out_proj to the decoder's, so lm_head is neither read nor
written. Its kernels are torch Linear weights, [out, in], with heads laid out head-major in the
out features (q_proj: heads * head_dim rows); its norm weights are Gemma's offsets from 1, the
very values t5tpu's GemmaNorm keeps as `scale`. The safetensors reading and writing are
hf_format.py's.
"""

from __future__ import annotations

import functools
import math
import os

import flax.linen as nn
import numpy as np
from etils import epath
from flax import traverse_util

from t5tpu.errors import UserError
from t5tpu.formats import checkpoint_reader, hf_format, hf_run_record, hf_tokenizer
from t5tpu.formats.vocabulary_source import SENTENCEPIECE, VocabularySource
from t5tpu.model import lora, param_shapes
from t5tpu.model.t5gemma_network import GLOBAL, LOCAL, T5GemmaConfig, T5GemmaStack
from t5tpu.storage import atomic_files
from t5tpu.storage.run_record import RunRecord

MODEL_TYPE = "t5gemma"
TOKENIZER_FILE = "tokenizer.model"  # Gemma's SentencePiece model, as Hugging Face ships it
TIED_LM_HEAD = "lm_head.out_proj.weight"  # the decoder's embedding again
_LAYER_TYPES = {"sliding_attention": LOCAL, "full_attention": GLOBAL}
# t5tpu's name part -> Hugging Face's, within a layer.
_PARTS = {
    "pre_attention_layer_norm": "pre_self_attn_layernorm",
    "post_attention_layer_norm": "post_self_attn_layernorm",
    "pre_self_attention_layer_norm": "pre_self_attn_layernorm",
    "post_self_attention_layer_norm": "post_self_attn_layernorm",
    "pre_cross_attention_layer_norm": "pre_cross_attn_layernorm",
    "post_cross_attention_layer_norm": "post_cross_attn_layernorm",
    "pre_mlp_layer_norm": "pre_feedforward_layernorm",
    "post_mlp_layer_norm": "post_feedforward_layernorm",
    "attention": "self_attn",
    "self_attention": "self_attn",
    "encoder_decoder_attention": "cross_attn",
    "query": "q_proj",
    "key": "k_proj",
    "value": "v_proj",
    "out": "o_proj",
    "wi_0": "gate_proj",
    "wi_1": "up_proj",
    "wo": "down_proj",
}
# What t5tpu's T5Gemma computes and a config.json must say.
_FIXED = (("hidden_activation", "gelu_pytorch_tanh"), ("rms_norm_eps", 1e-6))


def is_t5gemma(hf: dict) -> bool:
    return hf.get("model_type") == MODEL_TYPE


def _stack_from_hf(module: dict, where: str) -> T5GemmaStack:
    for field, value in _FIXED:
        if module.get(field, value) != value:
            raise UserError(f"{where}: {field} = {module[field]!r}; t5tpu runs {value!r} only")
    if module.get("attention_bias") or module.get("rope_scaling"):
        raise UserError(f"{where}: attention biases and rope_scaling are not supported")
    layers = int(module["num_hidden_layers"])
    types = tuple(_LAYER_TYPES[t] for t in module.get("layer_types") or ())
    alternating = tuple(LOCAL if i % 2 == 0 else GLOBAL for i in range(layers))
    return T5GemmaStack(
        emb_dim=int(module["hidden_size"]),
        num_heads=int(module["num_attention_heads"]),
        num_kv_heads=int(module["num_key_value_heads"]),
        head_dim=int(module["head_dim"]),
        mlp_dim=int(module["intermediate_size"]),
        num_layers=layers,
        query_pre_attn_scalar=float(module["query_pre_attn_scalar"]),
        sliding_window=int(module["sliding_window"]),
        layer_types=None if types in ((), alternating) else types,
        attn_logit_softcapping=module.get("attn_logit_softcapping"),
        rope_theta=float(module.get("rope_theta", 10000.0)),
    )


def config_from_hf(hf: dict, source: str = hf_format.CONFIG_FILE) -> T5GemmaConfig:
    """The T5GemmaConfig of a T5Gemma config.json (as a dict)."""
    if not is_t5gemma(hf):
        raise UserError(f"{source}: model_type {hf.get('model_type')!r} is not {MODEL_TYPE!r}")
    if not hf.get("tie_word_embeddings", True):
        raise UserError(f"{source}: an lm_head apart from the decoder's embedding is unsupported")
    encoder = _stack_from_hf(hf["encoder"], f"{source} (encoder)")
    decoder = _stack_from_hf(hf["decoder"], f"{source} (decoder)")
    return T5GemmaConfig(
        vocab_size=int(hf["decoder"].get("vocab_size", hf.get("vocab_size"))),
        encoder=encoder,
        decoder=None if decoder == encoder else decoder,
        final_logit_softcapping=hf["decoder"].get("final_logit_softcapping"),
        decoder_start_id=int(hf["decoder"].get("bos_token_id", 2)),
        dropout_rate=float(hf.get("dropout_rate", 0.0)),
    )


def _stack_to_hf(config: T5GemmaConfig, stack: T5GemmaStack) -> dict:
    names = {LOCAL: "sliding_attention", GLOBAL: "full_attention"}
    return {
        "vocab_size": config.vocab_size,
        "hidden_size": stack.emb_dim,
        "intermediate_size": stack.mlp_dim,
        "num_hidden_layers": stack.num_layers,
        "num_attention_heads": stack.num_heads,
        "num_key_value_heads": stack.num_kv_heads,
        "head_dim": stack.head_dim,
        "query_pre_attn_scalar": stack.query_pre_attn_scalar,
        "sliding_window": stack.sliding_window,
        "layer_types": [names[stack.layer_type(i)] for i in range(stack.num_layers)],
        "attn_logit_softcapping": stack.attn_logit_softcapping,
        "final_logit_softcapping": config.final_logit_softcapping,
        "rope_theta": stack.rope_theta,
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": 1e-6,
        "bos_token_id": config.decoder_start_id,
        "eos_token_id": 1,
        "pad_token_id": 0,
    }


def hf_config(config: T5GemmaConfig) -> dict:
    """config.json of `config`, as T5GemmaConfig(**it) reads it."""
    return {
        "architectures": ["T5GemmaForConditionalGeneration"],
        "model_type": MODEL_TYPE,
        "encoder": _stack_to_hf(config, config.encoder),
        "decoder": _stack_to_hf(config, config.decoder),
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": True,
        "dropout_rate": config.dropout_rate,
        "is_encoder_decoder": True,
        "bos_token_id": config.decoder_start_id,
        "eos_token_id": 1,
        "pad_token_id": 0,
        "decoder_start_token_id": config.decoder_start_id,
    }


def hf_name(name: str) -> str:
    """Hugging Face's tensor name of a t5tpu parameter path (a/b/c)."""
    parts = name.split("/")
    stack = f"model.{parts[0]}"
    if parts[1] == "token_embedder":
        return f"{stack}.embed_tokens.weight"
    if parts[1] in ("encoder_norm", "decoder_norm"):
        return f"{stack}.norm.weight"
    index = parts[1].removeprefix("layers_")
    inner = ".".join(_PARTS.get(p, p) for p in parts[2:-1])
    return f"{stack}.layers.{index}.{inner}.weight"


def module_names(target: str) -> list[str]:
    """transformers' module names of the kernels a LoRA target (lora.TARGETS) adapts."""
    kernels = {t: [name] for name, t in lora.ATTENTION_TARGETS.items()}
    kernels.update(wi=["wi_0", "wi_1"], wo=["wo"])  # a gated feed-forward, always
    return [_PARTS[name] for name in kernels[target]]


def hf_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape Hugging Face stores parameter `name` (of t5tpu's `shape`) in: a kernel's as a
    torch Linear weight [out, in] (attention's out kernel has two input dims), others alike."""
    if not name.endswith("/kernel"):
        return tuple(shape)
    num_in = 2 if name.endswith("/out/kernel") else 1
    return (math.prod(shape[num_in:]), math.prod(shape[:num_in]))


def to_hf(name: str, array) -> np.ndarray:
    """A parameter as Hugging Face stores it (hf_shape)."""
    array = np.asarray(array, np.float32)
    if not name.endswith("/kernel"):
        return array
    return np.ascontiguousarray(array.reshape(hf_shape(name, array.shape)[::-1]).T)


def from_hf(tensor: np.ndarray, shape: tuple[int, ...], name: str) -> np.ndarray:
    """Hugging Face's tensor as the t5tpu parameter `name` of `shape`."""
    tensor = np.asarray(tensor, np.float32)
    if name.endswith("/kernel"):
        tensor = tensor.T
    return np.ascontiguousarray(tensor.reshape(shape))


def tensors_from_params(params) -> dict[str, np.ndarray]:
    flat = traverse_util.flatten_dict(nn.unbox(params), sep="/")
    return {hf_name(name): to_hf(name, array) for name, array in sorted(flat.items())}


class T5GemmaCheckpoint(checkpoint_reader.CheckpointReader):
    """A Hugging Face T5Gemma directory (config.json of model_type 't5gemma' and safetensors,
    possibly sharded), read tensor by tensor as hf_format reads T5's; Gemma's tokenizer.model
    beside it is its vocabulary."""

    step = 0

    def __init__(self, directory: str):
        self.directory = directory
        self.description = f"Hugging Face T5Gemma checkpoint {directory}"

    @staticmethod
    def recognizes(path: str) -> bool:
        config = os.path.join(path, hf_format.CONFIG_FILE)
        if not epath.Path(config).exists():
            return False
        return is_t5gemma(hf_format._read_json(config))

    @functools.cached_property
    def _config(self) -> T5GemmaConfig:
        path = os.path.join(self.directory, hf_format.CONFIG_FILE)
        return config_from_hf(hf_format._read_json(path), path)

    def config(self) -> T5GemmaConfig:
        return self._config

    def vocabulary(self) -> VocabularySource:
        path = os.path.join(self.directory, TOKENIZER_FILE)
        if not epath.Path(path).exists():
            return VocabularySource()
        return VocabularySource(SENTENCEPIECE, path, 0)

    @functools.cached_property
    def _files(self) -> dict:
        files = {}
        for shard in hf_format._shard_files(self.directory, hf_format.SAFETENSORS_FILE):
            opened = hf_format.SafetensorsFile(os.path.join(self.directory, shard))
            files.update(dict.fromkeys(opened.shapes(), opened))
        if not files:
            raise UserError(f"no {hf_format.SAFETENSORS_FILE} in {self.directory}")
        return files

    def run_record(self) -> RunRecord | None:
        return hf_format.directory_run_record(self.directory)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {
            name: opened.shapes()[name]
            for name, opened in self._files.items()
            if name != TIED_LM_HEAD
        }

    def read(self, stored_name: str) -> np.ndarray:
        return self._files[stored_name].read(stored_name)

    def stored_name(self, name: str) -> str:
        return hf_name(name)

    def source(self, name: str, shape: tuple[int, ...]) -> checkpoint_reader.Source:
        return checkpoint_reader.Source(
            hf_name(name), hf_shape(name, shape), lambda array: from_hf(array, shape, name)
        )


def load(directory: str) -> tuple[T5GemmaConfig, dict]:
    """(config, float32 numpy parameters) of a Hugging Face T5Gemma directory."""
    reader = T5GemmaCheckpoint(directory)
    config = reader.config()
    return config, reader.load(param_shapes.abstract_params(config, unrolled=True))


def generation_config(config: T5GemmaConfig, record: RunRecord | None) -> dict:
    """generation_config.json: the run's decoding (hf_run_record.py) with T5Gemma's ids."""
    start = config.decoder_start_id
    ids = {"decoder_start_token_id": start, "bos_token_id": start, "eos_token_id": 1}
    return {**hf_run_record.generation_config(record), **ids, "pad_token_id": 0}


def export(
    params,
    config: T5GemmaConfig,
    output_dir: str,
    vocabulary: VocabularySource | None = None,
    *,
    record: RunRecord | None = None,
    setting: str = "--output_dir",
) -> None:
    """config.json + model.safetensors, which T5GemmaForConditionalGeneration.from_pretrained
    loads (lm_head tied to the decoder's embedding), generation_config.json with the run's
    `record` (as hf_format.export writes T5's), and a SentencePiece vocabulary as
    tokenizer.model, where this reader finds it again. Each file is written atomically."""
    output = epath.Path(output_dir)
    with atomic_files.write_faults(output_dir, setting):
        output.mkdir(parents=True, exist_ok=True)
    described = {**hf_config(config), **hf_run_record.config_fields(record)}
    hf_tokenizer.write_json(output / hf_format.CONFIG_FILE, described, setting=setting)
    generation = generation_config(config, record)
    hf_tokenizer.write_json(output / hf_format.GENERATION_CONFIG_FILE, generation, setting=setting)
    hf_format.write_safetensors(
        os.path.join(output_dir, hf_format.SAFETENSORS_FILE),
        tensors_from_params(params),
        setting=setting,
    )
    if vocabulary is not None and vocabulary.kind == SENTENCEPIECE:
        model = epath.Path(vocabulary.model_file).read_bytes()
        atomic_files.write_atomically(output / TOKENIZER_FILE, model, setting=setting)
