"""A fast first answer: the persistent compilation cache (created by a first `t5tpu infer`, used
by the second, skipped with one warning where it cannot be written, identical predictions
either way), the commands that need no TensorFlow not importing it, and the SentencePiece
vocabulary that lets them decode without it giving seqio's ids and text.

Timings are not asserted here; docs/PERFORMANCE.md ("First answer") records them."""

import copy
import json
import os
import pathlib
import subprocess
import sys

import fault_mounts
import pytest
import seqio
from cli_runs import ROOT, TINY_EXPERIMENT, file_digests, quick_training, read_jsonl, succeeded
from cli_runs import t5tpu as run_t5tpu

from t5tpu import compilation_cache
from t5tpu.data import vocab
from t5tpu.data.sentencepiece_vocab import SentencePieceVocabulary

STEPS = 2
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
def model_dir(tmp_path_factory):
    """The tiny Quora experiment trained for two steps: a checkpoint to decode with."""
    path = tmp_path_factory.mktemp("startup_model")
    succeeded(
        run_t5tpu("train", f"--gin_file={TINY_EXPERIMENT}", *quick_training(STEPS), model_dir=path)
    )
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


def _programs(cache) -> dict[str, str]:
    """The cached programs' digests, without the last-use times and the lock that JAX's
    size-limited cache keeps beside them."""
    return {k: v for k, v in file_digests(cache).items() if k.endswith("-cache")}


def test_second_run_loads_every_program_from_the_cache(model_dir, tmp_path):
    cache = tmp_path / "cache"
    first, predictions = _infer(model_dir, str(cache))
    assert [p["input"] for p in predictions] == QUESTIONS
    entries = _programs(cache)
    # The decode and the small programs around it (random keys, restore's helpers) alike.
    assert len(entries) >= 2, sorted(entries)
    second, again = _infer(model_dir, str(cache))
    assert again == predictions
    assert _programs(cache) == entries  # nothing compiled anew: every program was found
    _, without = _infer(model_dir, "off")
    assert without == predictions
    assert _warnings(first) == _warnings(second) == []


def test_cache_under_a_file_is_skipped_with_one_warning(model_dir, tmp_path):
    blocker = tmp_path / "not_a_directory"
    blocker.write_text("")
    run, predictions = _infer(model_dir, str(blocker / "cache"))
    [warning] = _warnings(run)
    assert f"compilation cache {blocker / 'cache'} cannot be written" in warning
    assert "T5TPU_COMPILATION_CACHE" in warning
    assert [p["input"] for p in predictions] == QUESTIONS


def test_read_only_cache_dir_does_not_break_a_run(model_dir, tmp_path):
    (tmp_path / "source").mkdir()
    with fault_mounts.read_only_view(tmp_path / "source", tmp_path / "read_only") as path:
        run, predictions = _infer(model_dir, path)
        assert os.listdir(path) == []
    [warning] = _warnings(run)
    assert "Read-only file system" in warning
    _, without = _infer(model_dir, "off")
    assert predictions == without


EVICTION = """
import json, pathlib, sys
import jax, jax.numpy as jnp
from t5tpu import compilation_cache
compilation_cache.MAX_BYTES = int(sys.argv[1])
cache = pathlib.Path(compilation_cache.enable())
for n in range(1, 13):  # twelve programs, each different and bigger than the last
    jax.jit(lambda x: jnp.sin(x) ** n + jnp.arange(64.0 * n))(1.0).block_until_ready()
    print(json.dumps(sorted(p.name for p in cache.glob("*-cache"))))
"""


def _compile_twelve(cache, limit: int) -> list[set]:
    """Runs EVICTION with the cache at `cache` limited to `limit` bytes: the cached programs'
    names after each of the twelve compiles."""
    env = {**os.environ, compilation_cache.ENV: str(cache)}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    env.pop("JAX_COMPILATION_CACHE_MAX_SIZE", None)
    run = subprocess.run(
        [sys.executable, "-c", EVICTION, str(limit)], env=env, capture_output=True, text=True
    )
    assert run.returncode == 0, run.stderr
    return [set(json.loads(line)) for line in run.stdout.splitlines()]


def test_cache_keeps_under_its_size_dropping_the_oldest(tmp_path):
    unlimited = _compile_twelve(tmp_path / "unlimited", 2**40)
    assert [len(names) for names in unlimited] == list(range(1, 13))
    total = sum(f.stat().st_size for f in (tmp_path / "unlimited").glob("*-cache"))
    limited = _compile_twelve(tmp_path / "limited", total // 3)
    added = [(new - old).pop() for old, new in zip([set()] + limited[:-1], limited, strict=True)]
    kept = limited[-1]
    assert 0 < len(kept) < 12 and added[-1] in kept and added[0] not in kept
    # What was dropped is the oldest: the kept programs are the last ones compiled.
    assert kept == set(added[-len(kept) :])
    assert sum(f.stat().st_size for f in (tmp_path / "limited").glob("*-cache")) <= total // 3


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


def test_infer_of_given_inputs_imports_no_tensorflow(model_dir):
    assert _imported(*_infer_args(model_dir)) == []


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
