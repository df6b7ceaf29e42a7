"""Hugging Face T5 in and out, against transformers itself (PyTorch, float32): random-weight T5
1.0, T5 1.1, mT5 and umT5 models built from a config (nothing downloaded), saved with
save_pretrained, imported into t5tpu; logits and greedy decodes must agree, and exporting back
must give the very tensors save_pretrained wrote."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
import shutil

import hf_fixtures
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference_decoding
import safetensors.numpy
import torch
import transformers
from hf_fixtures import D_FF, D_KV, D_MODEL, EOS, HEADS, LAYERS, VARIANTS, VOCAB, _batch, _hf_model
from tiny import tiny_config

from t5tpu.data import vocab
from t5tpu.errors import UserError
from t5tpu.formats import hf_format
from t5tpu.formats.vocabulary_source import VocabularySource
from t5tpu.model import param_shapes
from t5tpu.model.network import T5Config, Transformer
from t5tpu.storage import checkpoints

# torch builds the reference models (the `parity` extra); scripts/test_latest.sh leaves the
# file out.
pytestmark = pytest.mark.parity
# The fixture, for this file's tests.
saved = hf_fixtures.saved


def _hf_logits(model, inputs, targets) -> np.ndarray:
    with torch.no_grad():
        return model(
            input_ids=torch.tensor(inputs),
            attention_mask=torch.tensor(inputs != 0),
            decoder_input_ids=torch.tensor(targets),
        ).logits.numpy()


def test_reference_t5_1_1_is_untied_and_t5_1_0_tied(saved):
    model_11, directory_11, _, _ = saved["1.1"]
    model_10, directory_10, _, _ = saved["1.0"]
    assert model_11.lm_head.weight.data_ptr() != model_11.shared.weight.data_ptr()
    assert not torch.equal(model_11.lm_head.weight, model_11.shared.weight)
    untied_extra = VOCAB * D_MODEL
    assert (
        sum(p.numel() for p in model_11.parameters())
        == sum(p.numel() for p in model_10.parameters())
        + untied_extra
        + 2 * LAYERS * D_MODEL * D_FF  # wi_1 in every encoder and decoder layer
    )
    assert "lm_head.weight" in safetensors.numpy.load_file(f"{directory_11}/model.safetensors")
    assert "lm_head.weight" not in safetensors.numpy.load_file(f"{directory_10}/model.safetensors")
    assert model_10.lm_head.weight.data_ptr() == model_10.shared.weight.data_ptr()


def test_config_is_derived_from_config_json(saved):
    assert saved["1.0"][2] == tiny_config(
        vocab_size=VOCAB,
        emb_dim=D_MODEL,
        num_heads=HEADS,
        head_dim=D_KV,
        mlp_dim=D_FF,
        num_encoder_layers=LAYERS,
        num_decoder_layers=LAYERS,
        mlp_activations=("relu",),
        logits_via_embedding=True,
    )
    config_11 = saved["1.1"][2]
    assert config_11.mlp_activations == ("gelu", "linear")
    assert config_11.logits_via_embedding is False
    # Flan-T5 and mT5 config.json files read as the same geometry as 1.1's, umT5's with a
    # position bias in every layer.
    for variant in ("flan-t5", "mt5"):
        _, directory, config, _ = saved[variant]
        assert config == config_11, variant
    assert saved["umt5"][2] == dataclasses.replace(config_11, relative_bias_per_layer=True)
    for variant in ("mt5", "umt5"):
        published = json.loads(pathlib.Path(saved[variant][1], "config.json").read_text())
        assert published["model_type"] == variant


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_match_transformers(saved, variant):
    model, _, config, params = saved[variant]
    inputs, targets = _batch()
    reference = _hf_logits(model, inputs, targets)
    logits = np.asarray(
        Transformer(config).apply({"params": params}, jnp.asarray(inputs), jnp.asarray(targets))
    )
    assert logits.shape == reference.shape == (3, 7, VOCAB)
    relative_error = np.max(np.abs(logits - reference)) / np.max(np.abs(reference))
    assert relative_error < 1e-4, relative_error
    assert np.std(reference) > 0.1  # random weights give logits that are far from uniform


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_decodes_match_transformers_generate(saved, variant):
    model, _, config, params = saved[variant]
    inputs, _ = _batch()
    length = 10
    expected = _hf_generate(model, inputs, length)
    module = Transformer(config)
    ours = jax.jit(lambda p, x: reference_decoding.decode(module, p, x, length, EOS))(
        params, jnp.asarray(inputs, jnp.int32)
    )
    np.testing.assert_array_equal(np.asarray(ours), expected)
    assert len({tuple(row) for row in expected}) == 3  # the rows decode differently


def test_umt5_through_the_engine_decodes_as_transformers_generate(saved):
    """umT5 through t5tpu.load's engine (rows at their own positions, each layer's table read
    there): transformers' greedy ids."""
    from t5tpu import api

    model, directory, _, _ = saved["umt5"]
    inputs, _ = _batch()
    loaded = api.load(directory, batch_size=4, max_target_length=10)
    np.testing.assert_array_equal(loaded.generate_ids(inputs), _hf_generate(model, inputs, 10))


def _hf_generate(model, inputs, length: int, **options) -> np.ndarray:
    """transformers' greedy generate of `inputs`, [rows, length], zeros after EOS."""
    with torch.no_grad():
        generated = model.generate(
            input_ids=torch.tensor(inputs),
            attention_mask=torch.tensor(inputs != 0),
            max_new_tokens=length,
            num_beams=1,
            do_sample=False,
            decoder_start_token_id=0,
            eos_token_id=EOS,
            pad_token_id=0,
            **options,
        ).numpy()[:, 1:]  # drop the start token
    expected = np.zeros((len(inputs), length), np.int64)
    expected[:, : generated.shape[1]] = generated
    return expected


# Hugging Face's options that change greedy decoding, as t5tpu takes them too.
PENALTIES = {
    "repetition": {"repetition_penalty": 1.8},
    "no_repeat": {"no_repeat_ngram_size": 2},
    "min_new": {"min_new_tokens": 9},
    "together": {"repetition_penalty": 0.6, "no_repeat_ngram_size": 1, "min_new_tokens": 4},
}


def test_greedy_with_penalties_decodes_as_transformers_generate(tmp_path):
    """Through t5tpu.load's generate_ids, option by option, then every option in one batch of
    the engine (each row its own values, one program): the ids of transformers' generate. The
    T5 1.1 fixture's EOS made likelier, so that rows end early and min_new_tokens matters."""
    from t5tpu import api
    from t5tpu.model import decoding_settings, engine

    model = _hf_model("1.1")
    with torch.no_grad():
        model.lm_head.weight[EOS] *= 4
    model.save_pretrained(tmp_path)
    inputs, _ = _batch()
    length = 12
    loaded = api.load(str(tmp_path), batch_size=4, max_target_length=length)
    plain = loaded.generate_ids(inputs)
    expected = {name: _hf_generate(model, inputs, length, **o) for name, o in PENALTIES.items()}
    for name, options in PENALTIES.items():
        np.testing.assert_array_equal(loaded.generate_ids(inputs, **options), expected[name])
        assert not np.array_equal(expected[name], plain), name  # the option changes the ids
    rows = [[int(i) for i in row if i] for row in inputs]
    mixed = [
        engine.Row(
            tuple(ids), tag=(name, r), settings=decoding_settings.DecodingSettings(**options)
        )
        for name, options in PENALTIES.items()
        for r, ids in enumerate(rows)
    ]
    feed = engine.ListFeed(mixed, bucket=loaded.engine.bucket)
    request = engine.Request(decoding_settings.DecodingSettings(), length)
    for decoded in loaded.engine.stream(feed, request):
        name, r = decoded.row.tag
        np.testing.assert_array_equal(decoded.ids, expected[name][r], err_msg=name)


# t5tpu's beam ranking and transformers' length_penalty it equals: T5X's alpha 0 ranks by
# log-likelihood alone, as length_penalty 0 does; length_penalty is Hugging Face's own rule.
RANKINGS = {
    "alpha0": ({"beam_alpha": 0.0}, 0.0),
    "lp1": ({"length_penalty": 1.0}, 1.0),
    "lp2.5": ({"length_penalty": 2.5}, 2.5),
    "lp-1": ({"length_penalty": -1.0}, -1.0),
}


@pytest.mark.parametrize("ranking", RANKINGS)
@pytest.mark.parametrize("variant", ["1.0", "1.1"])
def test_n_best_beams_and_their_scores_are_transformers_own(variant, ranking, tmp_path):
    """Beam search's n best: the sequences and scores of transformers' beam search with the
    same ranking (its default early_stopping=False rule included). EOS made likelier, so that
    hypotheses of many lengths compete and the ranking matters."""
    from t5tpu import api
    from t5tpu.model import decoding_settings, engine

    model, directory = _hf_model(variant), str(tmp_path)
    with torch.no_grad():
        model.lm_head.weight[EOS] *= 3
    model.save_pretrained(directory)
    inputs, _ = _batch()
    length, beams, n = 8, 4, 3
    ours, length_penalty = RANKINGS[ranking]
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor(inputs),
            attention_mask=torch.tensor(inputs != 0),
            max_new_tokens=length,
            num_beams=beams,
            num_return_sequences=n,
            length_penalty=length_penalty,
            early_stopping=False,
            do_sample=False,
            decoder_start_token_id=0,
            eos_token_id=EOS,
            pad_token_id=0,
            output_scores=True,
            return_dict_in_generate=True,
        )
    want = np.zeros((len(inputs) * n, length), np.int64)
    sequences = out.sequences.numpy()[:, 1:]
    want[:, : sequences.shape[1]] = sequences
    want = want.reshape(len(inputs), n, length)
    # transformers fills after EOS with EOS when the pad id is 0 (`pad_token_id or eos`).
    want[np.cumsum(want == EOS, axis=-1) - (want == EOS) > 0] = 0
    loaded = api.load(directory, batch_size=4, max_target_length=length)
    settings = {"num_beams": beams, "num_return_sequences": n, **ours}
    np.testing.assert_array_equal(loaded.generate_ids(inputs, **settings), want)
    assert len({tuple(s) for row in want for s in row}) > len(inputs)  # n distinct a row
    rows = [[int(i) for i in row if i] for row in inputs]
    request = engine.Request(decoding_settings.DecodingSettings(**settings), length)
    scores = np.stack([d.scores for d in loaded.engine.decoded(rows, request)])
    # transformers' scores are normalized, t5tpu's the log-likelihoods: length ** penalty apart.
    ended = want == EOS
    lengths = np.where(ended.any(-1), ended.argmax(-1) + 1, length)
    normalized = out.sequences_scores.numpy().reshape(len(inputs), n)
    np.testing.assert_allclose(scores, normalized * lengths**length_penalty, rtol=1e-4, atol=1e-4)
    if length_penalty > 2:  # a strong preference for long hypotheses changes what is found
        alpha0 = loaded.generate_ids(inputs, num_beams=beams, num_return_sequences=n, beam_alpha=0)
        assert not np.array_equal(alpha0, want)


@pytest.mark.parametrize("variant", VARIANTS)
def test_export_gives_identical_tensors_and_logits(saved, variant, tmp_path):
    model, directory, config, params = saved[variant]
    hf_format.export(params, config, str(tmp_path))
    original = safetensors.numpy.load_file(f"{directory}/model.safetensors")
    exported = safetensors.numpy.load_file(f"{tmp_path}/model.safetensors")
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert exported[name].dtype == np.float32
        np.testing.assert_array_equal(exported[name], tensor, err_msg=name)

    reloaded = transformers.AutoModelForSeq2SeqLM.from_pretrained(str(tmp_path)).eval()
    assert type(reloaded).__name__ == (
        "UMT5ForConditionalGeneration" if variant == "umt5" else "T5ForConditionalGeneration"
    )
    assert reloaded.config.tie_word_embeddings == (variant == "1.0")
    inputs, targets = _batch()
    np.testing.assert_array_equal(
        _hf_logits(reloaded, inputs, targets), _hf_logits(model, inputs, targets)
    )


def test_sharded_safetensors_and_pytorch_bin_import_the_same(saved, tmp_path):
    model, _, config, params = saved["1.1"]
    abstract = param_shapes.abstract_params(config, unrolled=True)
    sharded, torch_dir = str(tmp_path / "sharded"), str(tmp_path / "torch")
    model.save_pretrained(sharded, max_shard_size="100KB")
    model.save_pretrained(torch_dir, safe_serialization=False)
    assert os.path.exists(f"{sharded}/model.safetensors.index.json")
    assert len([f for f in os.listdir(sharded) if f.endswith(".safetensors")]) > 1
    assert os.path.exists(f"{torch_dir}/pytorch_model.bin")
    for directory in (sharded, torch_dir):
        imported = hf_format.HFCheckpoint(directory).load(abstract)
        jax.tree_util.tree_map(np.testing.assert_array_equal, imported, params)


def test_refuses_another_geometry_listing_names_and_shapes(saved):
    _, directory, config, _ = saved["1.1"]
    other = param_shapes.abstract_params(
        T5Config(**{**config.__dict__, "mlp_dim": 256, "num_decoder_layers": 3}), unrolled=True
    )
    with pytest.raises(UserError) as error:
        hf_format.HFCheckpoint(directory).load(other)
    message = str(error.value)
    assert "another geometry" in message and "\n" not in message
    assert (
        "decoder.block.0.layer.2.DenseReluDense.wi_0.weight: found (128, 64) vs model (256, 64)"
        in message
    )
    assert "; and 22 more" in message  # the rest: encoder layers, the missing decoder block 2


def test_t5_1_0_checkpoint_is_refused_by_a_t5_1_1_model(saved):
    _, directory, config, _ = saved["1.0"]
    gated = T5Config(**{**config.__dict__, "mlp_activations": ("gelu", "linear")})
    with pytest.raises(UserError, match=r"wi_0\.weight: missing"):
        hf_format.HFCheckpoint(directory).load(param_shapes.abstract_params(gated, unrolled=True))


def test_spiece_model_is_picked_up_as_the_vocabulary(saved, tmp_path):
    _, directory, _, _ = saved["1.0"]
    assert hf_format.HFCheckpoint(directory).vocabulary() == VocabularySource()
    shutil.copy(f"{directory}/config.json", tmp_path)
    shutil.copy(vocab.bundled_vocabulary_file(), tmp_path / "spiece.model")
    spiece, copy = f"{tmp_path}/spiece.model", hf_format.HFCheckpoint(str(tmp_path))
    assert copy.vocabulary() == VocabularySource("sentencepiece", spiece, 100)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"extra_ids": 0}))
    assert copy.vocabulary() == VocabularySource("sentencepiece", spiece, 0)
    (tmp_path / "tokenizer_config.json").write_text('{"extra_ids": ')
    with pytest.raises(UserError, match="tokenizer_config.json is not valid JSON"):
        copy.vocabulary()


def test_byt5_export_writes_a_byte_tokenizer_with_seqio_ids(saved, tmp_path):
    _, directory, config, params = saved["byt5"]
    hf_format.export(params, config, str(tmp_path), VocabularySource("bytes", None, 3))
    assert not (tmp_path / "spiece.model").exists()  # bytes need no model file
    assert hf_format.HFCheckpoint(str(tmp_path)).vocabulary() == VocabularySource("bytes", None, 3)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert type(tokenizer).__name__ == "ByT5Tokenizer"
    byte_vocabulary = vocab.default_vocabulary(kind="bytes", extra_ids=3)
    for text in ("plain ascii", "naïve café, 東京?"):
        assert tokenizer(text).input_ids == [*byte_vocabulary.encode(text), 1]
    # seqio's sentinels count down from the top: <extra_id_0> is the highest id.
    sentinels = [tokenizer.convert_tokens_to_ids(f"<extra_id_{i}>") for i in range(3)]
    assert sentinels == [byte_vocabulary.vocab_size - 1 - i for i in range(3)] == [261, 260, 259]


def test_published_byt5_directories_name_their_tokenizer_in_config_json(saved, tmp_path):
    _, directory, _, _ = saved["byt5"]
    published = json.loads(pathlib.Path(directory, "config.json").read_text())
    (tmp_path / "config.json").write_text(
        json.dumps({**published, "tokenizer_class": "ByT5Tokenizer"})
    )
    # google/byt5-*: no spiece.model; ByT5Tokenizer's default of 125 sentinels fills 384 rows.
    published_vocabulary = hf_format.HFCheckpoint(str(tmp_path)).vocabulary()
    assert published_vocabulary == VocabularySource("bytes", None, 125)
    assert vocab.default_vocabulary(kind="bytes", extra_ids=125).vocab_size == 384


# config.json of t5-small and google/flan-t5-small as published (the fields t5tpu reads).
T5_SMALL = {
    "model_type": "t5",
    "d_ff": 2048,
    "d_kv": 64,
    "d_model": 512,
    "layer_norm_epsilon": 1e-06,
    "num_heads": 8,
    "num_layers": 6,
    "relative_attention_num_buckets": 32,
    "vocab_size": 32128,
}
FLAN_T5_SMALL = {
    "model_type": "t5",
    "d_ff": 1024,
    "d_kv": 64,
    "d_model": 512,
    "feed_forward_proj": "gated-gelu",
    "layer_norm_epsilon": 1e-06,
    "num_decoder_layers": 8,
    "num_heads": 6,
    "num_layers": 8,
    "relative_attention_max_distance": 128,
    "relative_attention_num_buckets": 32,
    "tie_word_embeddings": False,
    "vocab_size": 32128,
}


@pytest.mark.parametrize("hf_config, count", [(T5_SMALL, 60_506_624), (FLAN_T5_SMALL, 76_961_152)])
def test_published_configs_give_the_published_parameter_counts(hf_config, count):
    abstract = param_shapes.abstract_params(hf_format.config_from_hf(hf_config), unrolled=True)
    assert sum(math.prod(s) for s in checkpoints.flat_shapes(abstract).values()) == count


def test_config_round_trips_and_unsupported_activations_are_refused():
    config = hf_format.config_from_hf(FLAN_T5_SMALL)
    assert hf_format.config_from_hf(hf_format.hf_config(config)) == config
    with pytest.raises(UserError, match="feed_forward_proj='gelu'"):
        hf_format.config_from_hf({**T5_SMALL, "feed_forward_proj": "gelu"})
    with pytest.raises(UserError, match="layer_norm_epsilon"):
        hf_format.config_from_hf({**T5_SMALL, "layer_norm_epsilon": 1e-5})
    umt5 = hf_format.config_from_hf(UMT5_SMALL)
    assert hf_format.hf_config(umt5)["model_type"] == "umt5"
    assert hf_format.config_from_hf(hf_format.hf_config(umt5)) == umt5
    # Without feed_forward_proj each model type takes its config class's default.
    bare = {k: v for k, v in UMT5_SMALL.items() if k != "feed_forward_proj"}
    assert hf_format.config_from_hf(bare).mlp_activations == ("gelu", "linear")
    assert hf_format.config_from_hf({**bare, "model_type": "t5"}).mlp_activations == ("relu",)


# google/umt5-small's config.json as published (huggingface.co/google/umt5-small, revision
# 27cbeff): no model_type, only the architecture names umT5. The other sizes' differ in these
# five sizes alone (google/umt5-base, -xl, -xxl config.json).
UMT5_SMALL = {
    "architectures": ["UMT5ForConditionalGeneration"],
    "d_ff": 1024,
    "d_kv": 64,
    "d_model": 512,
    "dense_act_fn": "gelu_new",
    "feed_forward_proj": "gated-gelu",
    "is_gated_act": True,
    "layer_norm_epsilon": 1e-06,
    "num_decoder_layers": 8,
    "num_heads": 6,
    "num_layers": 8,
    "relative_attention_max_distance": 128,
    "relative_attention_num_buckets": 32,
    "scalable_attention": True,
    "tie_word_embeddings": False,
    "vocab_size": 256384,
}
UMT5_SIZES = {  # d_model, d_ff, num_heads, layers; t5tpu's configs/models/umt5/<size>.gin
    "small": (512, 1024, 6, 8),
    "base": (768, 2048, 12, 12),
    "xl": (2048, 5120, 32, 24),
    "xxl": (4096, 10240, 64, 24),
}


@pytest.mark.parametrize("size", UMT5_SIZES)
def test_published_umt5_configs_count_as_transformers_and_the_gins(size):
    """Counted without weights: transformers' UMT5 on the meta device, t5tpu's abstract shapes
    of the config.json read as t5tpu reads it, and the size's gin header."""
    from test_model_configs import PARAMETER_COUNTS

    d_model, d_ff, heads, layers = UMT5_SIZES[size]
    sizes = {"d_model": d_model, "d_ff": d_ff, "num_heads": heads}
    published = {**UMT5_SMALL, **sizes, "num_layers": layers, "num_decoder_layers": layers}
    config = hf_format.config_from_hf(published)
    assert config.relative_bias_per_layer and config.mlp_activations == ("gelu", "linear")
    abstract = param_shapes.abstract_params(config, unrolled=True)
    ours = sum(math.prod(s) for s in checkpoints.flat_shapes(abstract).values())
    with torch.device("meta"):
        reference = transformers.UMT5ForConditionalGeneration(transformers.UMT5Config(**published))
    assert ours == sum(p.numel() for p in reference.parameters())
    assert ours == PARAMETER_COUNTS[f"umt5/{size}"]
