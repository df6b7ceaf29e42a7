"""A fast first answer: the persistent compilation cache (created by a first `t5tpu infer`, used
by the second, skipped with one warning where it cannot be written, identical predictions
either way), the commands that need no TensorFlow not importing it, and the SentencePiece
vocabulary that lets them decode without it giving seqio's ids and text.

Timings are not asserted here (`git log -p docs/PERFORMANCE.md`, "First answer", has them)."""

import copy
import json
import os
import pathlib
import shutil
import subprocess
import sys

import fault_mounts
import pytest
import seqio
from cli_runs import (
    ROOT,
    TINY_EXPERIMENT,
    TRAINED_TINY_STEPS,
    file_digests,
    read_jsonl,
    succeeded,
)
from cli_runs import t5tpu as run_t5tpu

from t5tpu.data import vocab
from t5tpu.data.sentencepiece_vocab import SentencePieceVocabulary
from t5tpu.storage import compilation_cache

STEPS = TRAINED_TINY_STEPS
QUESTIONS = [
    "is duplicate: how do i learn python fast? <SEP> what is the quickest way to learn python?",
    "is duplicate: what is the capital of france? <SEP> how tall is mount everest?",
]
HEAVY = ("tensorflow", "seqio", "rouge_score")
# Runs `t5tpu ARGS` in-process and, as it exits, prints which of the heavy modules it imported.
IMPORTS_SCRIPT = """
import atexit, json, os, sys
heavy = sys.argv[1].split(",")
atexit.register(lambda: os.write(1, ("imported: " + json.dumps(
    sorted(m for m in heavy if m in sys.modules)) + "\\n").encode()))
sys.argv = ["t5tpu", *sys.argv[2:]]
from t5tpu.cli import main
main.run()
"""


@pytest.fixture(scope="module")
def model_dir(trained_tiny, tmp_path_factory):
    """A copy of the shared tiny run (these tests write predictions into its MODEL_DIR)."""
    path = tmp_path_factory.mktemp("startup_model") / "model"
    shutil.copytree(trained_tiny, path)
    return path


def _infer_args(model_dir) -> list[str]:
    return [
        "infer",
        f"--gin_file={TINY_EXPERIMENT}",
        f"--gin.MODEL_DIR='{model_dir}'",
        f"--gin.INFER_INPUTS={QUESTIONS!r}",
    ]


def _infer(model_dir, cache: str) -> tuple[subprocess.CompletedProcess, list]:
    """`t5tpu infer` of QUESTIONS with T5TPU_COMPILATION_CACHE=cache: the run and its rows."""
    env = {**os.environ, compilation_cache.ENV: cache}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    run = succeeded(run_t5tpu(*_infer_args(model_dir), env=env))
    return run, read_jsonl(pathlib.Path(model_dir, "inference", f"inputs-{STEPS}.jsonl"))


def _warnings(run) -> list[str]:
    return [line for line in run.stderr.splitlines() if line.startswith("t5tpu: warning:")]


@pytest.mark.slow
def test_second_run_loads_every_program_from_the_cache(model_dir, tmp_path):
    cache = tmp_path / "cache"
    first, predictions = _infer(model_dir, str(cache))
    assert [p["input"] for p in predictions] == QUESTIONS
    entries = file_digests(cache)
    # The engine's decoding programs at least: rows inserted into slots, then decoded.
    for program in ("jit_insert", "jit_segment"):
        assert any(name.startswith(program) for name in entries), sorted(entries)
    second, again = _infer(model_dir, str(cache))
    assert again == predictions
    assert file_digests(cache) == entries  # nothing compiled anew: every program was found
    _, without = _infer(model_dir, "off")
    assert without == predictions
    assert _warnings(first) == _warnings(second) == []


@pytest.mark.slow
def test_cache_under_a_file_is_skipped_with_one_warning(model_dir, tmp_path):
    blocker = tmp_path / "not_a_directory"
    blocker.write_text("")
    run, predictions = _infer(model_dir, str(blocker / "cache"))
    [warning] = _warnings(run)
    assert f"compilation cache {blocker / 'cache'} cannot be written" in warning
    assert "T5TPU_COMPILATION_CACHE" in warning
    assert [p["input"] for p in predictions] == QUESTIONS


@pytest.mark.slow
def test_read_only_cache_dir_does_not_break_a_run(model_dir, tmp_path):
    (tmp_path / "source").mkdir()
    with fault_mounts.read_only_view(tmp_path / "source", tmp_path / "read_only") as path:
        run, predictions = _infer(model_dir, path)
        assert os.listdir(path) == []
    [warning] = _warnings(run)
    assert "Read-only file system" in warning
    _, without = _infer(model_dir, "off")
    assert predictions == without


def _aged_files(folder, count: int, size: int) -> list:
    """`count` files of `size` bytes in `folder`, last used an hour apart, the first longest ago."""
    folder.mkdir(parents=True, exist_ok=True)
    files = [folder / f"jit_old_{n}-cache" for n in range(count)]
    for n, file in enumerate(files):
        file.write_bytes(b"x" * size)
        os.utime(file, (1_700_000_000 + 3600 * n,) * 2)
    return files


def test_trim_drops_the_least_recently_used_first(tmp_path):
    files = _aged_files(tmp_path, count=6, size=1000)
    assert compilation_cache.trim(str(tmp_path), max_bytes=3500) == 3
    assert [f.exists() for f in files] == [False] * 3 + [True] * 3
    assert compilation_cache.trim(str(tmp_path), max_bytes=3500) == 0


TRIMMED_START = """
import sys
import jax
from t5tpu.storage import compilation_cache
compilation_cache.MAX_BYTES = int(sys.argv[1])
compilation_cache.enable()
jax.jit(lambda x: x * 3)(1.0).block_until_ready()
"""


def test_each_start_trims_the_cache_then_adds_to_it(tmp_path):
    cache = tmp_path / "cache"
    files = _aged_files(cache, count=5, size=1000)
    env = {**os.environ, compilation_cache.ENV: str(cache)}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    run = subprocess.run(
        [sys.executable, "-c", TRIMMED_START, "2500"], env=env, capture_output=True, text=True
    )
    assert run.returncode == 0 and run.stderr == "", run.stderr
    assert [f.exists() for f in files] == [False] * 3 + [True] * 2
    assert [p.name for p in cache.glob("jit__lambda-*-cache")]  # the new program was cached


def test_cache_directory_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv(compilation_cache.ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compilation_cache.directory() == str(tmp_path / "t5tpu" / "jax")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert compilation_cache.directory() == str(tmp_path / "home" / ".cache" / "t5tpu" / "jax")
    monkeypatch.setenv(compilation_cache.ENV, "~/elsewhere")
    assert compilation_cache.directory() == str(tmp_path / "home" / "elsewhere")
    for off in ("off", "OFF", "none", "0"):
        monkeypatch.setenv(compilation_cache.ENV, off)
        assert compilation_cache.directory() is None


def _imported(*args: str) -> list[str]:
    """The heavy modules `t5tpu ARGS` imported, run to its end."""
    run = subprocess.run(
        [sys.executable, "-c", IMPORTS_SCRIPT, ",".join(HEAVY), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    [line] = [line for line in run.stdout.splitlines() if line.startswith("imported: ")]
    return json.loads(line.removeprefix("imported: "))


def test_plan_imports_no_tensorflow():
    assert _imported("plan", f"--gin_file={TINY_EXPERIMENT}") == []


@pytest.mark.slow
def test_infer_of_given_inputs_imports_no_tensorflow(model_dir):
    assert _imported(*_infer_args(model_dir)) == []


API_SCRIPT = """
import json, sys
import t5tpu
[answer] = t5tpu.load(sys.argv[1]).predict([sys.argv[2]])
print(json.dumps(sorted(m for m in sys.argv[3].split(",") if m in sys.modules)))
"""


@pytest.mark.slow
def test_python_load_and_predict_import_no_tensorflow(model_dir):
    run = subprocess.run(
        [sys.executable, "-c", API_SCRIPT, model_dir, QUESTIONS[0], ",".join(HEAVY)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0 and run.stderr == "", run.stderr[-3000:]
    assert json.loads(run.stdout.splitlines()[-1]) == []


@pytest.mark.slow
def test_convert_to_hf_imports_no_tensorflow(model_dir, tmp_path):
    output = tmp_path / "hf"
    assert _imported("convert", "--to=hf", f"--input={model_dir}", f"--output_dir={output}") == []
    assert (output / "model.safetensors").exists() and (output / "spiece.model").exists()


def test_plan_of_a_text_to_text_experiment_imports_no_tensorflow():
    assert _imported("plan", "--gin_file=configs/experiments/summarization_tiny_cpu.gin") == []


TEXTS = [
    "is duplicate: How do I learn Python? <SEP> What's the best way to learn Python?",
    "Ünïcødé, numbers 12345 and <extra_id_0> a sentinel <extra_id_99>",
    "",
]


@pytest.mark.parametrize("extra_ids", [0, 100])
def test_sentencepiece_vocabulary_gives_seqios_ids_and_text(extra_ids):
    path = vocab.bundled_vocabulary_file()
    ours = SentencePieceVocabulary(path, extra_ids)
    theirs = seqio.SentencePieceVocabulary(path, extra_ids)
    for name in ("vocab_size", "eos_id", "unk_id", "pad_id", "extra_ids"):
        assert getattr(ours, name) == getattr(theirs, name), name
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == theirs.encode(text)
        # Decoding stops at the first EOS; ids past the vocabulary read as UNK.
        tail = [theirs.eos_id, 5, 6]
        for decoded in (ids, [*ids, *tail], [*ids, theirs.vocab_size + 3, *tail]):
            assert ours.decode(decoded) == theirs.decode(decoded)
    assert ours.tokenizer.serialized_model_proto() == theirs.sp_model
    # What tasks' pipelines ask beyond that is seqio's own vocabulary's.
    assert ours.encode_tf.__self__ is ours.seqio_vocabulary


def test_sentencepiece_vocabulary_survives_a_deep_copy():
    ours = SentencePieceVocabulary(vocab.bundled_vocabulary_file())
    copied = copy.deepcopy(ours)
    assert copied.encode(TEXTS[0]) == ours.encode(TEXTS[0])
