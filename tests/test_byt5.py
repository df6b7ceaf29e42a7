"""ByT5 on CPU, offline: the byte vocabulary selected from gin, and the tiny ByT5 experiment
trained, evaluated and decoded through the command line."""

from __future__ import annotations

import os
import re

import pytest
import seqio
from cli_runs import read_jsonl, succeeded, t5tpu

from t5tpu.api import load
from t5tpu.data import vocab
from t5tpu.errors import UserError

EXPERIMENT = "configs/experiments/qp_is_duplicate_byt5_tiny_cpu.gin"
STEPS = 30


def test_byte_vocabulary_round_trips_utf8_and_is_shared():
    vocabulary = vocab.default_vocabulary(kind="bytes")
    assert isinstance(vocabulary, seqio.ByteVocabulary)
    assert vocabulary is vocab.default_vocabulary(kind="bytes")  # one object for every caller
    ids = vocabulary.encode("naïve?")
    assert len(ids) == len("naïve?".encode())  # a token per byte, ï is two
    assert min(ids) >= 3  # pad, eos and unk come first
    assert vocabulary.decode([*ids, vocabulary.eos_id]) == "naïve?"


@pytest.mark.parametrize(
    "arguments, message",
    [
        ({"kind": "bpe"}, "default_vocabulary.kind = 'bpe'; use one of sentencepiece, bytes"),
        (
            {"kind": "bytes", "sentencepiece_model_file": "spiece.model"},
            "default_vocabulary.kind = 'bytes' reads no model file",
        ),
    ],
)
def test_a_vocabulary_kind_that_cannot_be_meant_is_refused(arguments, message):
    with pytest.raises(UserError, match=re.escape(message)):
        vocab.default_vocabulary(**arguments)


def _losses(stdout: str) -> dict[int, float]:
    """Training's progress lines ('step 10/30  loss 3.7 ...') as {step: loss}."""
    found = re.findall(rf"^step (\d+)/{STEPS}\s+loss ([\d.]+)", stdout, re.MULTILINE)
    return {int(step): float(loss) for step, loss in found}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(MODEL_DIR, training's stdout, the first 8 validation predictions) of the tiny ByT5."""
    model_dir = str(tmp_path_factory.mktemp("byt5") / "model")
    run = succeeded(
        t5tpu(
            "train",
            f"--gin_file={EXPERIMENT}",
            f"--gin.TRAIN_STEPS={STEPS}",
            "--gin.BATCH_SIZE=8",
            f"--gin.SAVE_PERIOD={STEPS}",
            model_dir=model_dir,
        )
    )
    succeeded(
        t5tpu(
            "infer", f"--gin_file={EXPERIMENT}", "--gin.INFER_NUM_EXAMPLES=8", model_dir=model_dir
        )
    )
    path = os.path.join(model_dir, "inference", f"qp_is_duplicate_validation-{STEPS}-first8.jsonl")
    return model_dir, run.stdout, read_jsonl(path)


@pytest.mark.slow  # trains through the command line
def test_tiny_byt5_trains_evaluates_and_infers_offline(trained):
    _, stdout, rows = trained
    losses = _losses(stdout)
    assert sorted(losses) == [10, 20, STEPS], stdout[-2000:]
    assert losses[STEPS] < 0.6 * losses[10], losses  # it learns: ~4.1 -> ~1.6 in 20 steps
    assert f"eval at step {STEPS}" in stdout  # EVAL_PERIOD is not 0: the last step is evaluated
    assert len(rows) == 8
    assert all(row["input"].startswith("is duplicate: ") for row in rows)
    assert all(row["target"] in ("0", "1") and isinstance(row["prediction"], str) for row in rows)


@pytest.mark.slow
@pytest.mark.parity
def test_the_hf_export_carries_a_byte_tokenizer_transformers_runs_offline(trained, tmp_path):
    import transformers  # torch: only this test needs it

    model_dir, _, rows = trained
    hf_dir = str(tmp_path / "hf")
    succeeded(t5tpu("convert", "--to=hf", f"--input={model_dir}", f"--output_dir={hf_dir}"))
    assert not os.path.exists(os.path.join(hf_dir, "spiece.model"))
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    assert type(tokenizer).__name__ == "ByT5Tokenizer"
    # Inputs that fit TASK_FEATURE_LENGTHS (256 bytes with EOS) untruncated, as transformers
    # reads them; targets of up to 4 bytes, as infer decodes them.
    kept = [row for row in rows if len(row["input"].encode()) < 256]
    assert len(kept) >= 4, [len(row["input"]) for row in rows]
    inputs = [row["input"] for row in kept]
    byte_vocabulary = vocab.default_vocabulary(kind="bytes")
    assert [tokenizer(text).input_ids for text in inputs] == [
        [*byte_vocabulary.encode(text), 1] for text in inputs
    ]
    generate = transformers.pipeline("text2text-generation", model=hf_dir, framework="pt")
    answers = [answer["generated_text"] for answer in generate(inputs, max_new_tokens=4)]
    assert answers == [row["prediction"] for row in kept]
    # And back: the exported directory names its byte vocabulary, which t5tpu.load picks up.
    loaded = load(hf_dir)
    assert isinstance(loaded.vocabulary, seqio.ByteVocabulary)
    assert loaded.predict(inputs) == answers
