"""`t5tpu serve --adapter`: LoRA adapters served over one base, chosen per request.

One short LoRA run on conftest's trained_tiny (its base), saving twice: its two checkpoints are
served as the adapters "early" and "late" beside the base, by one server in this process (no
warm-up). Each adapter answers as `t5tpu.load` of its checkpoint does and a request naming none
as the base does, on /v1/predict and /v1/score; the base's parameters are held once, every
adapter's tree referencing the same arrays; an unknown adapter is a 400 naming those served;
rows of different adapters never share a group (so a batch); an adapter of another base, a full
checkpoint given as an adapter and a name given twice are refused before anything is loaded (by
the command: one line, exit 2).
"""

from __future__ import annotations

import functools
import http.client
import json
import os
import re
import shutil
import threading
import time

import jax
import module_walk
import numpy as np
import pytest
from cli_runs import TINY_EXPERIMENT, succeeded, t5tpu

import t5tpu as api
from t5tpu.errors import UserError
from t5tpu.model import lora
from t5tpu.model.decoding_settings import DecodingSettings
from t5tpu.serve import app, batcher, model_setup, model_worker, server

pytestmark = pytest.mark.slow

LENGTHS = (96, 4)
INPUTS = [
    "is duplicate: how do i learn python quickly? <SEP> what is the fastest way to learn python?",
    "is duplicate: what is the capital of india? <SEP> how do i lose weight fast?",
    "generate similar question: how do i cook rice?",
    "hello",
]
TARGETS = ["duplicate", "not_duplicate", "how do i make rice?", "hello"]
# A few LoRA steps at a high rate, saved after 2 and 4: two adapters that differ from each other
# and from the base. Plain Adafactor steps, as tests/test_lora.py explains.
LORA_FLAGS = [
    "--gin.FINETUNE_METHOD='lora'",
    "--gin.train.relative_steps=True",
    "--gin.adafactor.multiply_by_parameter_scale=False",
    "--gin.TRAIN_STEPS=4",
    "--gin.SAVE_PERIOD=2",
    "--gin.BATCH_SIZE=8",
    "--gin.EVAL_PERIOD=0",
    "--gin.lora.rank=4",
    "--gin.lora.targets=('q', 'v', 'wo')",
]


@pytest.fixture(scope="module")
def runs(trained_tiny, tmp_path_factory) -> dict[str | None, str]:
    """The checkpoint each adapter name stands for (None: the base)."""
    base = str(trained_tiny / "checkpoint_2")
    model_dir = str(tmp_path_factory.mktemp("lora"))
    flags = [*LORA_FLAGS, f"--gin.INITIAL_CHECKPOINT_PATH='{base}'"]
    succeeded(t5tpu("train", f"--gin_file={TINY_EXPERIMENT}", *flags, model_dir=model_dir))
    saved = sorted(
        (name for name in os.listdir(model_dir) if name.startswith("checkpoint_")),
        key=lambda name: int(name.split("_")[1]),
    )
    assert len(saved) >= 2, saved
    return {None: base, "early": os.path.join(model_dir, saved[-2]), "late": model_dir}


def _setup(model: str | None, adapters: tuple[str, ...]) -> model_setup.ModelSetup:
    return model_setup.model_setup(
        gin_flags=model_setup.GinFlags(),
        model=model,
        lengths=LENGTHS,
        truncation=None,
        environ={},
        adapters=adapters,
    )


def _request(port: int, method: str, path: str, body=None):
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        data = None if body is None else json.dumps(body).encode()
        connection.request(method, path, body=data, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


@pytest.fixture(scope="module")
def served(runs):
    """(port, the server's ModelWorker): the base with both adapters, served in this process."""
    setup = _setup(runs[None], (f"early={runs['early']}", f"late={runs['late']}"))
    running = server.build(
        options=server.ServerOptions(
            max_connections=16, shutdown_timeout_s=60, warm_up=False, log_requests=False
        ),
        http=app.HttpOptions(
            max_instances=8, max_body_bytes=65536, truncation="warn", max_queue=64
        ),
        batching=batcher.BatchLimits(max_batch_size=4, max_wait_s=0.01, max_queue=64),
        load=functools.partial(model_setup.load_worker, setup, max_batch_size=4, say=print),
    )
    sock = server.bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    thread = threading.Thread(target=running.server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 300
    while running.service.worker is None and running.worker.error is None:
        assert time.monotonic() < deadline, "the server did not get ready"
        time.sleep(0.1)
    assert running.worker.error is None, running.worker.error
    yield port, running.service.worker
    running.server.should_exit = True
    thread.join(timeout=60)


def _parameters(name: str | None) -> dict:
    return {} if name is None else {"adapter": name}


def test_each_adapter_answers_as_its_run_and_no_adapter_as_the_base(served, runs):
    port, _ = served
    pairs = [{"input": i, "target": t} for i, t in zip(INPUTS, TARGETS, strict=True)]
    scores = {}
    for name, path in runs.items():
        model = api.load(path, batch_size=4, max_input_length=LENGTHS[0], max_target_length=4)
        status, body = _request(
            port, "POST", "/v1/predict", {"instances": INPUTS, "parameters": _parameters(name)}
        )
        assert status == 200, body
        assert body["predictions"] == model.predict(INPUTS), name
        status, body = _request(
            port, "POST", "/v1/score", {"instances": pairs, "parameters": _parameters(name)}
        )
        assert status == 200, body
        scores[name] = np.array([row["score"] for row in body["predictions"]])
        np.testing.assert_allclose(scores[name], model.score(INPUTS, TARGETS), atol=1e-4)
    # Each request ran with its own adapter: the three score the same pairs apart.
    for one, other in ((None, "early"), (None, "late"), ("early", "late")):
        assert np.abs(scores[one] - scores[other]).max() > 1e-3, (one, other, scores)


def test_the_base_and_every_adapter_share_one_set_of_programs(served):
    port, worker = served
    counts = []
    for name in (None, "early", "late", None):
        body = {"instances": INPUTS, "parameters": _parameters(name)}
        assert _request(port, "POST", "/v1/predict", body)[0] == 200
        counts.append(worker.program_count)
    # The first request compiled what its rows needed; the others, of other adapters, nothing.
    assert counts[0] > 0 and len(set(counts)) == 1, counts
    assert worker.engine is worker.adapters.engine


def test_the_base_is_held_once_every_adapter_referencing_its_arrays(served):
    _, worker = served
    base = jax.tree_util.tree_leaves(lora.split(worker.adapters.params[None]["params"])[0])
    held = {id(x): x.nbytes for x in base}
    adapter_bytes = 0
    for name in (None, "early", "late"):  # the base runs as an adapter of zeros
        own_base, adapters = lora.split(worker.adapters.params[name]["params"])
        leaves = jax.tree_util.tree_leaves(own_base)
        assert len(leaves) == len(base) and all(a is b for a, b in zip(leaves, base, strict=True))
        adapter_leaves = jax.tree_util.tree_leaves(adapters)
        assert adapter_leaves  # lora_a and lora_b of q, v and wo
        adapter_bytes += sum(x.nbytes for x in adapter_leaves)
        held.update((id(x), x.nbytes) for x in adapter_leaves)
    base_bytes = sum(x.nbytes for x in base)
    assert sum(held.values()) == base_bytes + adapter_bytes
    assert adapter_bytes < 0.1 * base_bytes, (adapter_bytes, base_bytes)
    # The adapters' engine decodes with an adapter's tree itself, not a copy of it.
    assert worker.adapters.engine_for("late").params is worker.adapters.params["late"]


def test_health_lists_the_adapters_and_an_unknown_one_is_a_400(served):
    port, _ = served
    assert _request(port, "GET", "/health") == (
        200,
        {"status": "ready", "adapters": ["early", "late"]},
    )
    for path, instance in (("/v1/predict", "hello"), ("/v1/score", {"input": "a", "target": "b"})):
        status, body = _request(
            port, "POST", path, {"instances": [instance], "parameters": {"adapter": "mid"}}
        )
        assert status == 400
        assert body["error"] == (
            'parameter adapter="mid" is not an adapter this server has; choose one of early, '
            "late, or leave it out for the base model"
        )


def test_rows_of_different_adapters_never_share_a_group():
    settings = DecodingSettings(max_new_tokens=4)
    groups = {
        model_worker.Group.for_decoding(settings, 16, adapter) for adapter in (None, "a", "b")
    }
    groups |= {model_worker.Group.for_scoring(16, adapter) for adapter in (None, "a", "b")}
    assert len(groups) == 6


def test_an_adapter_of_another_base_is_refused_before_anything_loads(runs, tmp_path):
    other = str(tmp_path / "checkpoint_2")
    shutil.copytree(runs[None], other)
    data = sorted(os.path.join(d, n) for d, _, names in os.walk(other) for n in names)[-1]
    with open(data, "ab") as f:
        f.write(b"retrained")
    with pytest.raises(UserError, match=re.escape(f"late was trained on the base {runs[None]}, ")):
        _setup(other, (f"late={runs['late']}",))
    run = t5tpu("serve", f"--model={other}", f"--adapter=late={runs['late']}", "--port=0")
    last_line = run.stderr.strip().splitlines()[-1]
    assert run.returncode == 2
    assert last_line.startswith("t5tpu: error: --adapter late was trained on the base"), last_line
    with pytest.raises(UserError, match="is a full model's checkpoint, not a LoRA run's"):
        _setup(runs[None], (f"full={runs[None]}",))
    with pytest.raises(UserError, match="--adapter late is given twice"):
        _setup(runs[None], (f"late={runs['late']}", f"late={runs['early']}"))
    # Without --model the model is the adapters' base.
    assert _setup(None, (f"late={runs['late']}",)).path == runs[None]


def test_serving_an_adapter_walks_down_eight_modules_never_back_up_to_serve(runs):
    """--adapter's set-up, its base and adapter loaded, and a score with it: the checkpoints,
    records, fingerprints and model gin are read down one path of modules, none turned back to,
    and the engine's programs (the base rounded as trained) call into model/, never back up
    into serve/ (tests/module_walk.py)."""

    def serve():
        setup = _setup(runs[None], (f"late={runs['late']}",))
        worker = model_setup.load_worker(setup, max_batch_size=4, say=lambda line: None)
        worker.adapters.engine_for("late").score([[5, 6, 1]], [[7, 1]])

    serve()  # imports and first calls outside the walk
    walk = module_walk.traced(serve, os.path.commonpath([runs[None], runs["late"]]))
    assert walk.turns_back() == []
    assert walk.climbs("model/", "serve/") == []
    assert walk.modules_to_the_files(module_walk.PLUMBING) == [
        "serve/model_setup.py",
        "serve/lora_adapters.py",
        "formats/loader.py",
        "storage/checkpoints.py",
        "storage/lora_checkpoints.py",
        "storage/lora_base_fingerprint.py",
        "api/loading.py",
        "config/checkpoint_gin.py",
    ]
