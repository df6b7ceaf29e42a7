"""The model gin files build the published T5, mT5, umT5 and ByT5 geometries, counted without
allocating them."""

from __future__ import annotations

import math
import os

import gin
import pytest
import seqio
from flax import linen as nn
from flax import traverse_util
from tiny import tiny_config

import t5tpu.data.vocab
import t5tpu.model.encoder_decoder
import t5tpu.model.network
from t5tpu import package_files
from t5tpu.planning import placements

PACKAGE_DIR = package_files.config_search_path()
MODELS_DIR = package_files.configs_dir("models")
PUBLIC_VOCABULARY = "gs://t5-data/vocabs/cc_all.32000/sentencepiece.model"
MC4_VOCABULARY = "gs://t5-data/vocabs/mc4.250000.100extra/sentencepiece.model"
UMT5_VOCABULARY = "gs://t5-data/vocabs/umt5.256000/sentencepiece.model"

# Per family: the padded vocabulary (T5Config.vocab_size) and default_vocabulary's bindings.
# mT5's sentinels are pieces of its model file (no extra ids); umT5's 300 are seqio's extra ids
# (T5X's umt5/vocab.gin); ByT5 reads bytes, no file.
FAMILIES = {
    "t5_1_0": (32128, {"sentencepiece_model_file": PUBLIC_VOCABULARY, "extra_ids": 100}),
    "t5_1_1": (32128, {"sentencepiece_model_file": PUBLIC_VOCABULARY, "extra_ids": 100}),
    "mt5": (250112, {"sentencepiece_model_file": MC4_VOCABULARY, "extra_ids": 0}),
    "umt5": (256384, {"sentencepiece_model_file": UMT5_VOCABULARY, "extra_ids": 300}),
    "byt5": (384, {"kind": "bytes"}),
}

# Parameter counts of the published checkpoints. ByT5's beyond small are the geometries of the
# Hugging Face config.json files, counted by transformers too (T5ForConditionalGeneration);
# umT5's are transformers' UMT5ForConditionalGeneration's at the google/umt5-* config.json
# geometries (tests/test_hf_format.py counts them both ways).
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
    "mt5/small": 300_176_768,
    "mt5/base": 582_401_280,
    "mt5/large": 1_229_581_312,
    "mt5/xl": 3_742_619_648,
    "mt5/xxl": 12_921_057_280,
    "umt5/small": 306_601_984,
    "umt5/base": 592_043_520,
    "umt5/xl": 3_768_356_864,
    "umt5/xxl": 12_972_531_712,
    "byt5/small": 299_637_760,
    "byt5/base": 581_653_248,
    "byt5/large": 1_228_183_552,
    "byt5/xl": 3_737_801_728,
    "byt5/xxl": 12_906_899_328,
}
TINY_COUNT = 1_050_368
# umT5 tiny: two more 4-head x 32-bucket tables (one in each of the 2+2 layers, not per stack).
UMT5_TINY_COUNT = TINY_COUNT + 2 * 4 * 32


def parse_model_config(name: str) -> t5tpu.model.network.T5Config:
    """Parses configs/models/<name>.gin as a run would, and returns the T5Config it binds."""
    gin.clear_config()
    gin.add_config_file_search_path(PACKAGE_DIR)
    gin.parse_config_files_and_bindings(
        [os.path.join(MODELS_DIR, f"{name}.gin")], ["DROPOUT_RATE = 0.0"]
    )
    return t5tpu.model.network.T5Config()  # gin fills in every bound field


def abstract_param_shapes(config: t5tpu.model.network.T5Config) -> dict[str, tuple[int, ...]]:
    """Parameter shapes by path, as `t5tpu plan` traces them (one layer a stack, repeated;
    tests/test_plan.py checks that against the whole network): no memory, even for 11B."""
    params = placements.boxed_params(config)
    flat = traverse_util.flatten_dict(nn.unbox(params), sep="/")
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

    # MODEL is an EncoderDecoderModel of this config and the family's vocabulary.
    family = name.split("/")[0]
    vocab_size, vocabulary = FAMILIES[family]
    bound = {
        "MODEL/macro.value": "t5tpu.model.encoder_decoder.EncoderDecoderModel",
        "EncoderDecoderModel.config": "t5tpu.model.network.T5Config",
        "EncoderDecoderModel.vocabulary": "t5tpu.data.vocab.default_vocabulary",
    }
    for key, selector in bound.items():
        reference = gin.query_parameter(key)
        assert (reference.configurable.selector, reference.evaluate) == (selector, True), key
    assert config.vocab_size == vocab_size
    assert config.dropout_rate == 0.0
    for argument, value in vocabulary.items():
        assert gin.query_parameter(f"default_vocabulary.{argument}") == value, argument
    if family == "byt5":
        with pytest.raises(ValueError):  # bytes need no model file: none is bound
            gin.query_parameter("default_vocabulary.sentencepiece_model_file")
        assert config.num_encoder_layers == 3 * config.num_decoder_layers
    if family == "t5_1_0":
        assert config.mlp_activations == ("relu",)
        assert config.logits_via_embedding
        assert not any(path.startswith("decoder/logits_dense") for path in shapes)
        assert "encoder/layers_0/mlp/wi/kernel" in shapes
    else:
        assert config.mlp_activations == ("gelu", "linear")
        assert not config.logits_via_embedding
        assert shapes["decoder/logits_dense/kernel"] == (config.emb_dim, vocab_size)
        assert "encoder/layers_0/mlp/wi_1/kernel" in shapes
    # umT5 alone has a position-bias table in every layer, the others one per stack.
    per_layer = family == "umt5"
    assert config.relative_bias_per_layer == per_layer
    for stack, layers in (
        ("encoder", config.num_encoder_layers),
        ("decoder", config.num_decoder_layers),
    ):
        tables = [f"{stack}/layers_{i}/relpos_bias/rel_embedding" for i in range(layers)]
        expected = tables if per_layer else [f"{stack}/relpos_bias/rel_embedding"]
        assert sorted(p for p in shapes if "relpos_bias" in p and p.startswith(stack)) == sorted(
            expected
        )


@pytest.mark.parametrize("variant", sorted(FAMILIES))
def test_dropout_rate_comes_from_the_run(variant):
    gin.clear_config()
    gin.add_config_file_search_path(PACKAGE_DIR)
    gin.parse_config_files_and_bindings(
        [os.path.join(MODELS_DIR, variant, "base.gin")], ["DROPOUT_RATE = 0.1"]
    )
    assert t5tpu.model.network.T5Config().dropout_rate == 0.1


@pytest.mark.parametrize("variant", ["t5_1_0", "t5_1_1", "mt5", "umt5"])
def test_tiny_configs_build_a_model_with_the_bundled_vocabulary(variant):
    # tests/tiny.py's geometry (built before parsing: gin would fill in the fields not given),
    # T5 1.0's with its ReLU feed-forward twice as wide and the tied output layer, umT5's with
    # a position-bias table in every layer.
    overrides = {
        "t5_1_0": dict(mlp_dim=512, mlp_activations=("relu",), logits_via_embedding=True),
        "umt5": dict(relative_bias_per_layer=True),
    }
    expected = tiny_config(**overrides.get(variant, {}))
    config = parse_model_config(f"{variant}/tiny")
    assert config == expected
    shapes = abstract_param_shapes(config)
    count = UMT5_TINY_COUNT if variant == "umt5" else TINY_COUNT
    assert sum(math.prod(s) for s in shapes.values()) == count
    assert f"{count:,} parameters" in first_line(f"{variant}/tiny")
    assert ("decoder/logits_dense/kernel" in shapes) == (variant != "t5_1_0")

    # The whole MODEL binding resolves on a CPU: the bundled vocabulary fits the embedding.
    model = t5tpu.model.encoder_decoder.EncoderDecoderModel()
    assert model.config == config
    assert model.vocabulary.vocab_size == 1024
    assert model.vocabulary is t5tpu.data.vocab.default_vocabulary()


def test_byt5_tiny_builds_a_model_with_the_byte_vocabulary():
    config = parse_model_config("byt5/tiny")
    assert (config.vocab_size, config.emb_dim, config.mlp_dim) == (384, 64, 128)
    assert (config.num_encoder_layers, config.num_decoder_layers) == (2, 1)
    count = sum(math.prod(s) for s in abstract_param_shapes(config).values())
    assert count == 189_248
    assert f"{count:,} parameters" in first_line("byt5/tiny")

    # No file to find: the MODEL binding resolves offline, 259 byte ids in 384 embedding rows.
    model = t5tpu.model.encoder_decoder.EncoderDecoderModel()
    assert isinstance(model.vocabulary, seqio.ByteVocabulary)
    assert model.vocabulary.vocab_size == 259
    assert model.vocabulary is t5tpu.data.vocab.default_vocabulary(kind="bytes")


PRETRAINED_STEP = 1_000_000  # T5's and mT5's released checkpoints (T5 1.0's Mesh TF: 999,900)


@pytest.mark.parametrize(
    "name",
    sorted(
        name[:-4]
        for name in os.listdir(package_files.configs_dir("experiments"))
        if name.endswith(".gin")
    ),
)
def test_fine_tuning_experiments_train_past_their_pretrained_checkpoint(name):
    """Steps count on from INITIAL_CHECKPOINT_PATH's step (runners/train.py), so a recipe that
    starts from a released checkpoint either counts TRAIN_STEPS from it or names a step past
    it; otherwise `t5tpu train` stops at once on the TPU."""
    from t5tpu.config import gin_setup

    gin_setup.parse([f"configs/experiments/{name}.gin"], [], [])
    if not gin_setup.bound_value("train.initial_checkpoint_path"):
        return
    steps = gin_setup.bound_value("train.train_steps")
    relative = gin_setup.bound_value("train.relative_steps")
    last_step = steps + (PRETRAINED_STEP if relative else 0)
    assert last_step > PRETRAINED_STEP, (name, steps, relative)
