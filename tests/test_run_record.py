"""The run record (storage/run_record.py): what a training run saves with each checkpoint about
its model's inputs and outputs, read back by the loader, carried in a Hugging Face export's own
fields; and the server's imports done before its threads start."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
from cli_runs import ROOT

from t5tpu.errors import UserError
from t5tpu.formats import hf_run_record, loader
from t5tpu.model.decoding_settings import DecodingSettings
from t5tpu.storage import run_record
from t5tpu.storage.run_record import InputShaping, RunRecord

PREFIXED = RunRecord(
    task="text_to_text",
    tasks=("text_to_text",),
    input_length=32,
    target_length=8,
    shaping=InputShaping(run_record.PREFIX, prefix="first word: "),
    decoding=DecodingSettings(num_beams=1, temperature=0.0, top_k=0, beam_alpha=0.6, seed=0),
)


def test_a_record_reads_back_as_written_and_a_damaged_one_is_one_line():
    assert RunRecord.from_record(PREFIXED.record(), "here") == PREFIXED
    assert RunRecord.from_metadata({"input_start_step": 0}, "here") is None
    for damaged in (
        {},
        {"lengths": {"inputs": 0, "targets": 8}},
        {**PREFIXED.record(), "shaping": {"kind": "upper"}},
    ):
        with pytest.raises(UserError, match="^here: the run record is not the one t5tpu writes"):
            RunRecord.from_record(damaged, "here")


@pytest.mark.slow  # needs the trained_tiny run
def test_a_training_run_saves_its_record_with_each_checkpoint(trained_tiny):
    record = loader.open_checkpoint(str(trained_tiny)).run_record()
    assert record == RunRecord(
        task="qp_is_duplicate",
        tasks=("qp_is_duplicate",),
        input_length=96,
        target_length=4,
        shaping=InputShaping(run_record.QUORA, normalize=True),
        decoding=DecodingSettings(),
    )


def test_the_hf_fields_carry_the_record_and_read_back():
    config = hf_run_record.config_fields(PREFIXED)
    assert config["prefix"] == "first word: "
    greedy = {"max_new_tokens": 8, "num_beams": 1, "do_sample": False}
    assert config["task_specific_params"] == {"text2text-generation": greedy}
    assert hf_run_record.generation_config(PREFIXED) == {
        "decoder_start_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 0,
        **greedy,
    }
    assert hf_run_record.model_max_length(PREFIXED) == 32
    assert hf_run_record.record_from_files(config, {}, {}, where="config.json") == PREFIXED
    # A directory transformers wrote: its prefix, max_new_tokens and model_max_length.
    theirs = hf_run_record.record_from_files(
        {"prefix": "summarize: "}, {"max_new_tokens": 60}, {"model_max_length": 512}, where="x"
    )
    assert (theirs.input_length, theirs.target_length, theirs.shaping.prefix) == (
        512,
        60,
        "summarize: ",
    )
    assert hf_run_record.record_from_files({}, {}, {"model_max_length": 512}, where="x") is None
    sampled = RunRecord("t", ("t",), 8, 4, decoding=DecodingSettings(temperature=0.7, top_k=40))
    assert hf_run_record.generation_config(sampled)["do_sample"] is True
    quora_notes = hf_run_record.notes(RunRecord("q", ("q",), 8, 4, InputShaping(run_record.QUORA)))
    assert len(quora_notes) == 1 and "lower-case inputs" in quora_notes[0]


# Eight threads, each reading the tasks' routes and building every prompt while others compile:
# what the server's warm-up did at once (a LazyModule met half-imported once killed a server).
_RACE = """
import sys, threading, jax, jax.numpy as jnp
from t5tpu.serve.task_calls import TaskRoutes
barrier, errors = threading.Barrier(8), []
def work(i):
    try:
        barrier.wait()
        if i % 2:
            jax.jit(lambda x: x * i + 1).lower(jnp.ones((4, 4))).compile()
        else:
            TaskRoutes().warm_up()
    except Exception as e:
        errors.append(repr(e))
threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
[t.start() for t in threads]; [t.join(120) for t in threads]
print(json.dumps({"errors": errors, "tensorflow": "tensorflow" in sys.modules}))
"""


def test_the_servers_prompts_warm_up_in_many_threads_without_tensorflow():
    """The tasks' prompts are plain Python (no TensorFlow to import beside XLA's compiling);
    the server reads them before it compiles (serve/server.py)."""
    script = "import json\n" + textwrap.dedent(_RACE)
    run = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert json.loads(run.stdout.splitlines()[-1]) == {"errors": [], "tensorflow": False}
