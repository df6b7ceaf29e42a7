"""The model gin files build the published T5 geometries, counted without allocating them."""

from __future__ import annotations

import math
import os

import gin
import jax
import jax.numpy as jnp
import pytest
from flax import linen as nn
from flax import traverse_util

import t5tpu.data.vocab
import t5tpu.model.encoder_decoder
import t5tpu.model.network
from t5tpu import package_files

PACKAGE_DIR = package_files.config_search_path()
MODELS_DIR = package_files.configs_dir("models")
PUBLIC_VOCABULARY = "gs://t5-data/vocabs/cc_all.32000.100extra/sentencepiece.model"

# Parameter counts of the published checkpoints (vocabulary padded to 32128).
PARAMETER_COUNTS = {
    "t5_1_0/small": 60_506_624,
    "t5_1_0/base": 222_903_552,
    "t5_1_0/large": 737_668_096,
    "t5_1_0/3B": 2_851_598_336,
    "t5_1_0/11B": 11_307_321_344,
    "t5_1_1/small": 76_961_152,
    "t5_1_1/base": 247_577_856,
    "t5_1_1/large": 783_150_080,
    "t5_1_1/xl": 2_849_757_184,
    "t5_1_1/xxl": 11_135_332_352,
}
TINY_COUNT = 1_050_368


def parse_model_config(name: str) -> t5tpu.model.network.T5Config:
    """Parses configs/models/<name>.gin as a run would, and returns the T5Config it binds."""
    gin.clear_config()
    gin.add_config_file_search_path(PACKAGE_DIR)
    gin.parse_config_files_and_bindings(
        [os.path.join(MODELS_DIR, f"{name}.gin")], ["DROPOUT_RATE = 0.0"]
    )
    return t5tpu.model.network.T5Config()  # gin fills in every bound field


def abstract_param_shapes(config: t5tpu.model.network.T5Config) -> dict[str, tuple[int, ...]]:
    """Parameter shapes by path, traced with jax.eval_shape: no memory, even for 11B."""
    tokens = jax.ShapeDtypeStruct((1, 8), jnp.int32)
    module = t5tpu.model.network.Transformer(config)
    variables = jax.eval_shape(module.init, jax.random.key(0), tokens, tokens)
    flat = traverse_util.flatten_dict(nn.unbox(variables["params"]), sep="/")
    return {path: tuple(leaf.shape) for path, leaf in flat.items()}


@pytest.fixture(autouse=True)
def clean_gin():
    yield
    gin.clear_config()


def first_line(name: str) -> str:
    with open(os.path.join(MODELS_DIR, f"{name}.gin")) as f:
        return f.readline()


@pytest.mark.parametrize("name, expected", sorted(PARAMETER_COUNTS.items()))
def test_published_sizes_have_exact_parameter_counts(name, expected):
    config = parse_model_config(name)
    shapes = abstract_param_shapes(config)
    assert sum(math.prod(s) for s in shapes.values()) == expected
    # The header comment states the same count.
    assert f"{expected:,} parameters" in first_line(name)

    # MODEL is an EncoderDecoderModel of this config and the public T5 vocabulary.
    bound = {
        "MODEL/macro.value": "t5tpu.model.encoder_decoder.EncoderDecoderModel",
        "EncoderDecoderModel.config": "t5tpu.model.network.T5Config",
        "EncoderDecoderModel.vocabulary": "t5tpu.data.vocab.default_vocabulary",
    }
    for key, selector in bound.items():
        reference = gin.query_parameter(key)
        assert (reference.configurable.selector, reference.evaluate) == (selector, True), key
    assert config.vocab_size == 32128
    assert config.dropout_rate == 0.0
    assert gin.query_parameter("default_vocabulary.sentencepiece_model_file") == PUBLIC_VOCABULARY
    assert gin.query_parameter("default_vocabulary.extra_ids") == 100
    if name.startswith("t5_1_0/"):
        assert config.mlp_activations == ("relu",)
        assert config.logits_via_embedding
        assert not any(path.startswith("decoder/logits_dense") for path in shapes)
        assert "encoder/layers_0/mlp/wi/kernel" in shapes
    else:
        assert config.mlp_activations == ("gelu", "linear")
        assert not config.logits_via_embedding
        assert shapes["decoder/logits_dense/kernel"] == (config.emb_dim, 32128)
        assert "encoder/layers_0/mlp/wi_1/kernel" in shapes


@pytest.mark.parametrize("variant", ["t5_1_0", "t5_1_1"])
def test_dropout_rate_comes_from_the_run(variant):
    gin.clear_config()
    gin.add_config_file_search_path(PACKAGE_DIR)
    gin.parse_config_files_and_bindings(
        [os.path.join(MODELS_DIR, variant, "base.gin")], ["DROPOUT_RATE = 0.1"]
    )
    assert t5tpu.model.network.T5Config().dropout_rate == 0.1


@pytest.mark.parametrize("variant", ["t5_1_0", "t5_1_1"])
def test_tiny_configs_build_a_model_with_the_bundled_vocabulary(variant):
    config = parse_model_config(f"{variant}/tiny")
    assert (config.vocab_size, config.emb_dim, config.num_heads, config.head_dim) == (
        1024,
        128,
        4,
        32,
    )
    assert (config.num_encoder_layers, config.num_decoder_layers) == (2, 2)
    assert config.mlp_dim == (512 if variant == "t5_1_0" else 256)
    shapes = abstract_param_shapes(config)
    assert sum(math.prod(s) for s in shapes.values()) == TINY_COUNT
    assert f"{TINY_COUNT:,} parameters" in first_line(f"{variant}/tiny")
    assert ("decoder/logits_dense/kernel" in shapes) == (variant == "t5_1_1")

    # The whole MODEL binding resolves on a CPU: the bundled vocabulary fits the embedding.
    model = t5tpu.model.encoder_decoder.EncoderDecoderModel()
    assert model.config == config
    assert model.vocabulary.vocab_size == 1024
    assert model.vocabulary is t5tpu.data.vocab.default_vocabulary()
