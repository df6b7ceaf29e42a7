"""The tiny Hugging Face models of tests/test_hf_format.py, built with torch and transformers
(the `parity` extra), and their batch: a file of its own, so that tests/test_precision.py and
tests/test_feature_major.py import without torch (their tests of these models are marked
`parity`)."""

from __future__ import annotations

import numpy as np
import pytest

from t5tpu.formats import hf_format
from t5tpu.model import param_shapes

VOCAB, D_MODEL, HEADS, D_KV, D_FF, LAYERS = 128, 64, 2, 32, 128, 2
EOS = 1
VARIANTS = {
    "1.0": {"feed_forward_proj": "relu", "tie_word_embeddings": True},
    # T5 1.1; T5 1.1 LM-adapted's config.json has exactly these fields (sizes aside).
    "1.1": {"feed_forward_proj": "gated-gelu", "tie_word_embeddings": False},
    # Flan-T5's config.json as published: 1.1's plus the derived activation fields.
    "flan-t5": {
        "feed_forward_proj": "gated-gelu",
        "tie_word_embeddings": False,
        "dense_act_fn": "gelu_new",
        "is_gated_act": True,
        "n_positions": 512,
        "relative_attention_max_distance": 128,
    },
    # mT5: model_type 'mt5' (transformers' MT5 classes), 1.1's architecture.
    "mt5": {"feed_forward_proj": "gated-gelu", "tie_word_embeddings": False},
    # umT5: model_type 'umt5' (transformers' UMT5 classes), a position bias in every layer.
    "umt5": {"feed_forward_proj": "gated-gelu", "tie_word_embeddings": False},
    # ByT5's shape: as 1.1, with an encoder deeper than its decoder (3:1 in every ByT5 size).
    "byt5": {
        "feed_forward_proj": "gated-gelu",
        "tie_word_embeddings": False,
        "num_decoder_layers": 1,
    },
}
SEEDS = {"1.0": 10, "1.1": 11, "byt5": 12, "flan-t5": 13, "mt5": 14, "umt5": 15}


def _hf_model(variant: str) -> transformers.PreTrainedModel:  # noqa: F821
    import torch
    import transformers

    # transformers' config and model classes of the variants that have their own.
    classes = {
        "mt5": (transformers.MT5Config, transformers.MT5ForConditionalGeneration),
        "umt5": (transformers.UMT5Config, transformers.UMT5ForConditionalGeneration),
    }
    config_class, model_class = classes.get(
        variant, (transformers.T5Config, transformers.T5ForConditionalGeneration)
    )
    config = config_class(
        vocab_size=VOCAB,
        d_model=D_MODEL,
        d_kv=D_KV,
        d_ff=D_FF,
        num_heads=HEADS,
        num_layers=LAYERS,
        dropout_rate=0.0,
        **{"num_decoder_layers": LAYERS, **VARIANTS[variant]},
    )
    torch.manual_seed(SEEDS[variant])
    model = model_class(config).eval()
    # At Hugging Face's initial scale the residual stream is mostly the input embedding, so a
    # tied model's greedy decode copies its start token 0 forever; louder attention and
    # feed-forward outputs make the rows decode differently.
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if name.endswith(("o.weight", "wo.weight")):
                weight.mul_(5.0)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """variant -> (HF model, its save_pretrained directory, T5Config, imported params)."""
    out = {}
    for variant in VARIANTS:
        model = _hf_model(variant)
        directory = str(tmp_path_factory.mktemp(f"hf_{variant}"))
        model.save_pretrained(directory)
        checkpoint = hf_format.HFCheckpoint(directory)
        config = checkpoint.config()
        params = checkpoint.load(param_shapes.abstract_params(config, unrolled=True))
        out[variant] = (model, directory, config, params)
    return out


def _batch():
    rng = np.random.default_rng(0)
    inputs = rng.integers(2, VOCAB, size=(3, 11))
    inputs[1, 6:] = 0  # padded rows: the encoder mask must match Hugging Face's attention_mask
    inputs[2, 3:] = 0
    targets = rng.integers(2, VOCAB, size=(3, 7))
    targets[:, 0] = 0  # the decoder starts from id 0 in both
    return inputs, targets
