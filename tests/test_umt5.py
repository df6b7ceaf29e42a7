"""umT5 on CPU, offline, through the whole path: the tiny umT5 experiment (a position-bias table
in every layer) trained and evaluated at its last step, decoded by `t5tpu infer`; the same
checkpoint answering through the Python API and `t5tpu serve` as infer does; its Hugging Face
export loaded as transformers' UMT5 in a pipeline; and LoRA adapters on it exported for PEFT,
decoding on the exported base as t5tpu does. Trained once for the module (20 steps: shapes and
agreement, not accuracy), like test_byt5.py's tiny ByT5."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
from cli_runs import quick_training, read_json, read_jsonl, succeeded, t5tpu
from test_serve import ServerProcess, predict

from t5tpu.api import load
from t5tpu.storage import checkpoints

pytestmark = pytest.mark.slow  # trains and serves through the command line

EXPERIMENT = "configs/experiments/qp_is_duplicate_umt5_tiny_cpu.gin"
STEPS = 20


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(MODEL_DIR, training's stdout, the first 8 validation rows `t5tpu infer` decoded)."""
    model_dir = str(tmp_path_factory.mktemp("umt5") / "model")
    flags = [*quick_training(STEPS), f"--gin.EVAL_PERIOD={STEPS}"]
    run = succeeded(t5tpu("train", f"--gin_file={EXPERIMENT}", *flags, model_dir=model_dir))
    infer = ("infer", f"--gin_file={EXPERIMENT}", "--gin.INFER_NUM_EXAMPLES=8")
    succeeded(t5tpu(*infer, model_dir=model_dir))
    path = os.path.join(model_dir, "inference", f"qp_is_duplicate_validation-{STEPS}-first8.jsonl")
    return model_dir, run.stdout, read_jsonl(path)


@pytest.fixture(scope="module")
def model(trained):
    return load(trained[0], batch_size=4)


def test_tiny_umt5_trains_evaluates_infers_and_answers_through_the_api(trained, model):
    model_dir, stdout, rows = trained
    losses = re.findall(rf"^step (\d+)/{STEPS}\s+loss ([\d.]+)", stdout, re.MULTILINE)
    assert [int(step) for step, _ in losses] == [10, STEPS], stdout[-2000:]
    metrics = read_json(os.path.join(model_dir, "eval_metrics.json"))[str(STEPS)]
    assert metrics["qp_is_duplicate"]["num_examples"] == 105
    # The checkpoint keeps a table in every layer and none per stack, as T5X names them.
    saved = checkpoints.manager(model_dir, read_only=True).item_metadata(STEPS)["params"]
    names = checkpoints.flat_shapes(saved)
    tables = sorted(name for name in names if "relpos_bias" in name)
    assert tables == [
        f"{stack}/layers_{i}/relpos_bias/rel_embedding"
        for stack in ("decoder", "encoder")
        for i in (0, 1)
    ]
    assert model.config.relative_bias_per_layer
    assert len(rows) == 8
    inputs = [row["input"] for row in rows]
    assert model.predict(inputs, exact_inputs=True) == [row["prediction"] for row in rows]


def test_serve_answers_as_infer_and_scores_as_the_api(trained, model, tmp_path):
    model_dir, _, rows = trained
    server = ServerProcess(
        f"--gin_file={EXPERIMENT}",
        f"--gin.MODEL_DIR='{model_dir}'",
        "--max_batch_size=4",
        "--no_warmup",
        log=tmp_path / "server.log",
    )
    try:
        server.wait_ready()
        inputs = [row["input"] for row in rows]
        answers = predict(server.port, inputs, {"exact_inputs": True})["predictions"]
        assert answers == [row["prediction"] for row in rows]
        targets = ["1" if i % 2 else "0" for i in range(len(inputs))]
        pairs = [{"input": a, "target": b} for a, b in zip(inputs, targets, strict=True)]
        scored = predict(server.port, pairs, {"exact_inputs": True}, path="/v1/score")
        expected = model.score(inputs, targets, exact_inputs=True)
        np.testing.assert_allclose(
            [row["score"] for row in scored["predictions"]], expected, rtol=1e-5
        )
    finally:
        assert server.stop() == 0, server.output()[-3000:]


def _fitting(model, rows) -> list[str]:
    """The rows' inputs that fit the run's 96 input tokens (EOS included) uncut: transformers
    reads them whole, t5tpu cuts longer ones."""
    inputs = [row["input"] for row in rows]
    kept = [text for text in inputs if len(model.vocabulary.encode(text)) < 96]
    assert len(kept) >= 4, len(kept)
    return kept


def _hf_scores(hf_model, tokenizer, inputs: list[str], targets: list[str]) -> np.ndarray:
    """transformers' log-likelihood of each target (EOS included), as T5Model.score sums it."""
    import torch

    scores = []
    for text, target in zip(inputs, targets, strict=True):
        input_ids = torch.tensor([tokenizer(text).input_ids])
        labels = torch.tensor([tokenizer(target).input_ids])
        with torch.no_grad():
            logits = hf_model(input_ids=input_ids, labels=labels).logits
        log_probs = torch.log_softmax(logits.float(), -1)[0]
        scores.append(float(log_probs.gather(-1, labels[0][:, None]).sum()))
    return np.asarray(scores)


def _export(model_dir: str, output_dir: str, *flags: str) -> str:
    succeeded(
        t5tpu("convert", "--to=hf", *flags, f"--input={model_dir}", f"--output_dir={output_dir}")
    )
    return output_dir


@pytest.mark.parity
def test_the_hf_export_runs_as_umt5_in_a_transformers_pipeline(trained, model, tmp_path):
    import transformers

    model_dir, _, rows = trained
    hf_dir = _export(model_dir, str(tmp_path / "hf"))
    hf_model = transformers.AutoModelForSeq2SeqLM.from_pretrained(hf_dir).eval()
    assert type(hf_model).__name__ == "UMT5ForConditionalGeneration"
    # The bundled vocabulary's <SEP> piece: the slow tokenizer is sentencepiece's own split.
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir, use_fast=False)
    inputs = _fitting(model, rows)
    generate = transformers.pipeline(
        "text2text-generation", model=hf_model, tokenizer=tokenizer, framework="pt"
    )
    answers = [row["generated_text"] for row in generate(inputs, max_new_tokens=4)]
    assert answers == model.predict(inputs, exact_inputs=True)
    targets = ["1" if i % 2 else "0" for i in range(len(inputs))]
    np.testing.assert_allclose(
        _hf_scores(hf_model, tokenizer, inputs, targets),
        model.score(inputs, targets, exact_inputs=True),
        rtol=1e-4,
    )


LORA_STEPS = 10


@pytest.mark.parity
def test_lora_adapters_on_it_load_in_peft_and_score_as_t5tpu(trained, model, tmp_path):
    """A LoRA run on the trained checkpoint; its PEFT export on the exported base gives
    t5tpu's scores, which the adapters moved off the base's."""
    import peft
    import transformers

    model_dir, _, rows = trained
    lora_dir = str(tmp_path / "lora")
    flags = [
        *quick_training(LORA_STEPS),
        "--gin.FINETUNE_METHOD='lora'",
        "--gin.train.relative_steps=True",
        f"--gin.INITIAL_CHECKPOINT_PATH='{model_dir}/checkpoint_{STEPS}'",
        "--gin.LEARNING_RATE=0.03",
        "--gin.lora.targets=('q', 'k', 'v', 'o', 'wi', 'wo')",
        # The base as exported (float32), not rounded to bfloat16 under the adapters: PEFT
        # runs them on the float32 base.
        "--gin.lora.base_dtype='float32'",
    ]
    succeeded(t5tpu("train", f"--gin_file={EXPERIMENT}", *flags, model_dir=lora_dir))
    hf_base = _export(f"{model_dir}/checkpoint_{STEPS}", str(tmp_path / "hf_base"))
    adapters = _export(lora_dir, str(tmp_path / "peft"), "--lora=adapters")
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_base, use_fast=False)
    base = transformers.AutoModelForSeq2SeqLM.from_pretrained(hf_base)
    adapted = peft.PeftModel.from_pretrained(base, adapters).eval()
    inputs = _fitting(model, rows)
    targets = ["1" if i % 2 else "0" for i in range(len(inputs))]
    ours = load(lora_dir, batch_size=4).score(inputs, targets, exact_inputs=True)
    np.testing.assert_allclose(_hf_scores(adapted, tokenizer, inputs, targets), ours, rtol=1e-4)
    base_scores = model.score(inputs, targets, exact_inputs=True)
    assert np.max(np.abs(ours - base_scores)) > 1e-3  # the adapters change the model
