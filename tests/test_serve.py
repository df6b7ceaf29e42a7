"""`t5tpu serve`: the HTTP server with dynamic batching.

End to end (marked slow): the command started as a subprocess on a free port of 127.0.0.1 with
the tiny Quora model (conftest's trained_tiny, two steps; read only), once for the module:
/health is 503 then 200; /v1/predict gives what `t5tpu infer` writes for the same inputs,
greedy and sampled; the task routes and /v1/score give what the Python API gives; 64
concurrent clients are all answered correctly, in shared batches; every bad request gets its
4xx with a one-line message and the next good one is answered; SIGTERM drains the requests in
flight and exits 0 (the module's last test). Bad flags and a model that cannot be loaded end
in one line, exit 2.

In process, with a stand-in engine (no jax, quick): the batcher's grouping, a full queue (503
with Retry-After), a failing model (500, the server goes on), a client that leaves while its
rows wait (they are dropped, the others' batch is untouched), /metrics. And the image's
entrypoint's choice between `t5tpu serve` and the command given.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import os
import pathlib
import signal
import socket
import subprocess
import threading
import time
import types

import pytest
from cli_runs import ROOT, TINY_EXPERIMENT, cli_command, free_port, read_jsonl, succeeded, t5tpu
from t5tpu.tasks import quora

from t5tpu.model import engine
from t5tpu.model.decoding_settings import DecodingSettings
from t5tpu.serve import app, batcher, model_worker, server
from t5tpu.storage import run_record

# Inputs of several lengths (so several input buckets), one longer than the tiny experiment's
# 96 input tokens (truncated, with a warning, as `t5tpu infer` truncates it).
INPUTS = [
    "is duplicate: how do i learn python quickly? <SEP> what is the fastest way to learn python?",
    "is duplicate: what is the capital of india? <SEP> how do i lose weight fast?",
    "is duplicate: how can i make money online? <SEP> what are some ways to make money online?",
    "is duplicate: why is the sky blue? <SEP> what makes the sky look blue?",
    "generate similar question: how do i cook rice?",
    "hello",
    "is duplicate: " + " ".join(f"word{i}" for i in range(60)) + " <SEP> a question?",
    "is duplicate: what is jax? <SEP> what is numpy?",
]
LONG_INPUT = 6
# A long shutdown timeout: the SIGTERM test's requests compile new programs on a busy machine.
# Batches of up to 4 rows: still several batch sizes to share and resize between, and a warm-up
# of two thirds of the programs that 8 would compile.
SERVER_FLAGS = [
    "--max_batch_size=4",
    "--max_instances=16",
    "--max_body_bytes=65536",
    "--shutdown_timeout=300",
]
START_TIMEOUT = 300


# --- HTTP, as a client on this machine sees it ------------------------------------------------


def request(port: int, method: str, path: str, body=None, timeout: float = 120):
    """(status, headers, parsed JSON or raw text) of one request on a fresh connection."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = body if isinstance(body, bytes | None) else json.dumps(body).encode()
        connection.request(method, path, body=data, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        raw = response.read()
        kind = response.getheader("Content-Type", "")
        content = json.loads(raw) if kind.startswith("application/json") else raw.decode()
        return response.status, dict(response.getheaders()), content
    finally:
        connection.close()


def predict(port: int, instances, parameters=None, path="/v1/predict"):
    body = {"instances": instances}
    if parameters is not None:
        body["parameters"] = parameters
    status, _, content = request(port, "POST", path, body)
    assert status == 200, content
    return content


def health(port: int) -> int | None:
    try:
        return request(port, "GET", "/health", timeout=5)[0]
    except OSError:
        return None  # not listening yet


# --- the server as a subprocess ---------------------------------------------------------------


class ServerProcess:
    """`t5tpu serve ...` on a free port; its output goes to a file (read with .output())."""

    def __init__(self, *flags: str, log: pathlib.Path):
        self.port = free_port()
        self.log = log
        with open(log, "w") as out:
            self.process = subprocess.Popen(
                cli_command("serve", f"--port={self.port}", *flags),
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        self.health_seen: list[int] = []

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline and self.process.poll() is None:
            status = health(self.port)
            if status is not None and status not in self.health_seen[-1:]:
                self.health_seen.append(status)
            if status == 200:
                return
            time.sleep(0.2)
        raise AssertionError(f"no 200 from /health; the server said:\n{self.output()[-3000:]}")

    def output(self) -> str:
        return self.log.read_text()

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.process.kill()
            return self.process.wait()


@pytest.fixture(scope="module")
def model_dir(trained_tiny):
    return trained_tiny


@pytest.fixture(scope="module")
def served(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "server.log"
    process = ServerProcess(
        f"--gin_file={TINY_EXPERIMENT}", f"--gin.MODEL_DIR='{model_dir}'", *SERVER_FLAGS, log=log
    )
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
def api_model(model_dir):
    """The same checkpoint through the Python API, at the experiment's lengths."""
    from t5tpu import api

    return api.load(str(model_dir), batch_size=4, max_input_length=96, max_target_length=4)


def infer_predictions(model_dir, tmp_path, *flags) -> list[str]:
    """`t5tpu infer` of INPUTS (into tmp_path, the shared MODEL_DIR is only read)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    inputs = tmp_path / "inputs.txt"
    inputs.write_text("\n".join(INPUTS) + "\n")
    output = tmp_path / "out"
    succeeded(
        t5tpu(
            "infer",
            f"--gin_file={TINY_EXPERIMENT}",
            f"--gin.INFER_INPUT_FILE='{inputs}'",
            f"--gin.INFER_OUTPUT_DIR='{output}'",
            *flags,
            model_dir=model_dir,
        )
    )
    (path,) = (output / "inference").glob("*.jsonl")
    return [row["prediction"] for row in read_jsonl(path)]


@pytest.mark.slow
@pytest.mark.smoke
def test_health_is_503_while_loading_then_200(served):
    assert served.health_seen == [503, 200], served.health_seen
    assert "ready in" in served.output()


@pytest.mark.slow
@pytest.mark.smoke
def test_predict_gives_what_infer_writes_greedy(served, model_dir, tmp_path):
    expected = infer_predictions(model_dir, tmp_path)
    answer = predict(served.port, INPUTS)
    assert answer["predictions"] == expected
    (warning,) = answer["warnings"]
    assert warning.startswith(f"instances[{LONG_INPUT}] input has ") and "truncated" in warning
    # One at a time, and as {"input": ...} objects, the same.
    alone = [predict(served.port, [text])["predictions"][0] for text in INPUTS]
    assert alone == expected
    objects = predict(served.port, [{"input": text} for text in INPUTS])["predictions"]
    assert objects == [{"prediction": text} for text in expected]


@pytest.mark.slow
def test_predict_gives_what_infer_writes_sampled_whatever_the_batch_mates(
    served, model_dir, tmp_path
):
    """Each instance samples from fold_in(PRNGKey(seed), its index in the request), the key
    `t5tpu infer` gives the input at that index."""
    expected = infer_predictions(model_dir, tmp_path, "--gin.TEMPERATURE=1.0")
    parameters = {"temperature": 1.0}
    assert predict(served.port, INPUTS, parameters)["predictions"] == expected
    # Sent while other requests of the same settings (and other seeds) fill the batches.
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        others = [
            pool.submit(predict, served.port, INPUTS[::-1], {"temperature": 1.0, "seed": seed})
            for seed in range(6)
        ]
        mine = pool.submit(predict, served.port, INPUTS, parameters)
        assert mine.result()["predictions"] == expected
        assert all(len(o.result()["predictions"]) == len(INPUTS) for o in others)
    seeded = predict(served.port, INPUTS, {"temperature": 1.0, "seed": 5})["predictions"]
    assert seeded == infer_predictions(
        model_dir, tmp_path / "seed5", "--gin.TEMPERATURE=1.0", "--gin.infer.random_seed=5"
    )


@pytest.mark.slow
def test_beam_search_and_max_length_decode_as_the_python_api(served, api_model):
    for parameters in ({"num_beams": 3}, {"max_new_tokens": 2}):
        answer = predict(served.port, INPUTS[:4], parameters)["predictions"]
        assert answer == api_model.predict(INPUTS[:4], **parameters)


@pytest.mark.slow
def test_task_routes_and_score_give_what_the_python_api_gives(served, api_model):
    from t5tpu.tasks import quora, squad

    pairs = [("How do I learn JAX?", "How can I learn JAX?"), ("What is AI?", "Who is Ada?")]
    answer = predict(
        served.port, [{"question1": a, "question2": b} for a, b in pairs], path="/v1/is_duplicate"
    )
    assert answer["predictions"] == [
        {"is_duplicate": quora.is_duplicate(api_model, a, b)} for a, b in pairs
    ]
    # The tiny model is qp_is_duplicate's: the other tasks' routes ask it only when told to.
    insist = {"check_task": False}
    answer = predict(
        served.port, [{"question": "How do I cook rice?"}], insist, path="/v1/similar_question"
    )
    expected = quora.similar_question(api_model, "How do I cook rice?", check_task=False)
    assert answer["predictions"] == [{"similar_question": expected}]
    instance = {"question": "Who wrote it?", "context": "It was written by Ada."}
    for task in ("squad_v1", "squad_v2"):
        answer = predict(served.port, [instance], {"task": task, **insist}, path="/v1/answer")
        expected = squad.answer(api_model, **instance, task=task, check_task=False)
        assert answer["predictions"] == [{"answer": expected}]
    targets = ["1", "0", "how do i boil rice?"]
    inputs = INPUTS[:3]
    answer = predict(
        served.port,
        [{"input": a, "target": b} for a, b in zip(inputs, targets, strict=True)],
        path="/v1/score",
    )
    scores = [row["score"] for row in answer["predictions"]]
    assert scores == pytest.approx(api_model.score(inputs, targets).tolist(), rel=1e-5)


@pytest.mark.slow
def test_64_concurrent_clients_are_all_answered_correctly_in_shared_batches(served):
    alone = {text: predict(served.port, [text])["predictions"] for text in INPUTS}
    before = _batches(served.port)

    def client(number: int) -> list[bool]:
        texts = [INPUTS[(number + i) % len(INPUTS)] for i in range(3)]
        return [predict(served.port, [text])["predictions"] == alone[text] for text in texts]

    lowered = _metric(served.port, "t5tpu_serve_programs_lowered")
    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        answers = list(pool.map(client, range(64)))
    assert all(all(correct) for correct in answers)
    rows, calls = (now - then for now, then in zip(_batches(served.port), before, strict=True))
    assert rows == 64 * 3
    assert calls < rows  # requests that arrived together were decoded together
    # Every program the load needed was compiled before the server said it was ready.
    assert _metric(served.port, "t5tpu_serve_programs_lowered") == lowered


@pytest.mark.slow
def test_the_server_compiles_the_documented_programs_before_it_is_ready(served):
    # docs/SERVING.md: row counts x input buckets x 2 (an insertion and a segment); here
    # --max_batch_size=4 (row counts 1 and 4) and 96 input tokens (buckets 16, 32, 64, 96).
    assert "compiling 16 decoding programs (2 batch sizes)" in served.output()
    assert "16 programs ready" in served.output()


@pytest.mark.slow
def test_new_values_and_lengths_compile_nothing_after_warm_up(served, api_model):
    """Temperatures, top-k, top-p, penalties and lengths within the served one are each row's
    values in the warmed programs: requests of new ones compile nothing (issue 65's item 2),
    and decode as the Python API does."""
    lowered = _metric(served.port, "t5tpu_serve_programs_lowered")
    parameters = [
        *({"temperature": 0.1 + t / 10, "top_k": t, "top_p": 0.5 + t / 20} for t in range(8)),
        *({"max_new_tokens": n} for n in (1, 2, 3)),
        {"repetition_penalty": 1.7, "no_repeat_ngram_size": 1, "min_new_tokens": 2},
    ]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda p: predict(served.port, INPUTS[:3], p), parameters))
    assert all(len(a["predictions"]) == 3 for a in answers)
    assert _metric(served.port, "t5tpu_serve_programs_lowered") == lowered
    for p, a in zip(parameters[8:], answers[8:], strict=True):
        assert a["predictions"] == api_model.predict(INPUTS[:3], **p), p


@pytest.mark.slow
def test_a_new_beam_width_compiles_beside_the_model_thread(served, api_model):
    """Beam search's width is the one setting that needs programs of its own: a request of a
    width not met before waits for them, compiled in a thread of their own, while other
    requests are answered; its length penalty, length and n-best are values that compile
    nothing more, and decode as the Python API does."""
    lowered = _metric(served.port, "t5tpu_serve_programs_lowered")
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        beams = pool.submit(predict, served.port, INPUTS[:1], {"num_beams": 5})
        time.sleep(0.3)
        greedy = predict(served.port, INPUTS[:1])
        assert not beams.done()  # answered while the beam programs compiled
        assert beams.result()["predictions"] == api_model.predict(INPUTS[:1], num_beams=5)
    assert greedy["predictions"] == api_model.predict(INPUTS[:1])
    # Row counts 1 and 4 at the input's bucket: one program each.
    assert _metric(served.port, "t5tpu_serve_programs_lowered") == lowered + 2
    others = [{"beam_alpha": 0.0}, {"length_penalty": 2.0}, {"max_new_tokens": 2}]
    others.append({"num_return_sequences": 2})
    for parameters in others:
        parameters["num_beams"] = 5
        (answer,) = predict(served.port, INPUTS[:1], parameters)["predictions"]
        if isinstance(answer, list):  # the n best, each with its score
            answer = [best["prediction"] for best in answer]
        assert [answer] == api_model.predict(INPUTS[:1], **parameters), parameters
    assert _metric(served.port, "t5tpu_serve_programs_lowered") == lowered + 2


def _metric(port: int, name: str) -> float:
    status, _, text = request(port, "GET", "/metrics")
    assert status == 200
    (value,) = [
        float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")
    ]
    return value


def _batches(port: int) -> tuple[float, float]:
    """(rows decoded, model calls) so far, from /metrics."""
    status, _, text = request(port, "GET", "/metrics")
    assert status == 200
    values = {}
    for line in text.splitlines():
        for name in ("sum", "count"):
            if line.startswith(f't5tpu_serve_batch_rows_{name}{{kind="decode"}}'):
                values[name] = float(line.split()[-1])
    return values["sum"], values["count"]


BAD_REQUESTS = [
    ("POST", "/v1/predict", b"{not json", 400, "not JSON"),
    ("POST", "/v1/predict", b'["a"]', 400, "JSON object"),
    ("POST", "/v1/predict", b"[" * 30000 + b"]" * 30000, 400, "nested too deeply"),
    ("POST", "/v1/predict", {"inputs": ["a"]}, 400, "unknown field 'inputs'"),
    ("POST", "/v1/predict", {"parameters": {}}, 400, '"instances" is missing'),
    ("POST", "/v1/predict", {"instances": "a"}, 400, "must be an array"),
    ("POST", "/v1/predict", {"instances": []}, 400, "empty"),
    ("POST", "/v1/predict", {"instances": ["a"] * 17}, 400, "at most 16"),
    ("POST", "/v1/predict", {"instances": ["a", 3]}, 400, "instances[1] must be a string"),
    ("POST", "/v1/predict", {"instances": [{"text": "a"}]}, 400, "unknown field 'text'"),
    ("POST", "/v1/predict", {"instances": ["a"], "parameters": {"beams": 2}}, 400, "'beams'"),
    ("POST", "/v1/predict", {"instances": ["a"], "parameters": []}, 400, "must be an object"),
    ("POST", "/v1/predict", {"instances": ["a"], "parameters": {"num_beams": 0}}, 400, "num_beams"),
    (
        "POST",
        "/v1/predict",
        {"instances": ["a"], "parameters": {"num_beams": 2, "length_penalty": "1"}},
        400,
        "length_penalty",
    ),
    (
        "POST",
        "/v1/predict",
        {"instances": ["a"], "parameters": {"max_length": 5}},
        400,
        "max_length = 5",
    ),
    ("POST", "/v1/predict", {"instances": ["a"], "parameters": {"top_k": True}}, 400, "top_k"),
    (
        "POST",
        "/v1/predict",
        {"instances": ["a"], "parameters": {"temperature": -1}},
        400,
        "0.0 (greedy)",
    ),
    (
        "POST",
        "/v1/predict",
        {"instances": ["a"], "parameters": {"temperature": 1e-320}},
        400,
        "temperature = 1e-320 must be 0.0 (greedy) or a number from 1e-06 to 1e+06",
    ),
    (
        "POST",
        "/v1/predict",
        {"instances": ["a"], "parameters": {"top_p": 0}},
        400,
        "top_p = 0 must be a number above 0 and at most 1",
    ),
    (
        "POST",
        "/v1/predict",
        {"instances": ["a"], "parameters": {"temperature": "hot"}},
        400,
        "number",
    ),
    (
        "POST",
        "/v1/predict",
        {"instances": ["a"], "parameters": {"repetition_penalty": 0}},
        400,
        "repetition_penalty = 0 must be a number from 0.001 to 1000 (1.0: none)",
    ),
    (
        "POST",
        "/v1/predict",
        {"instances": ["a"], "parameters": {"no_repeat_ngram_size": -1}},
        400,
        "no_repeat_ngram_size",
    ),
    (
        "POST",
        "/v1/predict",
        {"instances": ["a"], "parameters": {"num_beams": 2, "min_new_tokens": 2}},
        400,
        "takes no penalties, so parameter min_new_tokens would be ignored",
    ),
    (
        "POST",
        "/v1/predict",
        {"instances": ["a"], "parameters": {"num_beams": 2, "num_return_sequences": 3}},
        400,
        "num_return_sequences = 3 must be at most parameter num_beams (2)",
    ),
    (
        "POST",
        "/v1/predict",
        {
            "instances": ["a"],
            "parameters": {"num_beams": 2, "num_return_sequences": 2, "stream": True},
        },
        400,
        "parameter stream gives one answer an instance",
    ),
    (
        "POST",
        "/v1/predict",
        {"instances": ["a"], "parameters": {"num_beams": 2, "temperature": 0.5}},
        400,
        "does not sample",
    ),
    ("POST", "/v1/predict", {"instances": ["a" * 70000]}, 413, "larger than 65536 bytes"),
    ("GET", "/v1/predict", None, 405, "Method Not Allowed"),
    ("POST", "/v2/predict", {"instances": ["a"]}, 404, "Not Found"),
    ("POST", "/v1/score", {"instances": [{"input": "a"}]}, 400, 'has no "target"'),
    (
        "POST",
        "/v1/is_duplicate",
        {"instances": [{"question1": "a", "question2": "b"}], "parameters": {"num_beams": 2}},
        400,
        "unknown parameter 'num_beams'; it takes check_task, exact_inputs",
    ),
    ("POST", "/v1/answer", {"instances": [{"question": "a"}]}, 400, 'has no "context"'),
    (
        "POST",
        "/v1/answer",
        {"instances": [{"question": "a", "context": "b"}]},
        400,
        "trained on qp_is_duplicate, not squad_v1",
    ),
    (
        "POST",
        "/v1/answer",
        {"instances": [{"question": "a", "context": "b"}], "parameters": {"task": "squad_v3"}},
        400,
        "squad_v1, squad_v2",
    ),
]


@pytest.mark.slow
@pytest.mark.parametrize("method, path, body, status, message", BAD_REQUESTS)
def test_each_bad_request_gets_its_4xx_and_the_next_good_one_is_answered(
    served, method, path, body, status, message
):
    got, _, content = request(served.port, method, path, body)
    assert got == status, content
    assert message in content["error"] and "\n" not in content["error"], content
    assert len(predict(served.port, ["hello"])["predictions"]) == 1


@pytest.mark.slow
@pytest.mark.smoke
def test_sigterm_finishes_the_requests_in_flight_and_exits_0(served):
    """The module's last test: it stops the shared server."""
    # Settings never used before: their program compiles while the requests wait.
    parameters = {"num_beams": 2, "max_new_tokens": 3}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = [pool.submit(predict, served.port, INPUTS, parameters) for _ in range(8)]
        time.sleep(1.0)
        served.process.send_signal(signal.SIGTERM)
        assert all(len(a.result()["predictions"]) == len(INPUTS) for a in answers)
    assert served.process.wait(timeout=120) == 0
    assert "stopped (SIGTERM)" in served.output()
    assert health(served.port) is None  # no longer listening


# --- the command's refusals --------------------------------------------------------------------


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--max_batch_size=0"], "--max_batch_size = 0 must be a whole number >= 1"),
        (["--port=70000"], "port 70000"),
        (["--max_instances=600"], "more than --max_queue"),
        (["--max_wait_ms=5000"], "--max_wait_ms"),
        (["--no_such_flag"], "unrecognized arguments"),
        (["--header_timeout=0"], "--header_timeout=0.0 must be above 0 seconds"),
        (["--max_header_bytes=0"], "--max_header_bytes = 0 must be a whole number >= 1"),
        (["--api_key_file=/no/such/file"], "cannot read --api_key_file=/no/such/file"),
    ],
)
def test_bad_flags_are_one_line_exit_2_before_anything_loads(flags, message):
    run = t5tpu("serve", *flags, timeout=60)
    assert run.returncode == 2, run.stderr
    (line,) = run.stderr.strip().splitlines()
    assert line.startswith("t5tpu: error: ") and message in line


@pytest.mark.slow
def test_a_missing_model_and_a_taken_port_are_one_line_exit_2(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "AIP_STORAGE_URI"}
    run = t5tpu("serve", f"--port={free_port()}", env=env, timeout=120)
    assert run.returncode == 2 and "no model to serve" in run.stderr
    run = t5tpu("serve", f"--model={tmp_path / 'nowhere'}", timeout=120)
    assert run.returncode == 2 and "does not exist" in run.stderr
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = t5tpu("serve", f"--model={tmp_path}", f"--port={port}", timeout=120)
    assert run.returncode == 2, run.stderr
    (line,) = run.stderr.strip().splitlines()
    assert f"cannot listen on 127.0.0.1:{port}" in line


@pytest.mark.slow
def test_a_model_that_cannot_be_loaded_stops_the_server_with_one_line_exit_2(tmp_path):
    (tmp_path / "empty").mkdir()
    process = ServerProcess(f"--model={tmp_path / 'empty'}", log=tmp_path / "log")
    code = process.process.wait(timeout=START_TIMEOUT)
    assert code == 2, process.output()
    errors = [line for line in process.output().splitlines() if line.startswith("t5tpu: error")]
    assert len(errors) == 1, process.output()


# --- in process, with a stand-in engine --------------------------------------------------------


class StandInEngine:
    """Engine's interface without a model: a word is a token, the prediction is the input
    upper-cased (with the settings' temperature), scores are minus the target's length. A batch
    sets `entered`, waits for `gate` and is recorded; an input 'fail' makes its batch raise."""

    max_input_length = 8
    max_target_length = 4
    vocab_size = 100
    batch_sizes = (1, 2, 4)
    program_count = 0
    programs_needed = 0
    adapter_names = ()

    def __init__(self, record=None):
        self.defaults = DecodingSettings(max_new_tokens=4)
        self.answers_as(record)
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.gate.set()
        self.batches: list[tuple[model_worker.Group, list]] = []
        self.words: dict[str, int] = {}
        self._words_lock = threading.Lock()  # requests are tokenized in several threads
        self.vocabulary = types.SimpleNamespace(decode=self._decode)
        self.left: list[str] = []  # streamed rows whose clients went away mid-way

    def ready(self, group, wake) -> bool:
        return True  # nothing to compile

    def row_settings(self, wanted: DecodingSettings):
        """A request's own values, as ModelWorker.row_settings gives them."""
        return wanted if wanted.samples or wanted.penalizes else None

    def answers_as(self, record) -> None:
        """Answers as a run of `record` (None: one that records none), as a loaded model's."""
        answering = model_worker.Answering(record, self.max_input_length, self.defaults)
        self.runs = model_worker.Runs({None: answering})

    def encode(self, text: str, limit: int) -> engine.Encoded:
        with self._words_lock:
            ids = [self.words.setdefault(word, len(self.words) + 2) for word in text.split()]
        return engine.Encoded(ids=(*ids[: limit - 1], 1), tokens=len(ids) + 1)

    def input_bucket(self, ids) -> int:
        return self.max_input_length

    def warm_up(self, *, stopping) -> int:
        return 0

    def _decode(self, ids) -> str:
        names = {i: w for w, i in self.words.items()}
        return " ".join(names[i].upper() for i in ids if i > 1)

    def run_group(self, group: model_worker.Group, feed: batcher.GroupFeed) -> None:
        taken = feed.take(self.batch_sizes[-1])
        self.entered.set()
        self.gate.wait(timeout=60)
        rows = [row.item for row in taken]
        self.batches.append((group, rows))
        for row, result in zip(taken, self._results(group, rows), strict=True):
            listener = row.item.tag if group.streams else None
            if listener is not None:
                if not self._streamed(row.item, listener):
                    feed.answer(row, None)
                    continue
                listener.finish(result, "stop")
            feed.answer(row, result)

    def _streamed(self, row: engine.Row, listener) -> bool:
        """Hands out a streamed row's first word; "slow" rows then decode on until their
        client leaves (False, as the engine frees such a row) or 20 s pass."""
        listener.progress(row.ids[:1])
        if self._decode(row.ids) != "SLOW":
            return True
        deadline = time.monotonic() + 20
        while not listener.left and time.monotonic() < deadline:
            listener.progress(row.ids)
            time.sleep(0.02)
        if listener.left:
            self.left.append("slow")
        return not listener.left

    def _results(self, group: model_worker.Group, rows: list) -> list:
        names = {i: w for w, i in self.words.items()}
        if group.kind == "score":
            return [-float(len(row.target_ids)) for row in rows]
        texts = [" ".join(names[i] for i in row.ids[:-1]) for row in rows]
        if "fail" in texts:
            raise ValueError("the stand-in model failed\non two lines")
        temperatures = [
            row.settings.temperature if row.settings else group.decoding.temperature for row in rows
        ]
        return [f"{text.upper()} t={t}" for text, t in zip(texts, temperatures, strict=True)]


# The routes Vertex AI names in AIP_PREDICT_ROUTE and AIP_HEALTH_ROUTE when a model sets none.
VERTEX_PREDICT = "/v1/endpoints/123/deployedModels/456:predict"
VERTEX_HEALTH = "/v1/endpoints/123/deployedModels/456"


@pytest.fixture
def stand_in():
    """A server with the stand-in engine, in this process: (port, engine, running)."""
    fake = StandInEngine()
    # No warm-up of programs (the stand-in has none); the tasks' routes are read all the same.
    running = server.build(
        options=server.ServerOptions(
            max_connections=64, shutdown_timeout_s=10, warm_up=False, log_requests=False
        ),
        http=app.HttpOptions(
            max_instances=8,
            max_body_bytes=4096,
            truncation="warn",
            max_queue=8,
            predict_routes=("/v1/predict", VERTEX_PREDICT),
            health_routes=("/health", VERTEX_HEALTH),
        ),
        batching=batcher.BatchLimits(max_batch_size=4, max_wait_s=0.05, max_queue=8),
        load=lambda: fake,
    )
    sock = server.bind("127.0.0.1", 0)
    thread = threading.Thread(target=running.server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    port = sock.getsockname()[1]
    deadline = time.monotonic() + 30
    while health(port) != 200 and time.monotonic() < deadline:
        time.sleep(0.05)
    yield port, fake, running
    fake.gate.set()
    running.server.should_exit = True
    thread.join(timeout=30)
    assert not thread.is_alive()


def wait_for(condition, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def hold_the_worker(pool, port: int, fake: StandInEngine):
    """A request whose batch holds the worker (until fake.gate opens) while others queue."""
    fake.gate.clear()
    fake.entered.clear()
    first = pool.submit(predict, port, ["warm"])
    wait_for(fake.entered.is_set)
    return first


def test_requests_that_arrive_together_share_a_batch_when_one_program_decodes_them(stand_in):
    """Greedy and sampling rows batch together, whatever their temperature, top_k, top_p or
    penalties: each row's own values go with it, into its slot, and one program decodes them."""
    port, fake, running = stand_in
    temperatures = (0.5, 0.7, 0.9)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        first = hold_the_worker(pool, port, fake)
        hot = [
            pool.submit(predict, port, [f"a{i}"], {"temperature": t, "top_p": 0.9})
            for i, t in enumerate(temperatures)
        ]
        penalized = ({}, {"repetition_penalty": 1.3}, {"no_repeat_ngram_size": 2})
        cold = [pool.submit(predict, port, [f"b{i}"], p) for i, p in enumerate(penalized)]
        wait_for(lambda: running.service.batcher.depth == 6)
        fake.gate.set()
        assert first.result()["predictions"] == ["WARM t=0.0"]
        assert [f.result()["predictions"] for f in hot] == [
            [f"A{i} t={t}"] for i, t in enumerate(temperatures)
        ]
        assert [f.result()["predictions"] for f in cold] == [[f"B{i} t=0.0"] for i in range(3)]
    groups = {group for group, _ in fake.batches}
    assert len(groups) == 1 and [len(rows) for _, rows in fake.batches[1:]] == [4, 2]
    rows = [row for _, batch in fake.batches[1:] for row in batch]
    sampled = [row for row in rows if row.settings and row.settings.temperature]
    assert sorted(row.settings.temperature for row in sampled) == list(temperatures)
    assert {row.settings.top_p for row in sampled} == {0.9}
    own = [row.settings for row in rows if row not in sampled]
    assert own.count(None) == 1  # a plain greedy row carries nothing
    penalties = sorted((s.repetition_penalty, s.no_repeat_ngram_size) for s in own if s)
    assert penalties == [(1.0, 2), (1.3, 0)]


def _events(port: int, instances: list, parameters: dict, *, leave_after: int | None = None):
    """The server-sent events of a streamed predict, read as they come; with `leave_after`,
    the connection is closed once that many have come."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    body = {"instances": instances, "parameters": {**parameters, "stream": True}}
    try:
        connection.request("POST", "/v1/predict", json.dumps(body).encode())
        response = connection.getresponse()
        assert response.status == 200 and response.getheader("Content-Type").startswith(
            "text/event-stream"
        )
        events = []
        for line in response:
            if line.startswith(b"data: "):
                data = line[len(b"data: ") :].strip()
                events.append(data.decode() if data == b"[DONE]" else json.loads(data))
                if len(events) == leave_after:
                    break
        return events
    finally:
        connection.close()


def test_a_stream_sends_each_answer_as_it_grows_and_a_client_that_leaves_frees_its_row(stand_in):
    """ "stream": true answers in server-sent events whose texts join to the answers; a client
    that closes the connection mid-way has its row taken out (the stand-in decodes "slow"
    until then), /metrics counts both streams, and the server answers on."""
    port, fake, _ = stand_in
    events = _events(port, ["a b", "c d e"], {"temperature": 0.5})
    assert events[-1] == "[DONE]"
    joined = ["", ""]
    for event in events[:-1]:
        joined[event["index"]] += event["text"]
    last = [event for event in events[:-1] if "prediction" in event]
    assert sorted(e["index"] for e in last) == [0, 1]
    assert (
        joined
        == ["A B t=0.5", "C D E t=0.5"]
        == [e["prediction"] for e in sorted(last, key=lambda e: e["index"])]
    )
    assert len(events) > 3  # first words before the answers: pieces, not one block
    assert _events(port, ["slow"], {}, leave_after=1) == [{"index": 0, "text": "SLOW"}]
    wait_for(lambda: fake.left == ["slow"], timeout=10)
    wait_for(lambda: _metric(port, "t5tpu_serve_streams_open") == 0, timeout=10)
    text = request(port, "GET", "/metrics")[2]
    assert 't5tpu_serve_streams_total{outcome="completed"} 1.0' in text
    assert 't5tpu_serve_streams_total{outcome="disconnected"} 1.0' in text
    assert predict(port, ["after"])["predictions"] == ["AFTER t=0.0"]
    status, _, content = request(
        port, "POST", "/v1/predict", {"instances": ["a"], "parameters": {"stream": 1}}
    )
    assert status == 400 and "stream = 1 must be true or false" in content["error"]


def test_a_full_queue_answers_503_with_retry_after_and_the_queued_are_answered(stand_in):
    port, fake, running = stand_in
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        first = hold_the_worker(pool, port, fake)
        queued = pool.submit(predict, port, [f"q{i}" for i in range(8)])  # the queue's 8 rows
        wait_for(lambda: running.service.batcher.depth == 8)
        status, headers, content = request(port, "POST", "/v1/predict", {"instances": ["x"]})
        assert status == 503 and headers["retry-after"] == "1"
        assert "busy" in content["error"]
        fake.gate.set()
        assert first.result() and len(queued.result()["predictions"]) == 8
    assert predict(port, ["after"])["predictions"] == ["AFTER t=0.0"]


def test_a_failing_model_is_a_500_in_one_line_and_the_server_goes_on(stand_in):
    port, _, _ = stand_in
    status, _, content = request(port, "POST", "/v1/predict", {"instances": ["fail"]})
    assert status == 500
    assert content["error"] == "the model failed: ValueError: the stand-in model failed"
    assert predict(port, ["fine"])["predictions"] == ["FINE t=0.0"]


def test_a_client_that_leaves_has_its_rows_dropped_and_the_others_are_answered(stand_in):
    port, fake, running = stand_in
    gone = 't5tpu_serve_requests_total{route="predict",status="499"} 1.0'
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        first = hold_the_worker(pool, port, fake)
        body = json.dumps({"instances": ["gone1", "gone2"]}).encode()
        leaver = socket.create_connection(("127.0.0.1", port))
        leaver.sendall(
            b"POST /v1/predict HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        stayer = pool.submit(predict, port, ["stay"])
        wait_for(lambda: running.service.batcher.depth == 3)
        leaver.close()
        wait_for(lambda: gone in request(port, "GET", "/metrics")[2])
        fake.gate.set()
        assert first.result() and stayer.result()["predictions"] == ["STAY t=0.0"]
    decoded = [text for _, rows in fake.batches for text in _texts(fake, rows)]
    assert "stay" in decoded and "gone1" not in decoded and "gone2" not in decoded


def _texts(fake: StandInEngine, rows: list) -> list[str]:
    names = {i: w for w, i in fake.words.items()}
    return [" ".join(names[i] for i in row.ids[:-1]) for row in rows]


def test_long_inputs_are_truncated_with_a_warning_and_scores_are_answered(stand_in):
    port, _, _ = stand_in
    answer = predict(port, ["one two three four five six seven eight nine"])
    assert answer["predictions"] == ["ONE TWO THREE FOUR FIVE SIX SEVEN t=0.0"]
    assert answer["warnings"] == [
        "instances[0] input has 10 tokens, above the 8 the model takes: truncated"
    ]
    answer = predict(port, [{"input": "a", "target": "b c"}], path="/v1/score")
    assert answer == {"predictions": [{"score": -3.0}]}


def test_metrics_count_requests_by_route_and_status(stand_in):
    port, _, _ = stand_in
    predict(port, ["x"])
    request(port, "POST", "/v1/predict", b"nope")
    request(port, "GET", "/made/up/path")
    status, headers, text = request(port, "GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    for line in (
        't5tpu_serve_requests_total{route="predict",status="200"} 1.0',
        't5tpu_serve_requests_total{route="predict",status="400"} 1.0',
        't5tpu_serve_requests_total{route="other",status="404"} 1.0',
        "t5tpu_serve_queue_rows 0.0",
        "t5tpu_serve_ready 1.0",
    ):
        assert line in text
    for name in ("request_seconds_bucket", "batch_rows_bucket", "batch_seconds_bucket"):
        assert f"t5tpu_serve_{name}" in text


def test_before_the_model_is_ready_health_and_routes_answer_503():
    gate = threading.Event()

    def load():
        gate.wait(timeout=30)
        return StandInEngine()

    running = server.build(
        options=server.ServerOptions(
            max_connections=8, shutdown_timeout_s=5, warm_up=False, log_requests=False
        ),
        http=app.HttpOptions(max_instances=8, max_body_bytes=4096, truncation="warn", max_queue=8),
        batching=batcher.BatchLimits(max_batch_size=4, max_wait_s=0.0, max_queue=8),
        load=load,
    )
    sock = server.bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    thread = threading.Thread(target=running.server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while health(port) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert health(port) == 503
        status, headers, content = request(port, "POST", "/v1/predict", {"instances": ["a"]})
        assert status == 503 and headers["retry-after"] == "1" and "loading" in content["error"]
        gate.set()
        while health(port) != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert predict(port, ["a"])["predictions"] == ["A t=0.0"]
    finally:
        gate.set()
        running.server.should_exit = True
        thread.join(timeout=30)


def test_inputs_are_shaped_as_the_models_run_trained_and_task_routes_check_its_task(stand_in):
    """The served run's record (a text_to_text run with INPUT_PREFIX) puts the prefix before
    /v1/predict's and /v1/score's inputs, as its training did; "exact_inputs": true takes them
    as they are. A Quora run lower-cases them. A task route asks only a model of its task: a
    400 names the model's, "check_task": false insists."""
    port, fake, _ = stand_in
    summarize = run_record.InputShaping(run_record.PREFIX, prefix="summarize: ")
    fake.answers_as(run_record.RunRecord("my_task", ("my_task",), 8, 4, shaping=summarize))
    assert predict(port, ["the text"])["predictions"] == ["SUMMARIZE: THE TEXT t=0.0"]
    objects = predict(port, [{"input": "the text"}], {"temperature": 0.5})
    assert objects["predictions"] == [{"prediction": "SUMMARIZE: THE TEXT t=0.5"}]
    exact = predict(port, ["the text"], {"exact_inputs": True})
    assert exact["predictions"] == ["THE TEXT t=0.0"]
    scored = predict(port, [{"input": "the text", "target": "a b"}], path="/v1/score")
    assert scored == {"predictions": [{"score": -3.0}]}
    group, rows = fake.batches[-1]
    names = {i: w for w, i in fake.words.items()}
    assert group.kind == "score"
    assert [[names[i] for i in row.input_ids[:-1]] for row in rows] == [
        ["summarize:", "the", "text"]
    ]
    pair = [{"question1": "How?", "question2": "Why?"}]
    status, _, content = request(port, "POST", "/v1/is_duplicate", {"instances": pair})
    assert status == 400 and "trained on my_task, not qp_is_duplicate" in content["error"]
    assert '"check_task": false' in content["error"]
    insisted = predict(port, pair, {"check_task": False}, path="/v1/is_duplicate")
    assert insisted == {"predictions": [{"is_duplicate": False}]}  # "SUMMARIZE: IS ..." is no "1"
    lower = run_record.InputShaping(run_record.QUORA)
    fake.answers_as(run_record.RunRecord("qp_all", quora.tasks_of("qp_all"), 8, 4, shaping=lower))
    predict(port, pair, path="/v1/is_duplicate")
    names = {i: w for w, i in fake.words.items()}
    (row,) = fake.batches[-1][1]
    assert [names[i] for i in row.ids[:-1]] == ["is", "duplicate:", "how?", "<SEP>", "why?"]
    for path, bad in (
        ("/v1/predict", {"exact_inputs": 1}),
        ("/v1/is_duplicate", {"check_task": 0}),
    ):
        body = {"instances": pair if "is_" in path else ["a"], "parameters": bad}
        status, _, content = request(port, "POST", path, body)
        assert status == 400 and "must be true or false" in content["error"], content


@pytest.fixture
def users_routes(monkeypatch):
    """Two routes a user's module adds when it is imported (before the server reads them)."""
    from t5tpu.tasks import serving

    monkeypatch.setattr(serving, "_ADDED", {})
    fields = (serving.Field("word"), serving.Field("times", int, required=False, default=1))
    serving.add_routes(
        serving.Route(
            name="shout",
            task="loud",
            fields=fields,
            prompt=lambda word, times: " ".join([word] * times),
            respond=len,
        ),
        serving.Route(
            name="shout",
            task="louder",
            fields=fields,
            prompt=lambda word, times: " ".join([word, "!"] * times),
            respond=str.lower,
            decoding={"temperature": 0.5},
        ),
    )


def test_routes_a_users_module_adds_are_served_as_declared(users_routes, stand_in):
    """Routes declared with tasks/serving.py (as a MIXTURE_OR_TASK_MODULE adds them): their
    fields checked, the prompt and answer theirs, "task" choosing between two tasks' routes,
    fixed decoding settings taking no parameters, /metrics counting them by name."""
    port, fake, _ = stand_in
    answer = predict(port, [{"word": "hey", "times": 2}, {"word": "ho"}], path="/v1/shout")
    assert answer == {"predictions": [{"shout": len("HEY HEY t=0.0")}, {"shout": 8}]}
    answer = predict(port, [{"word": "hey"}], {"task": "louder"}, path="/v1/shout")
    assert answer == {"predictions": [{"shout": "hey ! t=0.5"}]}
    for body, status, message in [
        ({"instances": [{"times": 2}]}, 400, 'instances[0] has no "word"'),
        ({"instances": [{"word": "a", "times": "2"}]}, 400, "times must be a whole number"),
        ({"instances": [{"word": "a"}], "parameters": {"task": "quiet"}}, 400, "loud, louder"),
        ({"instances": ["a"]}, 400, 'must be an object {"word": ..., "times": ...}'),
    ]:
        got, _, content = request(port, "POST", "/v1/shout", body)
        assert (got, message in content["error"]) == (status, True), content
    body = {"instances": ["a"], "parameters": {"task": "loud"}}
    got, _, content = request(port, "POST", "/v1/predict", body)
    assert got == 400 and "no task here formats /v1/predict's input" in content["error"]
    got, _, content = request(port, "POST", "/v1/whisper", {"instances": [{"word": "a"}]})
    assert got == 404 and "/v1/shout" in content["error"] and "/v1/whisper" in content["error"]
    text = request(port, "GET", "/metrics")[2]
    assert 't5tpu_serve_requests_total{route="shout",status="200"} 2.0' in text
    assert 't5tpu_serve_requests_total{route="shout",status="400"} 4.0' in text


def test_vertex_ai_routes_answer_as_predict_and_health(stand_in):
    port, _, _ = stand_in
    answer = predict(port, ["vertex"], path=VERTEX_PREDICT)
    assert answer["predictions"] == ["VERTEX t=0.0"]
    assert request(port, "GET", VERTEX_HEALTH)[:1] == (200,)


def test_the_port_and_routes_come_from_vertex_ai_variables():
    from t5tpu.cli import serve as serve_command

    environ = {
        "AIP_HTTP_PORT": "7080",
        "AIP_PREDICT_ROUTE": VERTEX_PREDICT,
        "AIP_HEALTH_ROUTE": VERTEX_HEALTH,
    }
    args = serve_command.parse_args([], environ=environ)
    assert args.port == 7080 and args.host == "127.0.0.1"
    assert set(args.predict_routes) == {"/v1/predict", VERTEX_PREDICT}
    assert set(args.health_routes) == {"/health", VERTEX_HEALTH}
    assert serve_command.parse_args(["--port=9000"], environ=environ).port == 9000
    assert serve_command.parse_args([], environ={}).port == 8080


def test_batch_sizes_and_input_buckets():
    assert engine.slot_counts(32, 1) == (2, 8, 32)
    assert engine.slot_counts(8, 4) == (4, 8)
    assert engine.input_buckets(96) == (16, 32, 64, 96)
    assert engine.input_buckets(8) == (8,)


# --- the image's entrypoint --------------------------------------------------------------------


@pytest.mark.parametrize(
    "environment, args, runs",
    [
        ({}, [], "--help"),
        ({}, ["train", "--gin_file=x.gin"], "train --gin_file=x.gin"),
        ({"AIP_HTTP_PORT": "8080"}, [], "serve --host=0.0.0.0"),
        ({"AIP_HTTP_PORT": "8080"}, ["--gin_file=x.gin"], "serve --host=0.0.0.0 --gin_file=x.gin"),
        ({"AIP_HTTP_PORT": "8080"}, ["serve", "--port=9"], "serve --port=9"),
    ],
)
def test_the_image_entrypoint_serves_in_a_vertex_prediction_container(
    tmp_path, environment, args, runs
):
    fake = tmp_path / "t5tpu"
    fake.write_text('#!/bin/sh\necho "$@"\n')
    fake.chmod(0o755)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin", **environment}
    run = subprocess.run(
        ["sh", os.path.join(ROOT, "docker-entrypoint.sh"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == runs
