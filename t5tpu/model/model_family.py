"""The network module of a model config: T5's Transformer for a T5Config, T5Gemma's for a
T5GemmaConfig. The one place that picks, for training, decoding, parameter shapes and plans."""

from __future__ import annotations

import flax.linen as nn

from t5tpu.model.network import T5Config, Transformer
from t5tpu.model.t5gemma_network import T5GemmaConfig, T5GemmaTransformer


def network_module(config: T5Config | T5GemmaConfig) -> nn.Module:
    if isinstance(config, T5GemmaConfig):
        return T5GemmaTransformer(config)
    return Transformer(config)
