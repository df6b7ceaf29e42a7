"""The Python API (t5tpu.load, t5tpu.finetune) on a tiny model the notebook-style example trains:
its predictions equal `t5tpu infer`'s, its logits equal transformers' on the exported Hugging
Face directory, its scores are the logits' log-likelihoods, and repeated calls reuse compiled
programs."""

from __future__ import annotations

import gc
import os
import pathlib
import subprocess
import sys
import weakref

import jax
import numpy as np
import pytest
from cli_runs import ROOT, TINY_EXPERIMENT, foreign_log_lines, read_jsonl, succeeded, t5tpu
from t5tpu.tasks import quora, squad

from t5tpu import api
from t5tpu.errors import UserError

STEPS = 60
QUESTIONS = os.path.join(ROOT, "examples", "questions.txt")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """examples/python_api.py run as a user would (finetune, load, ask), from another
    directory."""
    folder = tmp_path_factory.mktemp("api")
    model_dir = str(folder / "model")
    run = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "python_api.py")]
        + [f"--model_dir={model_dir}", f"--steps={STEPS}"],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"step {STEPS}/{STEPS}" in run.stdout, run.stdout[-2000:]
    assert run.stdout.count("is_duplicate(") == 2, run.stdout[-2000:]
    assert not run.stderr.strip(), run.stderr[-2000:]  # no library noise in a notebook
    return model_dir


@pytest.fixture(scope="module")
def model(model_dir) -> api.T5Model:
    return api.load(model_dir, batch_size=4)


@pytest.mark.slow
def test_predict_gives_what_the_cli_infer_writes(model, model_dir):
    with open(QUESTIONS) as f:
        inputs = [line.strip() for line in f if line.strip()]
    run = succeeded(
        t5tpu(
            "infer",
            f"--gin_file={TINY_EXPERIMENT}",
            f"--gin.INFER_INPUT_FILE='{QUESTIONS}'",
            model_dir=model_dir,
        )
    )
    assert run.returncode == 0
    rows = read_jsonl(os.path.join(model_dir, "inference", f"questions-{STEPS}.jsonl"))
    assert model.predict(inputs) == [row["prediction"] for row in rows]
    # Five inputs with batch_size 4: two calls, the second padded; same answers one at a time.
    five = inputs + inputs[:2]
    assert model.predict(five) == [model.predict([text])[0] for text in five]


@pytest.mark.slow
def test_predict_file_writes_the_bytes_infer_writes_and_resumes(model, model_dir, tmp_path):
    """...in chunks: a call stopped after its first chunk continues from the second."""
    infer_file = os.path.join(model_dir, "inference", f"questions-{STEPS}.jsonl")
    if not os.path.exists(infer_file):
        succeeded(
            t5tpu(
                "infer",
                f"--gin_file={TINY_EXPERIMENT}",
                f"--gin.INFER_INPUT_FILE='{QUESTIONS}'",
                model_dir=model_dir,
            )
        )
    out = tmp_path / "predictions.jsonl"
    calls = []
    decode = model._predict_texts

    def stopped_after_one_chunk(texts, *, first, settings):
        calls.append(first)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return decode(texts, first=first, settings=settings)

    model._predict_texts = stopped_after_one_chunk
    try:
        with pytest.raises(KeyboardInterrupt):
            model.predict_file(QUESTIONS, str(out), chunk_size=2)
        assert not out.exists() and calls == [0, 2]
        calls.clear()
        assert model.predict_file(QUESTIONS, str(out), chunk_size=2) == str(out)
    finally:
        del model._predict_texts
    assert calls == [2]  # the saved chunk was not decoded again
    assert out.read_bytes() == pathlib.Path(infer_file).read_bytes()


@pytest.mark.slow
def test_predict_iter_streams_what_predict_returns(model):
    with open(QUESTIONS) as f:
        inputs = [line.strip() for line in f if line.strip()] * 3
    for settings in ({}, {"temperature": 1.0, "seed": 7}, {"num_beams": 2}):
        whole = model.predict(inputs, **settings)
        assert list(model.predict_iter(iter(inputs), batch_size=4, **settings)) == whole
    stream = model.predict_iter(iter(inputs), batch_size=2)
    assert next(stream) == model.predict(inputs[:1])[0]  # answers before the input is read
    with pytest.raises(UserError, match="unknown decoding setting 'beams'"):
        next(model.predict_iter(inputs, beams=2))


@pytest.fixture(scope="module")
def hf_dir(model_dir, tmp_path_factory) -> str:
    """The trained model exported with `t5tpu convert --to=hf` (by a fresh interpreter, whose
    start would show TensorFlow's import notices)."""
    folder = str(tmp_path_factory.mktemp("api_hf") / "hf")
    convert = ("convert", "--to=hf", f"--input={model_dir}", f"--output_dir={folder}")
    run = succeeded(t5tpu(*convert, fresh=True))
    assert not foreign_log_lines(run.stderr), run.stderr[-3000:]
    return folder


@pytest.mark.slow
@pytest.mark.parity
def test_logits_match_transformers_on_the_exported_directory(model, hf_dir):
    ids = np.array([model.vocabulary.encode("is duplicate: a <SEP> b") + [1]] * 2, np.int32)
    decoder_ids = np.array([[0, 3, 5, 7], [0, 9, 2, 4]], np.int32)

    ours = model.logits(ids, decoder_ids)
    from_hf = api.load(hf_dir, batch_size=2)
    assert from_hf.logits(ids, decoder_ids).shape == ours.shape == (2, 4, model.config.vocab_size)
    np.testing.assert_allclose(from_hf.logits(ids, decoder_ids), ours, rtol=0, atol=1e-5)

    import torch
    import transformers

    reference = transformers.T5ForConditionalGeneration.from_pretrained(hf_dir).eval()
    with torch.no_grad():
        theirs = reference(
            input_ids=torch.tensor(ids, dtype=torch.long),
            decoder_input_ids=torch.tensor(decoder_ids, dtype=torch.long),
        ).logits.numpy()
    np.testing.assert_allclose(ours, theirs[..., : ours.shape[-1]], rtol=0, atol=2e-4)
    # The exported directory carries the vocabulary: text works there too.
    assert from_hf.predict(["is duplicate: a <SEP> b"]) == model.predict(
        ["is duplicate: a <SEP> b"]
    )


@pytest.mark.slow
@pytest.mark.parity
def test_the_exported_directory_runs_in_a_transformers_pipeline_offline(model, hf_dir):
    import transformers

    with open(QUESTIONS) as f:
        inputs = [line.strip() for line in f if line.strip()]
    # The bundled vocabulary has a user-defined piece (<SEP>) that transformers' converted fast
    # tokenizer splits differently from sentencepiece; the slow one is sentencepiece itself.
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir, use_fast=False)
    for text in inputs:
        assert tokenizer(text).input_ids == model.vocabulary.encode(text) + [1]
    generate = transformers.pipeline(
        "text2text-generation", model=hf_dir, tokenizer=tokenizer, framework="pt"
    )
    answers = [row["generated_text"] for row in generate(inputs)]
    assert answers == model.predict(inputs)


@pytest.mark.slow
def test_score_is_the_log_likelihood_of_the_target_tokens(model):
    inputs = ["is duplicate: how do i cook rice? <SEP> how to cook rice?"] * 2
    targets = ["1", "0"]
    scores = model.score(inputs, targets)
    ids = np.array([model.vocabulary.encode(inputs[0]) + [1]] * 2)
    for row, target in enumerate(targets):
        target_ids = model.vocabulary.encode(target) + [1]
        logits = model.logits(ids[row : row + 1], np.array([[0, *target_ids[:-1]]]))[0]
        log_p = jax.nn.log_softmax(logits)
        expected = sum(float(log_p[i, token]) for i, token in enumerate(target_ids))
        assert scores[row] == pytest.approx(expected, abs=1e-4)
    assert scores.dtype == np.float32 and np.all(scores < 0)


@pytest.mark.slow
def test_generate_ids_beam_and_sampling_settings(model):
    ids = [model.vocabulary.encode("is duplicate: a <SEP> b") + [1]]
    greedy = model.generate_ids(ids, max_new_tokens=6)
    assert greedy.shape == (1, 6) and 1 in greedy[0].tolist()  # ends with EOS
    assert (
        model.vocabulary.decode(greedy[0].tolist()) == model.predict(["is duplicate: a <SEP> b"])[0]
    )
    assert model.generate_ids(ids, max_new_tokens=6, num_beams=3).shape == (1, 6)
    sampled = [model.generate_ids(ids, max_new_tokens=6, temperature=1.0, seed=s) for s in (0, 0)]
    np.testing.assert_array_equal(*sampled)  # seeded
    with pytest.raises(UserError, match="num_beams = 0 must be a whole number from 1 to 16"):
        model.generate_ids(ids, num_beams=0)


@pytest.mark.slow
def test_repeated_calls_of_similar_size_reuse_one_compiled_program(model):
    model.predict(["is duplicate: x <SEP> y"])
    compiled = model.engine.program_count
    for texts in (["is duplicate: a <SEP> b"] * 3, ["is duplicate: what? <SEP> why?"] * 2):
        model.predict(texts)
    assert model.engine.program_count == compiled


@pytest.mark.slow
def test_a_deleted_model_frees_its_parameters(model_dir):
    # Compiled programs cached on the class, not the object, kept every model ever loaded alive.
    model = api.load(model_dir, batch_size=4)
    model.predict(["is duplicate: a <SEP> b"])
    model.score(["is duplicate: a <SEP> b"], ["1"])
    ids = np.array([model.vocabulary.encode("a") + [1]], np.int32)
    model.logits(ids, np.zeros((1, 2), np.int32))
    param = weakref.ref(jax.tree_util.tree_leaves(model.params)[0])
    assert isinstance(param(), jax.Array)
    del model
    gc.collect()
    assert param() is None, "the deleted model's parameters are still alive"


@pytest.mark.slow
def test_inputs_are_shaped_as_the_run_trained_and_the_helpers_ask_so(model):
    # Quora's tasks lower-case and drop double quotes, in training and at every front end.
    raw = 'is duplicate: How do I "Learn" X? <SEP> Why Y?'
    assert model.model_inputs([raw]) == ["is duplicate: how do i learn x? <SEP> why y?"]
    assert model.model_inputs([raw], exact_inputs=True) == [raw]
    assert model.tasks == ("qp_is_duplicate",)
    shaped = model.model_inputs([raw])
    assert model.predict([raw]) == model.predict(shaped, exact_inputs=True)
    pair = ("How do I cook rice?", "How to cook rice?")
    [expected] = model.predict([quora.is_duplicate_line(*pair)])
    assert quora.is_duplicate(model, *pair) == (expected.strip() == "1")
    with pytest.raises(UserError, match="trained on qp_is_duplicate, not generate_similar"):
        quora.similar_question(model, "How?")
    [paraphrase] = model.predict([quora.similar_question_line("How?")], num_beams=2)
    assert quora.similar_question(model, "How?", num_beams=2, check_task=False) == paraphrase


class _Says:
    """A model that answers every input with one text, and records what it was asked; trained
    on `tasks` (() : it does not say)."""

    source = "a stand-in"

    def __init__(self, text: str, tasks: tuple[str, ...] = ()):
        self.text, self.asked, self.tasks = text, [], tasks

    def predict(self, inputs: list[str], **decoding_settings) -> list[str]:
        self.asked.append((inputs, decoding_settings))
        return [self.text] * len(inputs)


def test_squad_answer_post_processes_as_its_task():
    # squad_v2's "unanswerable" is the empty answer; squad_v1 keeps it as text.
    model = _Says(" unanswerable ")
    assert squad.answer(model, "Who?", "Ada did.", task=squad.V2_TASK, num_beams=3) == ""
    assert model.asked == [(["question: Who? context: Ada did."], {"num_beams": 3})]
    assert squad.answer(model, "Who?", "Ada did.") == "unanswerable"
    # Without `task`, the SQuAD task the model was trained on.
    assert squad.answer(_Says(" unanswerable ", (squad.V2_TASK,)), "Who?", "Ada did.") == ""


def test_quora_helpers_ask_as_their_routes_declare():
    # is_duplicate decodes at most 4 tokens ("1" or "0" and EOS) and answers a boolean; the
    # model shapes the line as its run did (T5Model lower-cases it for a Quora run).
    model = _Says(" 1 ", ("qp_is_duplicate", "generate_similar_question"))
    assert quora.is_duplicate(model, "A?", "B?") is True
    assert model.asked == [(["is duplicate: A? <SEP> B?"], {"max_new_tokens": 4})]
    assert quora.similar_question(model, "A?", temperature=0.5) == " 1 "
    assert model.asked[1] == (["generate similar question: A?"], {"temperature": 0.5})
    with pytest.raises(UserError, match="squad_v1 or squad_v2"):
        squad.answer(model, "Who?", "Ada did.", task="squad_v3")


def test_task_helpers_refuse_a_model_of_another_task_unless_told():
    squad_model = _Says("0", (squad.V1_TASK,))
    with pytest.raises(UserError) as refused:
        quora.is_duplicate(squad_model, "A?", "B?")
    assert str(refused.value) == (
        "a stand-in: the model was trained on squad_v1, not qp_is_duplicate: its answer to a "
        "is_duplicate question would not mean one; pass check_task=False to ask it anyway"
    )
    assert squad_model.asked == []  # refused before the model is asked
    assert quora.is_duplicate(squad_model, "A?", "B?", check_task=False) is False
    text_model = _Says("letter", ("text_to_text",))
    with pytest.raises(UserError, match="trained on text_to_text, not squad_v1"):
        squad.answer(text_model, "Who?", "Ada did.")
    assert squad.answer(text_model, "Who?", "Ada did.", check_task=False) == "letter"
    # The _tfds tasks are the same tasks over another source.
    assert quora.is_duplicate(_Says("1", ("qp_is_duplicate_tfds",)), "A?", "B?") is True


@pytest.mark.slow
def test_a_named_step_and_bad_calls(model_dir, model):
    same = api.load(model_dir, step=STEPS)
    equal = jax.tree_util.tree_map(lambda a, b: bool(np.all(a == b)), same.params, model.params)
    assert all(jax.tree_util.tree_leaves(equal))
    with pytest.raises(UserError, match=f"{STEPS + 5}"):
        api.load(model_dir, step=STEPS + 5)
    with pytest.raises(UserError, match="does not exist"):
        api.load(os.path.join(model_dir, "no_such_dir"))
    with pytest.raises(UserError, match="list of strings"):
        model.predict("is duplicate: a <SEP> b")
    with pytest.raises(UserError, match="2 inputs but 1 targets"):
        model.score(["a", "b"], ["c"])
    for bad in (0, -3, 2.5, True):  # 0 used to mean the default, silently
        with pytest.raises(
            UserError, match=f"max_length = {bad!r} must be None or a whole number from 1 to 65536"
        ):
            model.predict(["is duplicate: a <SEP> b"], max_length=bad)
