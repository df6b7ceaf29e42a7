"""T5Gemma against transformers itself (PyTorch, float32, eager attention): random-weight
T5GemmaForConditionalGeneration models built from configs (nothing downloaded), one balanced and
one unbalanced (encoder and decoder of other widths, depths and head counts), saved with
save_pretrained and imported; logits, greedy ids and beam search must agree, the engine decodes
them, exporting gives back save_pretrained's tensors, and the model gins build the published
geometries with transformers' own parameter counts."""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib

import flax
import flax.traverse_util
import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference_decoding
import safetensors.numpy
import seqio
import torch
import transformers

import t5tpu.data.vocab  # noqa: F401  (default_vocabulary, which the gins bind)
from t5tpu.formats import hf_t5gemma
from t5tpu.model import decoding_settings, engine, param_shapes
from t5tpu.model.encoder_decoder import EncoderDecoderModel
from t5tpu.model.t5gemma_network import T5GemmaConfig, T5GemmaTransformer
from t5tpu.partitioning import Partitioner

ROOT = pathlib.Path(__file__).resolve().parent.parent
VOCAB, EOS, BOS = 128, 1, 2
# Windows of 6 over inputs of 11 and targets of 9, or decodes of 10: the local layers see less
# than the global ones.
STACK = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    query_pre_attn_scalar=16,
    sliding_window=6,
    attn_logit_softcapping=5.0,
    final_logit_softcapping=1.0,
)
VARIANTS = {
    "balanced": (STACK, STACK),
    "unbalanced": (
        STACK,
        {**STACK, "hidden_size": 48, "num_hidden_layers": 2, "num_attention_heads": 2,
         "num_key_value_heads": 1, "intermediate_size": 80},
    ),
}  # fmt: skip


def _hf_model(
    variant: str, vocab_size: int = VOCAB
) -> transformers.T5GemmaForConditionalGeneration:
    encoder, decoder = ({**stack, "vocab_size": vocab_size} for stack in VARIANTS[variant])
    config = transformers.T5GemmaConfig(
        encoder=encoder, decoder=decoder, vocab_size=vocab_size, attn_implementation="eager"
    )
    torch.manual_seed(0 if variant == "balanced" else 1)
    model = transformers.T5GemmaForConditionalGeneration(config).eval()
    # Norm offsets (zeros at Hugging Face's init), blocks louder than the embedding (else the
    # tied output layer copies the start token forever) and logits that spread.
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if "norm" in name:
                weight.normal_(2.0 if ".post_" in name else 0.0, 0.3)
            elif "embed_tokens" in name:
                weight.normal_(0.0, 0.05)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """variant -> (HF model, its save_pretrained directory, T5GemmaConfig, imported params)."""
    out = {}
    for variant in VARIANTS:
        model = _hf_model(variant)
        directory = str(tmp_path_factory.mktemp(f"hf_t5gemma_{variant}"))
        model.save_pretrained(directory)
        config, params = hf_t5gemma.load(directory)
        out[variant] = (model, directory, config, params)
    return out


def _batch():
    rng = np.random.default_rng(0)
    inputs = rng.integers(3, VOCAB, size=(3, 11))
    inputs[1, 6:] = 0  # padded rows: the encoder mask must match Hugging Face's attention_mask
    inputs[2, 3:] = 0
    targets = rng.integers(3, VOCAB, size=(3, 9))
    targets[:, 0] = 0  # t5tpu's start id 0 reads as BOS, transformers' decoder_start_token_id
    return inputs, targets


def _decoded_inputs():
    """_batch's inputs cut to fewer positions than the window: transformers 4.57's generate
    caches a sliding layer's cross-attention keys in its sliding-window cache too, which keeps
    only the last window - 1 encoder positions (its own forward pass sees them all)."""
    inputs = _batch()[0][:, : STACK["sliding_window"] - 1]
    assert (inputs == 0).any() and (inputs != 0).all(axis=1).any()
    return inputs


def _hf_logits(model, inputs, targets) -> np.ndarray:
    starts = np.where(targets == 0, BOS, targets)
    with torch.no_grad():
        return model(
            input_ids=torch.tensor(inputs),
            attention_mask=torch.tensor(inputs != 0),
            decoder_input_ids=torch.tensor(starts),
        ).logits.numpy()


def _hf_generate(model, inputs, length: int, **options) -> np.ndarray:
    """transformers' generate of `inputs`, [rows, length], zeros after EOS."""
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor(inputs),
            attention_mask=torch.tensor(inputs != 0),
            max_new_tokens=length,
            do_sample=False,
            decoder_start_token_id=BOS,
            eos_token_id=EOS,
            pad_token_id=0,
            **options,
        ).numpy()[:, 1:]
    expected = np.zeros((len(out), length), np.int64)
    expected[:, : out.shape[1]] = out
    expected[np.cumsum(expected == EOS, axis=-1) - (expected == EOS) > 0] = 0
    return expected


def test_config_json_reads_as_both_stacks(saved):
    balanced, unbalanced = saved["balanced"][2], saved["unbalanced"][2]
    assert balanced.decoder == balanced.encoder
    assert (balanced.encoder.num_heads, balanced.encoder.num_kv_heads) == (4, 2)
    assert balanced.encoder.layer_type(0) == "local" and balanced.encoder.layer_type(1) == "global"
    assert (unbalanced.emb_dim, unbalanced.decoder.emb_dim) == (64, 48)
    assert (unbalanced.num_encoder_layers, unbalanced.num_decoder_layers) == (3, 2)
    assert unbalanced.final_logit_softcapping == 1.0 and unbalanced.decoder_start_id == BOS
    assert hf_t5gemma.config_from_hf(hf_t5gemma.hf_config(unbalanced)) == unbalanced


@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_match_transformers(saved, variant):
    model, _, config, params = saved[variant]
    inputs, targets = _batch()
    reference = _hf_logits(model, inputs, targets)
    logits = np.asarray(
        T5GemmaTransformer(config).apply(
            {"params": params}, jnp.asarray(inputs), jnp.asarray(targets)
        )
    )
    assert logits.shape == reference.shape == (3, 9, VOCAB)
    assert np.max(np.abs(logits - reference)) < 1e-5
    assert np.std(reference) > 0.3  # far from uniform: every weight counts


@pytest.mark.parametrize("variant", VARIANTS)
def test_greedy_decodes_match_transformers_generate(saved, variant):
    """The one-step decode (rotary positions, windowed cache, GQA) against transformers'."""
    model, _, config, params = saved[variant]
    inputs = _decoded_inputs()
    length = 10
    expected = _hf_generate(model, inputs, length, num_beams=1)
    module = T5GemmaTransformer(config)
    ours = jax.jit(lambda p, x: reference_decoding.decode(module, p, x, length, EOS))(
        params, jnp.asarray(inputs, jnp.int32)
    )
    np.testing.assert_array_equal(np.asarray(ours), expected)
    assert len({tuple(row) for row in expected}) == 3  # the rows decode differently
    assert len(set(expected.flat)) > 3  # not one token over and over


def _engine(config, params, max_length: int, partitioner=None) -> engine.Engine:
    network = EncoderDecoderModel(config, seqio.PassThroughVocabulary(VOCAB, eos_id=EOS))
    partitioner = partitioner or Partitioner()
    _, shardings = param_shapes.sharded_abstract_params(config, partitioner)
    return engine.Engine(
        model=network,
        params=jax.device_put(params, shardings),
        param_shardings=shardings,
        partitioner=partitioner,
        batch_size=4,
        max_input_length=16,
        max_target_length=max_length,
    )


def _rows(inputs) -> list[list[int]]:
    return [[int(i) for i in row if i] for row in inputs]


@pytest.mark.parametrize("variant", VARIANTS)
def test_the_engine_decodes_greedy_beams_and_samples(saved, variant):
    """Greedy and beam search through the engine's programs (slots at their own positions,
    beams sharing the cross-attention cache) give transformers' ids; sampling is each row's
    own, whatever its batch."""
    model, _, config, params = saved[variant]
    inputs = _decoded_inputs()
    length = 10
    runs = _engine(config, params, length)
    greedy = engine.Request(decoding_settings.DecodingSettings(), length)
    ids = np.stack(runs.generate(_rows(inputs), greedy))
    np.testing.assert_array_equal(ids, _hf_generate(model, inputs, length, num_beams=1))

    beams = engine.Request(
        decoding_settings.DecodingSettings(num_beams=3, length_penalty=1.0), length
    )
    want = _hf_generate(model, inputs, length, num_beams=3, length_penalty=1.0)
    np.testing.assert_array_equal(np.stack(runs.generate(_rows(inputs), beams)), want)

    sampled = engine.Request(decoding_settings.DecodingSettings(temperature=1.0, seed=3), length)
    together = np.stack(runs.generate(_rows(inputs), sampled))
    alone = [runs.generate([row], sampled, first=i)[0] for i, row in enumerate(_rows(inputs))]
    np.testing.assert_array_equal(together, np.stack(alone))
    assert not np.array_equal(together, ids)


def test_t5tpu_load_reads_a_t5gemma_directory_and_decodes_as_generate(saved):
    """t5tpu.load (the loader's Hugging Face reader picks T5Gemma's by config.json's
    model_type): greedy and beam ids of the unbalanced model as transformers generates them."""
    from t5tpu import api

    model, directory, config, params = saved["unbalanced"]
    loaded = api.load(directory, batch_size=4, max_target_length=10)
    assert loaded.model.config == config
    inputs = _decoded_inputs()
    want = _hf_generate(model, inputs, 10, num_beams=1)
    np.testing.assert_array_equal(loaded.generate_ids(inputs), want)
    beams = {"num_beams": 3, "length_penalty": 1.0}
    want = _hf_generate(model, inputs, 10, **beams)
    np.testing.assert_array_equal(loaded.generate_ids(inputs, **beams), want)


def _decoded_model_parallel() -> dict:
    """Run on 8 devices (2-way model parallel): the unbalanced model's greedy and beam ids
    through the engine, transformers' own, and how its kv-head kernels are placed (the
    encoder's 2 kv heads split over 'model', the decoder's 1 replicated)."""
    import tempfile

    model = _hf_model("unbalanced")
    with tempfile.TemporaryDirectory() as directory:
        model.save_pretrained(directory)
        config, params = hf_t5gemma.load(directory)
    partitioner = Partitioner(num_partitions=2)
    runs = _engine(config, params, 10, partitioner)
    rows, inputs = _rows(_decoded_inputs()), _decoded_inputs()
    beams = {"num_beams": 3, "length_penalty": 1.0}
    beam_request = engine.Request(decoding_settings.DecodingSettings(**beams), 10)
    _, shardings = param_shapes.sharded_abstract_params(config, partitioner)
    keys = {stack: shardings[stack]["layers_0"] for stack in ("encoder", "decoder")}
    return {
        "greedy": np.stack(
            runs.generate(rows, engine.Request(decoding_settings.DecodingSettings(), 10))
        ),
        "want_greedy": _hf_generate(model, inputs, 10, num_beams=1),
        "beam": np.stack(runs.generate(rows, beam_request)),
        "want_beam": _hf_generate(model, inputs, 10, **beams),
        "encoder_key": str(keys["encoder"]["attention"]["key"]["kernel"].spec),
        "decoder_key": str(keys["decoder"]["self_attention"]["key"]["kernel"].spec),
    }


@pytest.mark.slow  # a process of its own with 8 devices
def test_model_parallel_decodes_as_transformers_generate():
    from fake_devices import run_script_on_eight_devices

    out = run_script_on_eight_devices(__file__)
    assert out["greedy"] == out["want_greedy"] and out["beam"] == out["want_beam"]
    assert out["encoder_key"] == str(jax.sharding.PartitionSpec(None, "model", None))
    assert out["decoder_key"] == str(jax.sharding.PartitionSpec(None, None, None))


@pytest.mark.parametrize("variant", VARIANTS)
def test_export_gives_save_pretrained_tensors_and_loads_in_transformers(saved, variant, tmp_path):
    model, directory, config, params = saved[variant]
    hf_t5gemma.export(params, config, str(tmp_path))
    written = safetensors.numpy.load_file(os.path.join(tmp_path, "model.safetensors"))
    original = safetensors.numpy.load_file(os.path.join(directory, "model.safetensors"))
    assert sorted(written) == sorted(k for k in original if not k.startswith("lm_head"))
    for name, tensor in written.items():
        np.testing.assert_array_equal(tensor, original[name], err_msg=name)
    reloaded = transformers.T5GemmaForConditionalGeneration.from_pretrained(
        str(tmp_path), attn_implementation="eager"
    ).eval()
    inputs, targets = _batch()
    np.testing.assert_array_equal(
        _hf_logits(reloaded, inputs, targets), _hf_logits(model, inputs, targets)
    )


# transformers' T5GemmaForConditionalGeneration at each geometry, built on the meta device (no
# weights), counts these; the header comment of each file states the same.
PARAMETER_COUNTS = {
    "tiny": 953_088,
    "2b_2b": 5_596_853_760,
    "9b_2b": 12_292_375_296,
    "9b_9b": 20_333_401_088,
}
MODELS_DIR = ROOT / "configs" / "models" / "t5gemma"


def parse_model_config(name: str) -> T5GemmaConfig:
    """configs/models/t5gemma/<name>.gin of this checkout (searched first, as a run's
    --gin_search_paths would)."""
    gin.clear_config()
    gin.add_config_file_search_path(str(ROOT))
    gin.parse_config_files_and_bindings([str(MODELS_DIR / f"{name}.gin")], ["DROPOUT_RATE = 0.0"])
    return T5GemmaConfig()


def _hf_count(config: T5GemmaConfig) -> int:
    described = dict(hf_t5gemma.hf_config(config))
    del described["architectures"], described["model_type"]
    with torch.device("meta"):
        model = transformers.T5GemmaForConditionalGeneration(
            transformers.T5GemmaConfig(**described)
        )
    return sum(p.numel() for p in model.parameters())  # lm_head is the decoder's embedding


@pytest.mark.parametrize("name, expected", sorted(PARAMETER_COUNTS.items()))
def test_model_gins_have_transformers_parameter_counts(name, expected):
    try:
        config = parse_model_config(name)
    finally:
        gin.clear_config()
    flat = flax.traverse_util.flatten_dict(param_shapes.abstract_params(config), sep="/")
    assert sum(math.prod(leaf.shape) for leaf in flat.values()) == expected
    assert _hf_count(config) == expected
    assert f"{expected:,} parameters" in (MODELS_DIR / f"{name}.gin").read_text().split("\n")[0]
    assert config.dropout_rate == 0.0
    assert ("encoder/token_embedder/embedding" in flat) and ("decoder/logits_dense" not in flat)
    assert flat["encoder/layers_0/attention/key/kernel"].shape == (
        config.emb_dim,
        config.encoder.num_kv_heads,
        config.encoder.head_dim,
    )
    if name == "9b_2b":  # cross-attention projects the 9B encoder's width into the 2B decoder
        key = flat["decoder/layers_0/encoder_decoder_attention/key/kernel"]
        assert key.shape == (3584, 4, 256)
        assert config.decoder.emb_dim == 2304 and config.num_decoder_layers == 26
    else:
        assert config.decoder == config.encoder


EXPERIMENT = "configs/experiments/qp_is_duplicate_t5gemma_tiny_cpu.gin"


@pytest.mark.slow  # trains and decodes through the command line
def test_tiny_t5gemma_trains_infers_loads_and_exports(tmp_path):
    """The tiny experiment through `t5tpu train` and `t5tpu infer` (the real runners, the
    engine, checkpoints and their config.gin); t5tpu.load reads it back as a T5Gemma and
    predicts as infer did; its Hugging Face export scores as t5tpu does."""
    from cli_runs import quick_training, read_jsonl, succeeded, t5tpu

    from t5tpu.api import load

    steps, model_dir = 10, str(tmp_path / "model")
    # This checkout's configs first (an installed t5tpu.configs may be another checkout's).
    flags = [f"--gin_file={EXPERIMENT}", f"--gin_search_paths={ROOT}"]
    # The experiment's EVAL_PERIOD (300) lies beyond the steps: no eval, training alone.
    run = succeeded(t5tpu("train", *flags, *quick_training(steps), model_dir=model_dir))
    assert f"step {steps}/{steps}" in run.stdout
    succeeded(t5tpu("infer", *flags, "--gin.INFER_NUM_EXAMPLES=4", model_dir=model_dir))
    path = os.path.join(model_dir, "inference", f"qp_is_duplicate_validation-{steps}-first4.jsonl")
    rows = read_jsonl(path)
    loaded = load(model_dir, batch_size=4)
    assert isinstance(loaded.model.config, T5GemmaConfig)
    assert loaded.model.config.encoder.num_kv_heads == 2
    inputs = [row["input"] for row in rows]
    assert loaded.predict(inputs) == [row["prediction"] for row in rows]

    params = jax.tree_util.tree_map(np.asarray, loaded.params)
    hf_t5gemma.export(params, loaded.model.config, str(tmp_path / "hf"))
    hf = transformers.T5GemmaForConditionalGeneration.from_pretrained(
        str(tmp_path / "hf"), attn_implementation="eager"
    ).eval()
    ids = np.zeros((len(inputs), 32), np.int64)
    for i, text in enumerate(inputs):
        encoded = loaded.vocabulary.encode(text)[:31] + [EOS]
        ids[i, : len(encoded)] = encoded
    targets = np.array([[0, 3, 5, EOS]] * len(inputs))
    ours = loaded.logits(ids, targets)
    np.testing.assert_allclose(ours, _hf_logits(hf, ids, targets), atol=1e-4)


def test_lora_adapts_every_target_and_bfloat16_stays_close(saved):
    """LoRA's targets (q, k, v, o of the three attentions, wi and wo) sit beside T5Gemma's
    kernels as beside T5's, a fresh adapter changing nothing; the bfloat16 network (bfloat16
    matmul inputs, float32 sums and softmax) stays near the float32 logits."""
    from t5tpu.model import lora
    from t5tpu.model.encoder_decoder import adapted_model

    _, _, config, params = saved["unbalanced"]
    base = EncoderDecoderModel(config, seqio.PassThroughVocabulary(VOCAB, eos_id=EOS))
    settings = lora.LoraSettings(rank=2, targets=lora.TARGETS)
    adapted = adapted_model(base, settings)
    initial = flax.core.meta.unbox(adapted.init(jax.random.PRNGKey(1), 8, 8))
    _, adapters = lora.split(initial)
    kernels = flax.traverse_util.flatten_dict(adapters, sep="/")
    # Per encoder layer 4 attention + 3 MLP kernels, per decoder layer 8 + 3; a and b each.
    layers = config.num_encoder_layers * 7 + config.num_decoder_layers * 11
    assert len(kernels) == 2 * layers
    assert "decoder/layers_1/encoder_decoder_attention/key/lora_a" in kernels
    assert kernels["decoder/layers_0/encoder_decoder_attention/key/lora_a"].shape == (64, 2)
    shapes = lora.adapter_shapes(param_shapes.abstract_params(config), None, settings)
    assert len(flax.traverse_util.flatten_dict(shapes)) == 2 * layers

    inputs, targets = _batch()
    batch = {"encoder_input_tokens": inputs, "decoder_input_tokens": targets}
    plain = base.logits(params, batch)
    np.testing.assert_allclose(adapted.logits(lora.join(params, adapters), batch), plain, atol=1e-6)

    half = dataclasses.replace(config, dtype="bfloat16")
    low = T5GemmaTransformer(half).apply({"params": params}, inputs, targets)
    assert low.dtype == jnp.float32
    assert np.max(np.abs(np.asarray(low) - np.asarray(plain))) < 0.1 * np.max(np.abs(plain))


if __name__ == "__main__":  # test_model_parallel_decodes_as_transformers_generate's run
    import json

    print(json.dumps({k: np.asarray(v).tolist() for k, v in _decoded_model_parallel().items()}))
