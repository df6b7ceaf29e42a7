"""T5Gemma through the front ends, on test_t5gemma.py's random-weight transformers models:
`t5tpu convert` in and out (the tensors back bit for bit, the converted directory decoding as
transformers' generate), `t5tpu serve` on a converted directory answering as t5tpu.load does,
and a LoRA run over it (trained from the converted model.gin) whose PEFT export, loaded by
peft.PeftModel onto transformers' model, gives t5tpu's logits."""

from __future__ import annotations

import os
import pathlib
import shutil

import numpy as np
import pytest
import safetensors.numpy
import transformers
from cli_runs import quick_training, succeeded, t5tpu
from test_serve import ServerProcess, predict
from test_t5gemma import (  # noqa: F401 (saved: the fixture)
    EXPERIMENT,
    ROOT,
    VARIANTS,
    _batch,
    _decoded_inputs,
    _engine,
    _hf_generate,
    _hf_logits,
    _hf_model,
    _rows,
    saved,
)

from t5tpu import api
from t5tpu.cli import convert as convert_command
from t5tpu.data import vocab
from t5tpu.formats import hf_t5gemma, loader
from t5tpu.model import decoding_settings, engine, param_shapes
from t5tpu.model.t5gemma_network import T5GemmaConfig

pytestmark = pytest.mark.parity


def _convert(*flags: str) -> None:
    assert convert_command.main(list(flags)) == 0


def _tensors(directory) -> dict[str, np.ndarray]:
    return safetensors.numpy.load_file(os.path.join(directory, "model.safetensors"))


@pytest.mark.parametrize("variant", VARIANTS)
def test_convert_in_and_out_gives_the_tensors_back_and_decodes_as_generate(
    saved,  # noqa: F811 (the fixture)
    variant,
    tmp_path,
):
    model, directory, config, _ = saved[variant]
    converted, exported = str(tmp_path / "t5tpu"), str(tmp_path / "hf")
    _convert(f"--input={directory}", f"--output_dir={converted}")
    assert sorted(os.listdir(converted)) == ["checkpoint_0", "model.gin"]
    gin_text = pathlib.Path(converted, "model.gin").read_text().splitlines()
    assert "EncoderDecoderModel.config = @T5GemmaConfig()" in gin_text
    assert ("T5GemmaConfig.decoder = None" in gin_text) == (variant == "balanced")

    _convert("--to=hf", f"--input={converted}", f"--output_dir={exported}")
    written, original = _tensors(exported), _tensors(directory)
    assert sorted(written) == sorted(k for k in original if not k.startswith("lm_head"))
    for name, tensor in written.items():
        np.testing.assert_array_equal(tensor, original[name], err_msg=name)
    assert hf_t5gemma.T5GemmaCheckpoint(exported).config() == config
    reloaded = transformers.T5GemmaForConditionalGeneration.from_pretrained(
        exported, attn_implementation="eager"
    ).eval()
    inputs, targets = _batch()
    np.testing.assert_array_equal(
        _hf_logits(reloaded, inputs, targets), _hf_logits(model, inputs, targets)
    )

    # The converted checkpoint, read as model.gin describes it, decodes as transformers does.
    # (No vocabulary to bind at 128 ids: t5tpu.load's is the text model's below.)
    opened = loader.open_checkpoint(converted)
    described = opened.model().config
    assert described == config  # model.gin's model is config.json's
    params = opened.load(param_shapes.abstract_params(described))
    inputs = _decoded_inputs()
    greedy = engine.Request(decoding_settings.DecodingSettings(), 10)
    ours = np.stack(_engine(described, params, 10).generate(_rows(inputs), greedy))
    np.testing.assert_array_equal(ours, _hf_generate(model, inputs, 10, num_beams=1))


TEXT_VOCAB = 1024  # the bundled SentencePiece model's pieces
LENGTHS = {"inputs": 24, "targets": 6}
TEXTS = ["is duplicate: how do i learn jax? <SEP> what is jax?", "hello world", "a b c d e f"]


@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    """(transformers' model, its directory with the bundled vocabulary as tokenizer.model, the
    t5tpu directory `t5tpu convert` made of it): the balanced geometry at 1,024 ids."""
    model = _hf_model("balanced", vocab_size=TEXT_VOCAB)
    directory = str(tmp_path_factory.mktemp("hf_t5gemma_text"))
    model.save_pretrained(directory)
    shutil.copy(vocab.bundled_vocabulary_file(), os.path.join(directory, "tokenizer.model"))
    converted = str(tmp_path_factory.mktemp("t5gemma_converted") / "model")
    _convert(f"--input={directory}", f"--output_dir={converted}")
    assert sorted(os.listdir(converted)) == ["checkpoint_0", "model.gin", "spiece.model"]
    return model, directory, converted


@pytest.mark.slow  # a server process
def test_serve_answers_a_converted_t5gemma_as_t5tpu_load(text_model, tmp_path):
    _, _, converted = text_model
    server = ServerProcess(
        f"--model={converted}",
        f"--max_input_length={LENGTHS['inputs']}",
        f"--max_target_length={LENGTHS['targets']}",
        "--max_batch_size=4",
        "--no_warmup",
        log=tmp_path / "server.log",
    )
    loaded = api.load(
        converted,
        batch_size=4,
        max_input_length=LENGTHS["inputs"],
        max_target_length=LENGTHS["targets"],
    )
    assert isinstance(loaded.model.config, T5GemmaConfig)
    sampling = {"temperature": 1.0, "seed": 3}
    try:
        server.wait_ready()
        greedy = predict(server.port, TEXTS)["predictions"]
        sampled = predict(server.port, TEXTS, sampling)["predictions"]
    finally:
        assert server.stop() == 0, server.output()[-3000:]
    assert greedy == loaded.predict(TEXTS)
    assert sampled == loaded.predict(TEXTS, **sampling)
    assert sampled != greedy  # the sampled request was sampled
    assert all(greedy)  # every row answered with some text


LORA_STEPS = 3


@pytest.mark.slow  # trains through the command line
def test_a_lora_run_from_the_converted_model_gin_exports_adapters_peft_loads(text_model, tmp_path):
    """LoRA on every target of the converted model (its model.gin after the tiny T5Gemma
    experiment, INITIAL_CHECKPOINT_PATH its checkpoint; the base kept float32, as transformers
    holds it): the PEFT adapters on transformers' own model give the logits t5tpu computes
    with them merged, which the adapters moved off the base's; the merged export gives them
    too."""
    import peft

    model, directory, converted = text_model
    lora_dir = str(tmp_path / "lora")
    flags = [
        f"--gin_file={EXPERIMENT}",
        f"--gin_file={converted}/model.gin",
        f"--gin_search_paths={ROOT}",
        *quick_training(LORA_STEPS),
        "--gin.FINETUNE_METHOD='lora'",
        "--gin.train.relative_steps=True",
        "--gin.LEARNING_RATE=0.03",
        "--gin.lora.targets=('q', 'k', 'v', 'o', 'wi', 'wo')",
        "--gin.lora.base_dtype='float32'",
    ]
    run = succeeded(t5tpu("train", *flags, model_dir=lora_dir))
    assert f"step {LORA_STEPS}/{LORA_STEPS}" in run.stdout
    adapters, merged = str(tmp_path / "peft"), str(tmp_path / "merged")
    _convert("--to=hf", "--lora=adapters", f"--input={lora_dir}", f"--output_dir={adapters}")
    _convert("--to=hf", f"--input={lora_dir}", f"--output_dir={merged}")
    assert sorted(os.listdir(adapters)) == ["adapter_config.json", "adapter_model.safetensors"]

    inputs, targets = _batch()
    ours = api.load(lora_dir, batch_size=4).logits(inputs, targets)
    base = transformers.T5GemmaForConditionalGeneration.from_pretrained(
        directory, attn_implementation="eager"
    )
    adapted = peft.PeftModel.from_pretrained(base, adapters).eval()
    assert np.max(np.abs(_hf_logits(adapted, inputs, targets) - ours)) < 1e-5
    hf_merged = transformers.T5GemmaForConditionalGeneration.from_pretrained(
        merged, attn_implementation="eager"
    ).eval()
    assert np.max(np.abs(_hf_logits(hf_merged, inputs, targets) - ours)) < 1e-5
    untouched = _hf_logits(model, inputs, targets)
    assert np.max(np.abs(ours - untouched)) > 1e-3  # the adapters change the model
