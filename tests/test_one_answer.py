"""One model, one answer: a trained tiny model of each kind (text_to_text with an INPUT_PREFIX,
Quora, SQuAD v1, a LoRA run) gives the same raw inputs (capitalised, unicode, longer than the
run's input length, empty) the same answers through every front end: `t5tpu infer`, eval's
per-example file, t5tpu.load's predict and predict_file, `t5tpu serve`'s /v1/predict, /v1/score
and task routes, the Hugging Face export in transformers' pipeline, and PEFT; greedy, and for
the text_to_text model beam search and seeded sampling too (not through Hugging Face: its beam
length penalty and its random numbers are its own).

The models: conftest's trained_text_to_text (the experiment's 200 steps: it answers the first
word of a line, so the prefix changes answers) and trained_tiny (Quora, 2 steps), both read
only; a SQuAD v1 run and a LoRA run over trained_tiny's checkpoint, a few steps each, trained
here. One server per model (the LoRA run served as an adapter over its base), started once and
stopped at the module's end. `t5tpu infer` skips blank lines by design, so "" goes only to the
others, last, so that each other input keeps its index (and its sampling key)."""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import json
import signal
import subprocess
import threading
import time
import types

import numpy as np
import pytest
from cli_runs import (
    SHARED_DATA,
    TINY_EXPERIMENT,
    TRAINED_TINY_STEPS,
    free_port,
    quick_training,
    read_json,
    read_jsonl,
    start,
    succeeded,
    t5tpu,
)
from t5tpu.tasks import quora, squad

from t5tpu.errors import UserError

pytestmark = pytest.mark.slow

# conftest.py's trained_text_to_text is this experiment's run.
TEXT_TO_TEXT_EXPERIMENT = "configs/experiments/text_to_text_tiny_cpu.gin"
SQUAD_EXPERIMENT = "configs/experiments/squad_v1_tiny_cpu.gin"
# Raw lines for a text_to_text model: capitalised, unicode, longer than its 32 input tokens.
TEXT_LINES = [
    "Castle rabbit letter planet",
    "Über straße café naïve piano",
    "stone cloud garden river",
    " ".join(["cloud", "river", "stone", "garden"] * 12),
    "cloud river stone",
]
QUORA_LINES = [
    'is duplicate: How do I learn "Python" quickly? <SEP> What is the fastest way to learn Python?',
    "is duplicate: Où est la Tour Eiffel? <SEP> Wo ist der Eiffelturm?",
    "is duplicate: " + " ".join(f"Word{i}" for i in range(60)) + " <SEP> A question?",
    "generate similar question: How Do I Cook Rice?",
]
# QUORA_LINES[0] as the Quora tasks train: lower-cased, double quotes dropped, <SEP> kept.
QUORA_SHAPED = (
    "is duplicate: how do i learn python quickly? <SEP> what is the fastest way to learn python?"
)
PAIRS = [("How do I learn JAX?", "How can I learn JAX?"), ("Qué es la IA?", "Who is Ada?")]
SQUAD_LENGTHS = {"inputs": 64, "targets": 8}
SQUAD_PARAGRAPHS = 3
LORA_PREFIX = "last word: "
# Beam search and seeded sampling, as infer's gin flags and as API and serve parameters.
SEARCHES = [
    (["--gin.NUM_BEAMS=2"], {"num_beams": 2}),
    (["--gin.TEMPERATURE=1.0", "--gin.infer.random_seed=3"], {"temperature": 1.0, "seed": 3}),
    (
        ["--gin.TEMPERATURE=1.0", "--gin.TOP_P=0.8", "--gin.SEED=3"],
        {"temperature": 1.0, "top_p": 0.8, "seed": 3},
    ),
]
SERVE_FLAGS = ["--host=127.0.0.1", "--max_batch_size=4", "--no_warmup"]
START_TIMEOUT = 300  # seconds to /health 200, on a busy machine
REQUEST_TIMEOUT = 120  # each request; the first of new settings compiles


# --- the front ends -------------------------------------------------------------------------


def infer(model_dir, folder, lines, *flags, gin_file) -> list[dict]:
    """The rows `t5tpu infer` writes for INFER_INPUT_FILE `lines`, into `folder` (MODEL_DIR is
    only read)."""
    folder.mkdir(parents=True)
    inputs = folder / "inputs.txt"
    inputs.write_text("\n".join(lines) + "\n", encoding="utf-8")
    succeeded(
        t5tpu(
            "infer",
            f"--gin_file={gin_file}",
            f"--gin.INFER_INPUT_FILE='{inputs}'",
            f"--gin.INFER_OUTPUT_DIR='{folder}'",
            *flags,
            model_dir=model_dir,
        )
    )
    (written,) = (folder / "inference").glob("*.jsonl")
    return read_jsonl(written)


def predicted_file(model, folder, lines, **settings) -> list[str]:
    """predict_file's predictions of `lines` written as a file."""
    folder.mkdir(parents=True)
    (folder / "inputs.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    written = model.predict_file(str(folder / "inputs.txt"), str(folder / "out.jsonl"), **settings)
    return [row["prediction"] for row in read_jsonl(written)]


class Server:
    """`t5tpu serve FLAGS` on a free port of 127.0.0.1 (cli_runs.start), waited for at its first
    request; its output kept for a failure's message."""

    def __init__(self, *flags: str, log):
        self.port, self.log, self.ready = free_port(), log, False
        with open(log, "w") as stderr:
            self.process = start(
                "serve", f"--port={self.port}", *SERVE_FLAGS, *flags, stderr=stderr
            )
        self.stdout: list[str] = []
        threading.Thread(
            target=lambda: self.stdout.extend(self.process.stdout), daemon=True
        ).start()

    def output(self) -> str:
        return "".join(self.stdout)[-2000:] + self.log.read_text()[-2000:]

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while not self.ready and time.monotonic() < deadline and self.process.poll() is None:
            with contextlib.suppress(OSError):  # not listening yet
                self.ready = self.request("GET", "/health", timeout=5)[0] == 200
            if not self.ready:
                time.sleep(0.2)
        assert self.ready, f"no 200 from /health; the server said:\n{self.output()}"

    def request(self, method: str, path: str, body=None, timeout: float = REQUEST_TIMEOUT):
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            data = None if body is None else json.dumps(body).encode()
            connection.request(method, path, data, {"Content-Type": "application/json"})
            response = connection.getresponse()
            return response.status, json.loads(response.read())
        finally:
            connection.close()

    def post(self, path: str, instances: list, status: int = 200, **parameters):
        """The answer's "predictions" (or, for another status, its "error")."""
        self.wait_ready()
        answered, content = self.request(
            "POST", path, {"instances": instances, "parameters": parameters}
        )
        assert answered == status, content
        return content["predictions"] if status == 200 else content["error"]

    def predict(self, texts: list[str], **parameters) -> list[str]:
        return self.post("/v1/predict", texts, **parameters)

    def streamed(self, texts: list[str], **parameters) -> list[dict]:
        """/v1/predict's server-sent events for `texts` ("stream": true), read as they come."""
        self.wait_ready()
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=REQUEST_TIMEOUT)
        body = {"instances": texts, "parameters": {**parameters, "stream": True}}
        try:
            connection.request("POST", "/v1/predict", json.dumps(body).encode())
            response = connection.getresponse()
            assert response.status == 200, response.read()
            assert response.getheader("Content-Type").startswith("text/event-stream")
            events = []
            for line in response:
                if line.startswith(b"data: "):
                    data = line[len(b"data: ") :].strip()
                    events.append(data.decode() if data == b"[DONE]" else json.loads(data))
            return events
        finally:
            connection.close()

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(60)


def waited(process, what: str) -> str:
    """A started command's output, once it has exited 0."""
    stdout, stderr = process.communicate(timeout=600)
    assert process.returncode == 0, f"{what}: {stderr[-3000:]}"
    return stdout


# --- the models, their servers and exports --------------------------------------------------


@pytest.fixture(scope="module")
def runs(trained_text_to_text, trained_tiny, tmp_path_factory):
    """The four runs' MODEL_DIRs and their servers, each started as soon as its model is there
    (the SQuAD and LoRA runs train together meanwhile)."""
    folder = tmp_path_factory.mktemp("one_answer")
    text_dir, _ = trained_text_to_text
    servers = [Server(f"--model={text_dir}", log=folder / "text_serve.log")]
    try:
        # A few paragraphs of the official dev file: the SQuAD task's own reader, in seconds.
        official = read_json(f"{SHARED_DATA}/squad/dev-v1.1.json")["data"][0]
        kept = official["paragraphs"][:SQUAD_PARAGRAPHS]
        paragraphs = {"title": official["title"], "paragraphs": kept}
        squad_file = folder / "squad.json"
        squad_file.write_text(json.dumps({"version": "1.1", "data": [paragraphs]}))
        squad_dir, lora_dir = folder / "squad", folder / "lora"
        training = [
            start(
                "train",
                f"--gin_file={SQUAD_EXPERIMENT}",
                *squad_flags(squad_file),
                *quick_training(2),
                "--gin.EVAL_PERIOD=0",
                f"--gin.MODEL_DIR='{squad_dir}'",
            ),
            start(
                "train",
                f"--gin_file={TEXT_TO_TEXT_EXPERIMENT}",
                *lora_flags(),
                f"--gin.INITIAL_CHECKPOINT_PATH='{trained_tiny}/checkpoint_{TRAINED_TINY_STEPS}'",
                *quick_training(2),
                "--gin.EVAL_PERIOD=0",
                f"--gin.MODEL_DIR='{lora_dir}'",
            ),
        ]
        for process, what in zip(training, ("the SQuAD run", "the LoRA run"), strict=True):
            waited(process, what)
        servers.append(
            Server(f"--model={trained_tiny}", f"--adapter=lora={lora_dir}", log=folder / "q.log")
        )
        servers.append(Server(f"--model={squad_dir}", log=folder / "squad_serve.log"))
        yield types.SimpleNamespace(
            text=text_dir,
            quora=trained_tiny,
            squad=squad_dir,
            squad_file=squad_file,
            lora=lora_dir,
            folder=folder,
            servers=dict(zip(("text", "quora", "squad"), servers, strict=True)),
        )
    finally:
        for server in servers:
            server.stop()


def squad_flags(squad_file) -> list[str]:
    return [
        f"--gin.SQUAD_V1_TRAIN_FILE='{squad_file}'",
        f"--gin.SQUAD_V1_VALIDATION_FILE='{squad_file}'",
        f"--gin.TASK_FEATURE_LENGTHS={SQUAD_LENGTHS}",
    ]


def lora_flags() -> list[str]:
    """A LoRA run (tests/test_lora.py's flags) of text_to_text with another prefix."""
    return [
        "--gin.FINETUNE_METHOD='lora'",
        "--gin.train.relative_steps=True",
        f"--gin.INPUT_PREFIX='{LORA_PREFIX}'",
    ]


@pytest.fixture(scope="module")
def models(runs):
    """t5tpu.load of each run, with nothing but its path."""
    import t5tpu

    return types.SimpleNamespace(
        text=t5tpu.load(str(runs.text)),
        quora=t5tpu.load(str(runs.quora)),
        squad=t5tpu.load(str(runs.squad)),
        lora=t5tpu.load(str(runs.lora)),
    )


@pytest.fixture(scope="module")
def exports(runs):
    """`t5tpu convert --to=hf` of the text_to_text run and of the Quora run (the LoRA run's
    base), and the LoRA run's adapters for PEFT; converted together."""
    out = runs.folder / "hf"
    wanted = {
        "text": [f"--input={runs.text}"],
        "quora": [f"--input={runs.quora}"],
        "peft": ["--lora=adapters", f"--input={runs.lora}"],
        "peft_base": ["--lora=base", f"--input={runs.lora}"],
    }
    started = {
        name: start("convert", "--to=hf", *flags, f"--output_dir={out / name}")
        for name, flags in wanted.items()
    }
    notes = {name: waited(process, f"convert {name}") for name, process in started.items()}
    return types.SimpleNamespace(**{name: str(out / name) for name in wanted}, notes=notes)


def hf_pipeline(export: str):
    import transformers

    return transformers.pipeline("text2text-generation", model=export)


def piped(export: str, texts: list[str]) -> list[str]:
    """transformers' pipeline on the export, cut to the run's input length (truncation=True)."""
    return [row["generated_text"] for row in hf_pipeline(export)(texts, truncation=True)]


# --- text_to_text ---------------------------------------------------------------------------


@pytest.mark.parity
def test_text_to_text_answers_everywhere_as_hf_generate_on_the_prefixed_line(
    runs, models, exports, tmp_path
):
    """The issue's done-when: raw lines without the prefix, greedy, through infer, load's
    predict and predict_file, serve and the pipeline, all equal transformers' generate on the
    export given the prefixed line cut to the run's input length, up to its target length."""
    import torch
    import transformers

    model, record = models.text, models.text.run_record
    assert (record.input_length, record.target_length) == (32, 8)
    prefix = record.shaping.prefix
    assert prefix == "first word: "
    tokenizer = transformers.AutoTokenizer.from_pretrained(exports.text)
    reference_model = transformers.T5ForConditionalGeneration.from_pretrained(exports.text)
    reference = []
    for line in [*TEXT_LINES, ""]:
        encoded = tokenizer(
            prefix + line, truncation=True, max_length=record.input_length, return_tensors="pt"
        )
        with torch.no_grad():
            ids = reference_model.eval().generate(
                **encoded, num_beams=1, do_sample=False, max_new_tokens=record.target_length
            )
        reference.append(tokenizer.decode(ids[0], skip_special_tokens=True))

    rows = infer(runs.text, tmp_path / "infer", TEXT_LINES, gin_file=TEXT_TO_TEXT_EXPERIMENT)
    assert [row["input"] for row in rows] == TEXT_LINES
    assert [row["model_input"] for row in rows] == [prefix + line for line in TEXT_LINES]
    assert [row["prediction"] for row in rows] == reference[:-1]
    assert predicted_file(model, tmp_path / "file", TEXT_LINES) == reference[:-1]
    assert model.predict([*TEXT_LINES, ""]) == reference
    assert runs.servers["text"].predict([*TEXT_LINES, ""]) == reference
    assert piped(exports.text, [*TEXT_LINES, ""]) == reference

    # Not vacuous: the answers differ by input, and the prefix changes some of them.
    assert len(set(reference)) >= 2, reference
    exact = model.predict([*TEXT_LINES, ""], exact_inputs=True)
    assert exact != reference
    assert runs.servers["text"].predict([*TEXT_LINES, ""], exact_inputs=True) == exact


PENALTIES = {"repetition_penalty": 1.5, "no_repeat_ngram_size": 2, "min_new_tokens": 6}


@pytest.mark.parity
def test_text_to_text_penalties_answer_everywhere_as_hf_generate(runs, models, exports, tmp_path):
    """Hugging Face's repetition_penalty, no_repeat_ngram_size and min_new_tokens: infer's
    macros, predict's and serve's parameters and transformers' generate on the export, alike."""
    import torch
    import transformers

    model, record = models.text, models.text.run_record
    tokenizer = transformers.AutoTokenizer.from_pretrained(exports.text)
    reference_model = transformers.T5ForConditionalGeneration.from_pretrained(exports.text).eval()
    reference = []
    for line in TEXT_LINES:
        encoded = tokenizer(
            record.shaping.prefix + line,
            truncation=True,
            max_length=record.input_length,
            return_tensors="pt",
        )
        with torch.no_grad():
            ids = reference_model.generate(
                **encoded, do_sample=False, max_new_tokens=record.target_length, **PENALTIES
            )
        reference.append(tokenizer.decode(ids[0], skip_special_tokens=True))
    flags = [f"--gin.{name.upper()}={value}" for name, value in PENALTIES.items()]
    rows = infer(
        runs.text, tmp_path / "infer", TEXT_LINES, *flags, gin_file=TEXT_TO_TEXT_EXPERIMENT
    )
    assert [row["prediction"] for row in rows] == reference
    assert model.predict(TEXT_LINES, **PENALTIES) == reference
    assert runs.servers["text"].predict(TEXT_LINES, **PENALTIES) == reference
    assert reference != model.predict(TEXT_LINES)  # the penalties change answers


def _joined(pieces: list, count: int) -> tuple[list[str], list[str], list[int]]:
    """Streamed pieces (dicts or streaming.Piece) as (each input's texts joined, its last
    piece's prediction, how many pieces had text)."""
    texts, predictions, counts = [""] * count, [None] * count, [0] * count
    for piece in pieces:
        piece = piece if isinstance(piece, dict) else dataclasses.asdict(piece)
        texts[piece["index"]] += piece["text"]
        counts[piece["index"]] += bool(piece["text"])
        if piece.get("prediction") is not None:
            assert predictions[piece["index"]] is None and piece["finish_reason"] in (
                "stop",
                "length",
            )
            predictions[piece["index"]] = piece["prediction"]
    return texts, predictions, counts


@pytest.mark.parametrize("settings", [{}, {"min_new_tokens": 8}, {"num_beams": 2}])
def test_streamed_answers_join_to_the_unstreamed_ones(runs, models, settings):
    """t5tpu.load's stream and serve's "stream": true give each answer in pieces as it decodes;
    the pieces join to the answer predict gives, which the last piece carries whole."""
    lines = [*TEXT_LINES, ""]
    want = models.text.predict(lines, **settings)
    texts, predictions, counts = _joined(list(models.text.stream(lines, **settings)), len(lines))
    assert texts == predictions == want
    server = runs.servers["text"]
    warned, *events = server.streamed(lines, **settings)
    assert "truncated" in warned["warnings"][0]  # TEXT_LINES has a line over the input length
    assert events[-1] == "[DONE]"
    texts, predictions, served_counts = _joined(events[:-1], len(lines))
    assert texts == predictions == server.predict(lines, **settings) == want
    if settings.get("min_new_tokens"):  # long answers come in several pieces
        assert max(counts) > 1 and max(served_counts) > 1, (counts, served_counts)


N_BEST = [
    {"num_beams": 3, "num_return_sequences": 2},
    {"temperature": 1.0, "seed": 3, "num_return_sequences": 2},
]


@pytest.mark.parametrize("settings", N_BEST, ids=["beams", "samples"])
def test_n_best_answers_and_scores_alike_everywhere(runs, models, settings, tmp_path):
    """NUM_RETURN_SEQUENCES / num_return_sequences: beam search's n best, or as many samples,
    best first, through infer, predict and serve, each with its summed log-probability (beam
    search's equal to transformers' own scores: tests/test_hf_format.py)."""
    flags = [f"--gin.{name.upper()}={value}" for name, value in settings.items()]
    rows = infer(
        runs.text, tmp_path / "infer", TEXT_LINES, *flags, gin_file=TEXT_TO_TEXT_EXPERIMENT
    )
    ours = models.text.predict(TEXT_LINES, **settings)
    assert [row["prediction"] for row in rows] == ours
    assert all(len(answers) == 2 for answers in ours)
    assert all(len(set(answers)) == 2 for answers in ours) or "temperature" in settings
    served = runs.servers["text"].predict(TEXT_LINES, **settings)
    assert [[answer["prediction"] for answer in row] for row in served] == ours
    scores = np.asarray([row["scores"] for row in rows])
    np.testing.assert_allclose([[a["score"] for a in row] for row in served], scores, atol=1e-4)
    assert (scores < 0).all() and len(np.unique(scores)) > len(TEXT_LINES)


@pytest.mark.parametrize(("flags", "parameters"), SEARCHES, ids=["beam", "sampling", "top_p"])
def test_text_to_text_beam_search_and_sampling_agree(runs, models, flags, parameters, tmp_path):
    rows = infer(
        runs.text, tmp_path / "infer", TEXT_LINES, *flags, gin_file=TEXT_TO_TEXT_EXPERIMENT
    )
    ours = models.text.predict([*TEXT_LINES, ""], **parameters)
    assert [row["prediction"] for row in rows] == ours[:-1]
    assert runs.servers["text"].predict([*TEXT_LINES, ""], **parameters) == ours


def test_eval_examples_are_the_models_answers_to_those_model_inputs(runs, models):
    rows = read_jsonl(runs.text / "eval_examples" / "text_to_text-200.jsonl")
    assert len(rows) == 48 and all(row["input"].startswith("first word: ") for row in rows)
    inputs = [row["input"] for row in rows]
    predictions = models.text.predict(inputs, exact_inputs=True)
    assert [row["prediction"] for row in rows] == predictions


# --- Quora ----------------------------------------------------------------------------------


@pytest.mark.parity
def test_quora_answers_and_scores_alike_everywhere(runs, models, exports, tmp_path):
    model, server = models.quora, runs.servers["quora"]
    assert model.tasks == ("qp_is_duplicate",)
    assert model.model_inputs(QUORA_LINES[:1]) == [QUORA_SHAPED]
    ours = model.predict([*QUORA_LINES, ""])
    rows = infer(runs.quora, tmp_path / "infer", QUORA_LINES, gin_file=TINY_EXPERIMENT)
    assert [row["model_input"] for row in rows] == model.model_inputs(QUORA_LINES)
    assert [row["prediction"] for row in rows] == ours[:-1]
    assert predicted_file(model, tmp_path / "file", QUORA_LINES) == ours[:-1]
    assert server.predict([*QUORA_LINES, ""]) == ours
    # Lower-casing has no Hugging Face field: the pipeline is given the shaped inputs. (Two
    # steps teach this model little of its inputs: the next test compares the ids it is given.)
    assert piped(exports.quora, model.model_inputs([*QUORA_LINES, ""])) == ours

    pairs = [{"question1": a, "question2": b} for a, b in PAIRS]
    expected = [{"is_duplicate": quora.is_duplicate(model, a, b)} for a, b in PAIRS]
    assert server.post("/v1/is_duplicate", pairs) == expected

    # Answers are "0" or "1" and the like: scores show the shaping.
    score = model.score(QUORA_LINES[:1], ["1"])
    served = server.post("/v1/score", [{"input": QUORA_LINES[0], "target": "1"}])
    assert [row["score"] for row in served] == pytest.approx(score.tolist(), rel=1e-5)
    assert model.score([QUORA_SHAPED], ["1"], exact_inputs=True) == pytest.approx(score, abs=1e-6)
    as_written = model.score(QUORA_LINES[:1], ["1"], exact_inputs=True)
    assert abs(float(as_written[0]) - float(score[0])) > 1e-3


@pytest.mark.parity
def test_the_hf_tokenizer_gives_a_quora_model_its_ids_and_convert_names_the_fast_ones_gap(
    models, exports
):
    """transformers' slow tokenizer (sentencepiece itself) gives a shaped Quora input t5tpu's
    ids, <SEP> included. Its fast one, converted from spiece.model, drops the "▁" before the
    bundled vocabulary's user-defined <SEP>: `t5tpu convert` says so, naming the way out."""
    import transformers

    model = models.quora
    slow = transformers.AutoTokenizer.from_pretrained(exports.quora, use_fast=False)
    fast = hf_pipeline(exports.quora).tokenizer
    shaped = model.model_inputs(QUORA_LINES[:2])
    for text in shaped:
        assert slow(text).input_ids == [*model.vocabulary.encode(text), 1], text
    assert any(fast(text).input_ids != slow(text).input_ids for text in shaped)
    assert "use_fast=False" in exports.notes["quora"]


def test_task_routes_and_helpers_refuse_a_model_of_another_task(runs, models):
    instance = {"question": "Who wrote it?", "context": "Ada wrote it."}
    error = runs.servers["quora"].post("/v1/answer", [instance], status=400)
    assert "trained on qp_is_duplicate, not squad_v1" in error
    insisted = runs.servers["quora"].post("/v1/answer", [instance], check_task=False)
    assert insisted == [{"answer": squad.answer(models.quora, **instance, check_task=False)}]
    with pytest.raises(UserError, match="trained on qp_is_duplicate, not squad_v1"):
        squad.answer(models.quora, **instance)
    pair = {"question1": "A?", "question2": "B?"}
    error = runs.servers["squad"].post("/v1/is_duplicate", [pair], status=400)
    assert "trained on squad_v1, not qp_is_duplicate" in error
    with pytest.raises(UserError, match="trained on squad_v1, not qp_is_duplicate"):
        quora.is_duplicate(models.squad, "A?", "B?")


# --- SQuAD ----------------------------------------------------------------------------------


def test_squad_answers_alike_through_predict_and_the_answer_route(runs, models, tmp_path):
    model, server = models.squad, runs.servers["squad"]
    assert model.tasks == ("squad_v1",)
    long_context = read_json(runs.squad_file)["data"][0]["paragraphs"][0]["context"]
    questions = [
        ("Who wrote Hamlet?", "Hamlet is a tragedy by William Shakespeare."),
        ("Wo liegt München?", "München liegt in Bayern, im Süden Deutschlands."),
        ("WHICH team won Super Bowl 50?", long_context),  # longer than the run's 64 tokens
        ("", ""),
    ]
    lines = [squad.answer_line(q, c) for q, c in questions]
    ours = model.predict(lines)
    flags = squad_flags(runs.squad_file)  # as the run trained: its lengths
    rows = infer(runs.squad, tmp_path / "infer", lines, *flags, gin_file=SQUAD_EXPERIMENT)
    assert [row["prediction"] for row in rows] == ours
    assert predicted_file(model, tmp_path / "file", lines) == ours
    assert server.predict(lines) == ours
    helper = [squad.answer(model, q, c) for q, c in questions]
    assert helper == [text.strip() for text in ours]
    instances = [{"question": q, "context": c} for q, c in questions]
    assert server.post("/v1/answer", instances) == [{"answer": text} for text in helper]


# --- LoRA -----------------------------------------------------------------------------------


@pytest.mark.parity
def test_lora_run_answers_alike_through_infer_predict_file_and_peft(
    runs, models, exports, tmp_path
):
    import peft
    import torch
    import transformers

    model, record = models.lora, models.lora.run_record
    assert record.shaping.prefix == LORA_PREFIX
    ours = model.predict([*TEXT_LINES, ""])
    flags = lora_flags()
    rows = infer(
        runs.lora, tmp_path / "infer", TEXT_LINES, *flags, gin_file=TEXT_TO_TEXT_EXPERIMENT
    )
    assert [row["model_input"] for row in rows] == [LORA_PREFIX + line for line in TEXT_LINES]
    assert [row["prediction"] for row in rows] == ours[:-1]
    assert predicted_file(model, tmp_path / "file", TEXT_LINES) == ours[:-1]

    # PEFT has no field for a prefix: it is given the shaped inputs, over the base as the
    # adapters were trained on it (`convert --lora=base`: rounded to lora.base_dtype).
    tokenizer = transformers.AutoTokenizer.from_pretrained(exports.peft_base)
    base = transformers.T5ForConditionalGeneration.from_pretrained(exports.peft_base)
    adapted = peft.PeftModel.from_pretrained(base, exports.peft).eval()
    encoded = tokenizer(
        model.model_inputs([*TEXT_LINES, ""]),
        truncation=True,
        max_length=record.input_length,
        padding=True,
        return_tensors="pt",
    )
    # The same model: its logits, as t5tpu's (test_api.py's tolerance for the model alone).
    inputs = np.array([[*model.vocabulary.encode(model.model_inputs(TEXT_LINES[:1])[0]), 1]])
    targets = np.array([[0, *model.vocabulary.encode(ours[0])]])
    with torch.no_grad():
        theirs = adapted(input_ids=torch.tensor(inputs), decoder_input_ids=torch.tensor(targets))
    logits = model.logits(inputs, targets)
    np.testing.assert_allclose(theirs.logits.numpy()[..., : logits.shape[-1]], logits, atol=2e-4)
    with torch.no_grad():
        ids = adapted.generate(
            **encoded, num_beams=1, do_sample=False, max_new_tokens=record.target_length
        )
    assert tokenizer.batch_decode(ids, skip_special_tokens=True) == ours


def test_lora_run_served_as_an_adapter_answers_as_it_loads(runs, models):
    """--adapter over the base: the adapter's own run shapes its inputs and decodes them, at its
    own lengths (32 and 8 tokens, the base's are 96 and 4), as t5tpu.load of the LoRA run does."""
    ours = models.lora.predict([*TEXT_LINES, ""])
    assert runs.servers["quora"].predict([*TEXT_LINES, ""], adapter="lora") == ours
