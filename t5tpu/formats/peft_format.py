"""LoRA adapters out in PEFT's format: adapter_config.json + adapter_model.safetensors, which
`peft.PeftModel.from_pretrained(model, DIR)` loads onto the Hugging Face export of the base
(`t5tpu convert --to=hf --input=BASE`).

PEFT names an adapter after the torch module it adapts (base_model.model.<module>.lora_A.weight)
and stores torch Linear layouts: lora_A [rank, in_features], lora_B [out_features, rank]. A
t5tpu adapter is lora_a [in dims..., rank] and lora_b [rank, out dims...] beside the kernel
whose Hugging Face name hf_format.NAMES gives (hf_t5gemma.hf_name for T5Gemma, whose
transformers modules are q_proj ... down_proj), so each is flattened to 2-D and transposed.
"""

from __future__ import annotations

import os

import numpy as np
from etils import epath
from flax import traverse_util

from t5tpu.formats import hf_format, hf_t5gemma, hf_tokenizer
from t5tpu.model import lora
from t5tpu.model.network import T5Config
from t5tpu.model.t5gemma_network import T5GemmaConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_PEFT_NAMES = {"lora_a": "lora_A", "lora_b": "lora_B"}


def target_modules(settings: lora.LoraSettings, config: T5Config | T5GemmaConfig) -> list[str]:
    """PEFT's target_modules: the Hugging Face module names (a gated wi is wi_0 and wi_1;
    T5Gemma's are its kernels' module names, wi its gate_proj and up_proj)."""
    if isinstance(config, T5GemmaConfig):
        return sorted(name for t in settings.targets for name in hf_t5gemma.module_names(t))
    gated = len(config.mlp_activations) > 1
    names = []
    for target in settings.targets:
        names += ["wi_0", "wi_1"] if target == "wi" and gated else [target]
    return sorted(names)


def adapter_config(settings: lora.LoraSettings, config: T5Config | T5GemmaConfig) -> dict:
    """The adapter_config.json of `settings` (PEFT fills its other fields with defaults)."""
    return {
        "peft_type": "LORA",
        "task_type": "SEQ_2_SEQ_LM",
        "base_model_name_or_path": None,
        "r": settings.rank,
        "lora_alpha": settings.alpha,
        "lora_dropout": settings.dropout,
        "target_modules": target_modules(settings, config),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "use_rslora": False,
        "use_dora": False,
    }


def _tensor(name: str, array, names) -> tuple[str, np.ndarray]:
    """(PEFT's key, torch layout) of one adapter array named by its t5tpu path; `names` gives
    a kernel's Hugging Face name."""
    module_path, leaf = name.rsplit("/", 1)
    hf_name = names(f"{module_path}/kernel")
    module = hf_name.removesuffix(".weight")
    array = np.asarray(array, np.float32)
    rank = array.shape[-1] if leaf == "lora_a" else array.shape[0]
    flat = array.reshape(-1, rank) if leaf == "lora_a" else array.reshape(rank, -1)
    return f"{_PREFIX}{module}.{_PEFT_NAMES[leaf]}.weight", np.ascontiguousarray(flat.T)


def export(
    adapters,
    settings: lora.LoraSettings,
    config: T5Config | T5GemmaConfig,
    output_dir: str,
    *,
    setting: str = "--output_dir",
) -> None:
    """Writes `adapters` (numpy, layers unrolled) as PEFT's two files into `output_dir`."""
    flat = traverse_util.flatten_dict(adapters, sep="/")
    names = hf_t5gemma.hf_name if isinstance(config, T5GemmaConfig) else hf_format.NAMES
    tensors = dict(sorted(_tensor(name, array, names) for name, array in flat.items()))
    epath.Path(output_dir).mkdir(parents=True, exist_ok=True)
    config_path = epath.Path(output_dir) / CONFIG_FILE
    hf_tokenizer.write_json(config_path, adapter_config(settings, config), setting=setting)
    hf_format.write_safetensors(os.path.join(output_dir, WEIGHTS_FILE), tensors, setting=setting)
