"""LoRA fine-tuning end to end: a tiny T5 fully fine-tuned to copy the first word of a line, then
adapted with low-rank adapters to copy the last word instead, its base file untouched; adapter
checkpoints a small part of a full one; a killed LoRA run resumes bit for bit; a base that is
gone or changed is refused in one line."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from cli_runs import ROOT, cli_command, file_digests, succeeded, t5tpu

import t5tpu as api
from t5tpu.errors import UserError

pytestmark = pytest.mark.slow

EXPERIMENT = "configs/experiments/text_to_text_tiny_cpu.gin"
EXAMPLES = os.path.join(ROOT, "examples", "text_to_text")
BASE_STEPS = 150
LORA_STEPS = 200
ITEMS = ("params", "opt_state")
# No dropout and a higher rate: the tiny model copies the first word at ~90% in 150 steps.
COMMON = ["--gin.DROPOUT_RATE=0.0", "--gin.EVAL_PERIOD=0", "--gin.train.log_period=50"]
# Adafactor scales a step by the parameter's RMS, which for lora_b (zero at the start) stays at
# its floor: LoRA runs use plain Adafactor steps.
LORA = [
    "--gin.FINETUNE_METHOD='lora'",
    "--gin.train.relative_steps=True",
    "--gin.adafactor.multiply_by_parameter_scale=False",
]


def _last_word_files(folder) -> list[str]:
    """The bundled text-to-text example with the last word of each line as its target; each
    training line also reversed and rotated by a word (1,200 rows: with the 400 alone the
    tiny model learns them all and stays below 90% on validation)."""
    train = os.path.join(folder, "train.tsv")
    with open(os.path.join(EXAMPLES, "train.tsv")) as f, open(train, "w") as out:
        for line in f.read().splitlines()[1:]:
            words = line.split("\t")[0].split()
            for order in (words, words[::-1], words[1:] + words[:1]):
                out.write(f"{' '.join(order)}\t{order[-1]}\n")
    validation = os.path.join(folder, "validation.jsonl")
    with open(os.path.join(EXAMPLES, "validation.jsonl")) as f, open(validation, "w") as out:
        for line in f:
            text = json.loads(line)["input"]
            out.write(json.dumps({"input": text, "target": text.split()[-1]}) + "\n")
    return [
        f"--gin.TRAIN_FILES='{train}'",
        f"--gin.VALIDATION_FILES='{validation}'",
        "--gin.INPUT_PREFIX='last word: '",
    ]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A full fine-tuning run on the first word; its checkpoint is the LoRA runs' base."""
    model_dir = str(tmp_path_factory.mktemp("first_word"))
    flags = [f"--gin.TRAIN_STEPS={BASE_STEPS}", "--gin.LEARNING_RATE=0.01", *COMMON]
    succeeded(t5tpu("train", f"--gin_file={EXPERIMENT}", *flags, model_dir=model_dir))
    return os.path.join(model_dir, f"checkpoint_{BASE_STEPS}")


@pytest.fixture(scope="module")
def last_word(tmp_path_factory):
    return _last_word_files(str(tmp_path_factory.mktemp("last_word_data")))


@pytest.fixture(scope="module")
def adapted(base, last_word, tmp_path_factory):
    """LoRA on every projection (rank 16) teaches the base the last word; returns MODEL_DIR
    and the base's file digests before the run."""
    before = file_digests(base)
    model_dir = str(tmp_path_factory.mktemp("adapted"))
    flags = [
        *last_word,
        *COMMON,
        *LORA,
        f"--gin.INITIAL_CHECKPOINT_PATH='{base}'",
        f"--gin.TRAIN_STEPS={LORA_STEPS}",
        "--gin.LEARNING_RATE=0.003",
        "--gin.lora.rank=16",
        "--gin.lora.alpha=16",
        "--gin.lora.targets=('q', 'k', 'v', 'o', 'wi', 'wo')",
    ]
    succeeded(t5tpu("train", f"--gin_file={EXPERIMENT}", *flags, model_dir=model_dir))
    return model_dir, before


def _exact_match(model, rows: list[dict]) -> float:
    predictions = model.predict([f"last word: {row['input']}" for row in rows])
    return 100 * sum(p == r["target"] for p, r in zip(predictions, rows, strict=True)) / len(rows)


def test_lora_learns_the_last_word_and_leaves_the_base_unchanged(base, adapted, last_word):
    model_dir, before = adapted
    assert file_digests(base) == before
    with open(last_word[1].split("'")[1]) as f:
        rows = [json.loads(line) for line in f]
    # t5tpu.load reads the base the checkpoint names and merges the adapters into it.
    model = api.load(model_dir)
    assert _exact_match(model, rows) >= 90.0
    # The same base without adapters copies the first word: it was the adapters that learned.
    assert _exact_match(api.load(base), rows) < 50.0


def _model_bytes(checkpoint: str) -> int:
    """Bytes of a checkpoint's model state (parameters, optimizer state, metadata); the input
    stream's position beside them is the data pipeline's, as large for any model."""
    total = 0
    for directory, _, files in os.walk(checkpoint):
        if "input_position" not in os.path.relpath(directory, checkpoint).split(os.sep):
            total += sum(os.path.getsize(os.path.join(directory, name)) for name in files)
    return total


@pytest.fixture(scope="module")
def resume_flags(base, last_word, tmp_path_factory):
    """A short LoRA run on q and v (PEFT's default targets) on a copy of the base. Rank 4: the
    tiny model is 128 wide, so PEFT's rank 8 is a large share of it (with rank 8 its adapter
    checkpoint is 4.97% of the full one's, a third of that orbax's metadata)."""
    copy = str(tmp_path_factory.mktemp("base_copy") / f"checkpoint_{BASE_STEPS}")
    shutil.copytree(base, copy)
    return [
        f"--gin_file={EXPERIMENT}",
        *last_word,
        *LORA,
        f"--gin.INITIAL_CHECKPOINT_PATH='{copy}'",
        "--gin.TRAIN_STEPS=8",
        "--gin.lora.rank=4",
        "--gin.BATCH_SIZE=8",
        "--gin.SAVE_PERIOD=4",
        "--gin.DROPOUT_RATE=0.1",  # dropout randomness must resume exactly too
        "--gin.EVAL_PERIOD=0",
        "--gin.train.log_period=1",
    ], copy


def _state(model_dir: str, step: int) -> dict:
    """A checkpoint's adapters and their optimizer state, as saved."""
    checkpointer = ocp.StandardCheckpointer()
    folder = os.path.join(model_dir, f"checkpoint_{step}")
    return {item: checkpointer.restore(os.path.join(folder, item)) for item in ITEMS}


def _interrupted(flags, model_dir, at_step):
    proc = subprocess.Popen(
        cli_command("train", *flags, f"--gin.MODEL_DIR='{model_dir}'"),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    for line in proc.stdout:
        if line.startswith(f"step {at_step}/"):
            proc.send_signal(signal.SIGKILL)
            break
    proc.stdout.read()
    return proc.wait(timeout=120)


def test_lora_checkpoints_are_small_and_resume_bitwise_after_sigkill(base, resume_flags, tmp_path):
    flags, _ = resume_flags
    whole, killed = str(tmp_path / "whole"), str(tmp_path / "killed")
    succeeded(t5tpu("train", *flags, model_dir=whole))
    # Steps count on from the base's (relative_steps); saved at multiples of 4.
    assert _interrupted(flags, killed, BASE_STEPS + 3) == -signal.SIGKILL
    assert os.path.isdir(os.path.join(killed, f"checkpoint_{BASE_STEPS + 2}"))
    assert not os.path.exists(os.path.join(killed, f"checkpoint_{BASE_STEPS + 8}"))
    succeeded(t5tpu("train", *flags, model_dir=killed))
    last = BASE_STEPS + 8
    resumed, uninterrupted = _state(killed, last), _state(whole, last)
    assert jax.tree_util.tree_structure(resumed) == jax.tree_util.tree_structure(uninterrupted)
    leaves = zip(*map(jax.tree_util.tree_leaves, (resumed, uninterrupted)), strict=True)
    for a, b in leaves:
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    adapters = _model_bytes(os.path.join(whole, f"checkpoint_{last}"))
    assert adapters < 0.05 * _model_bytes(base), (adapters, _model_bytes(base))


def test_a_changed_or_missing_base_is_one_line(resume_flags, tmp_path):
    flags, copy = resume_flags
    model_dir = str(tmp_path)
    succeeded(t5tpu("train", *flags, "--gin.TRAIN_STEPS=1", model_dir=model_dir))
    params = os.path.join(copy, "params")
    data = sorted(os.path.join(d, n) for d, _, names in os.walk(params) for n in names)[-1]
    with open(data, "ab") as f:
        f.write(b"retrained")
    with pytest.raises(UserError, match=f"the base checkpoint {copy} has changed since"):
        api.load(model_dir)
    run = t5tpu("train", *flags, "--gin.TRAIN_STEPS=2", model_dir=model_dir)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1].startswith("t5tpu: error: the base checkpoint")
    shutil.rmtree(copy)
    with pytest.raises(UserError, match=f"adapters of the base checkpoint {copy}, which is miss"):
        api.load(model_dir)


def test_peft_adapters_on_the_hf_base_decode_as_t5tpu(base, adapted, last_word, tmp_path):
    peft = pytest.importorskip("peft")
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model_dir, _ = adapted
    hf_base, adapters = str(tmp_path / "hf_base"), str(tmp_path / "peft")
    succeeded(t5tpu("convert", "--to=hf", f"--input={base}", f"--output_dir={hf_base}"))
    succeeded(
        t5tpu(
            "convert",
            "--to=hf",
            "--lora=adapters",
            f"--input={model_dir}",
            f"--output_dir={adapters}",
        )
    )
    assert sorted(os.listdir(adapters)) == ["adapter_config.json", "adapter_model.safetensors"]
    with open(last_word[1].split("'")[1]) as f:
        inputs = [f"last word: {json.loads(line)['input']}" for line in f]
    ours = api.load(model_dir).predict(inputs)
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_base)
    hf_model = transformers.T5ForConditionalGeneration.from_pretrained(hf_base)
    adapted_hf = peft.PeftModel.from_pretrained(hf_model, adapters).eval()
    encoded = tokenizer(inputs, return_tensors="pt", padding=True)
    with torch.no_grad():
        ids = adapted_hf.generate(**encoded, max_new_tokens=16, do_sample=False, num_beams=1)
    assert tokenizer.batch_decode(ids, skip_special_tokens=True) == ours


def test_finetune_with_method_lora_needs_a_base(tmp_path):
    with pytest.raises(UserError, match="FINETUNE_METHOD = 'lora' adapts a trained model: set INI"):
        api.finetune(EXPERIMENT, model_dir=str(tmp_path / "run"), method="lora", TRAIN_STEPS=1)
    assert not os.path.exists(tmp_path / "run")  # made for the lock, removed again
