"""`t5tpu infer` on a long file: chunks that survive kill -9 and SIGTERM, shards that split the
work, a changed input that starts afresh; every way of getting there writes the same bytes as
one uninterrupted run. The pieces (which inputs a run decodes, the chunk folder) are tested
in-process first."""

from __future__ import annotations

import csv
import hashlib
import os
import pathlib
import shutil
import signal
import time

import fault_mounts
import pytest
from cli_runs import (
    ROOT,
    TINY_EXPERIMENT,
    TRAINED_TINY_STEPS,
    cli_command,
    free_port,
    run_together,
    start,
    succeeded,
    t5tpu,
)

from t5tpu.runners import infer_chunks
from t5tpu.runners.infer_chunks import Assignment, ChunkStore, Span

STEPS = TRAINED_TINY_STEPS
CHUNK = 32
LINES = 300  # ten chunks of 32 and one of 12


# --- which inputs a run decodes --------------------------------------------------------------


def _spans(total, assignment, done=()):
    pieces = infer_chunks.pieces(iter(range(total)), assignment=assignment, done=list(done))
    return [(span.start, span.end, records) for span, records in pieces]


def test_pieces_are_whole_chunks_in_input_order():
    assert _spans(10, Assignment(chunk_size=4)) == [
        (0, 4, [0, 1, 2, 3]),
        (4, 8, [4, 5, 6, 7]),
        (8, 10, [8, 9]),
    ]


def test_each_shard_takes_every_other_chunk_and_skips_the_done_ones():
    shard0, shard1 = Assignment(4, 0, 2), Assignment(4, 1, 2)
    assert [s[:2] for s in _spans(18, shard0)] == [(0, 4), (8, 12), (16, 18)]
    assert [s[:2] for s in _spans(18, shard1)] == [(4, 8), (12, 16)]
    assert [s[:2] for s in _spans(18, shard0, [Span(8, 12)])] == [(0, 4), (16, 18)]


def _store(tmp_path, **manifest):
    return ChunkStore(str(tmp_path / "out.jsonl"), {"inputs": "abc", **manifest})


def test_chunks_merge_in_order_once_every_input_is_covered(tmp_path):
    store = _store(tmp_path)
    assert store.open(writer=True) == []
    store.write(Span(2, 3), ["c\n"])
    store.write(Span(0, 2), ["a\n", "b\n"])
    assert store.complete() is None  # the number of inputs is not known yet
    store.record_end(4)
    assert store.complete() is None  # input 3 is missing
    store.write(Span(3, 4), ["d\n"])
    store.merge(store.complete())
    assert (tmp_path / "out.jsonl").read_text() == "a\nb\nc\nd\n"
    assert sorted(os.listdir(tmp_path)) == ["out.jsonl"]


def test_chunks_of_other_inputs_are_removed_and_said_once(tmp_path, capsys):
    store = _store(tmp_path)
    store.open(writer=True)
    store.write(Span(0, 2), ["a\n", "b\n"])
    assert _store(tmp_path).open(writer=True) == [Span(0, 2)]
    assert capsys.readouterr().err == ""
    assert _store(tmp_path, step=3).open(writer=True) == []
    assert capsys.readouterr().err.count("starting afresh") == 1
    assert _store(tmp_path, step=3).done() == []


def test_a_half_written_chunk_is_not_a_chunk(tmp_path):
    store = _store(tmp_path)
    store.open(writer=True)
    (store.folder / f".{Span(0, 2).file_name()}.tmp-99").write_text('{"input": "a"')
    assert store.done() == []


# --- the command -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model_dir(trained_tiny):
    """The shared tiny run: these tests write under INFER_OUTPUT_DIR / EVAL_OUTPUT_DIR only."""
    return trained_tiny


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """LINES Quora pairs from the bundled sample, as the task writes them."""
    path = tmp_path_factory.mktemp("inputs") / "pairs.txt"
    with open(os.path.join(ROOT, "t5tpu", "assets", "quora_sample", "train.tsv")) as f:
        rows = list(csv.DictReader(f, delimiter="\t"))[:LINES]
    path.write_text(
        "".join(f"is duplicate: {r['question1']} <SEP> {r['question2']}\n" for r in rows)
    )
    return path


def _flags(model_dir, inputs, out, *extra):
    return [
        f"--gin_file={TINY_EXPERIMENT}",
        f"--gin.MODEL_DIR='{model_dir}'",
        f"--gin.INFER_INPUT_FILE='{inputs}'",
        f"--gin.INFER_OUTPUT_DIR='{out}'",
        f"--gin.INFER_CHUNK_SIZE={CHUNK}",
        "--gin.INFER_BATCH_SIZE=8",
        *extra,
    ]


def _result(out):
    return out / "inference" / f"pairs-{STEPS}.jsonl"


def _digest(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def reference(model_dir, inputs, tmp_path_factory):
    """One uninterrupted run: the bytes every other way must reproduce."""
    out = tmp_path_factory.mktemp("reference")
    run = succeeded(t5tpu("infer", *_flags(model_dir, inputs, out)))
    assert f"wrote {LINES} predictions to {_result(out)}" in run.stdout
    assert not (out / "inference" / f"pairs-{STEPS}.jsonl.parts").exists()
    return _result(out).read_bytes()


def _start(model_dir, inputs, out, *extra):
    return start("infer", *_flags(model_dir, inputs, out, *extra))


def _wait_for_chunks(proc, parts, count, timeout=300):
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        if parts.is_dir() and sum(n.endswith(".jsonl") for n in os.listdir(parts)) >= count:
            return
        time.sleep(0.02)
    raise AssertionError(f"no {count} chunks in {parts}: {proc.communicate()[1][-2000:]}")


def _signalled_after_two_chunks(model_dir, inputs, out, signum):
    """(the exit code, stdout, stderr) of an infer run sent `signum` once two chunks are saved."""
    proc = _start(model_dir, inputs, out)
    _wait_for_chunks(proc, out / "inference" / f"pairs-{STEPS}.jsonl.parts", 2)
    proc.send_signal(signum)
    stdout, stderr = proc.communicate(timeout=120)
    return proc.returncode, stdout, stderr


def _rerun_decodes_only_the_rest(model_dir, inputs, out, reference, kept: int):
    """A rerun of an interrupted run writes the uninterrupted run's bytes, decoding only what
    the `kept` chunks did not hold."""
    run = succeeded(t5tpu("infer", *_flags(model_dir, inputs, out)))
    assert _result(out).read_bytes() == reference
    assert f"({LINES - CHUNK * kept:,} decoded in" in run.stdout


@pytest.mark.slow
def test_kill_9_between_chunks_then_rerun_gives_the_same_file(
    model_dir, inputs, reference, tmp_path
):
    parts = tmp_path / "inference" / f"pairs-{STEPS}.jsonl.parts"
    proc = _start(model_dir, inputs, tmp_path)
    _wait_for_chunks(proc, parts, 3)
    proc.kill()
    proc.communicate()
    kept = {n: (parts / n).read_bytes() for n in os.listdir(parts) if n.endswith(".jsonl")}
    assert len(kept) >= 3 and not _result(tmp_path).exists()
    _rerun_decodes_only_the_rest(model_dir, inputs, tmp_path, reference, len(kept))


@pytest.mark.slow
def test_kill_9_while_writing_a_chunk_or_merging_then_rerun(model_dir, inputs, reference, tmp_path):
    """The states a kill leaves mid-write (a chunk's temporary file) and mid-merge (every chunk
    and a partial final file), made from a shard's real chunks."""
    shard = ["--gin.INFER_NUM_SHARDS=2", "--gin.INFER_SHARD_ID=0"]
    succeeded(t5tpu("infer", *_flags(model_dir, inputs, tmp_path, *shard)))
    parts = tmp_path / "inference" / f"pairs-{STEPS}.jsonl.parts"
    merged, odd = tmp_path / "merged", tmp_path / "odd"
    shutil.copytree(parts, merged / "inference" / parts.name)  # shard 0's, for the merge below
    one = sorted(n for n in os.listdir(parts) if n.endswith(".jsonl"))[0]
    (parts / f".{one}.tmp-4242").write_bytes((parts / one).read_bytes()[:50])
    succeeded(t5tpu("infer", *_flags(model_dir, inputs, tmp_path)))
    assert _result(tmp_path).read_bytes() == reference

    # Every chunk written (shard 1's run alone, elsewhere, keeps its own), none merged yet.
    shard1 = ["--gin.INFER_NUM_SHARDS=2", "--gin.INFER_SHARD_ID=1"]
    succeeded(t5tpu("infer", *_flags(model_dir, inputs, odd, *shard1)))
    parts = merged / "inference" / f"pairs-{STEPS}.jsonl.parts"
    for chunk in (odd / "inference" / f"pairs-{STEPS}.jsonl.parts").glob("0*.jsonl"):
        (parts / chunk.name).write_bytes(chunk.read_bytes())
    (merged / "inference" / f"pairs-{STEPS}.jsonl.tmp-4242").write_bytes(reference[:100])
    run = succeeded(t5tpu("infer", *_flags(model_dir, inputs, merged)))
    assert "(0 decoded in" in run.stdout
    assert _result(merged).read_bytes() == reference


@pytest.mark.slow
def test_two_shards_write_the_file_of_one_run(model_dir, inputs, reference, tmp_path):
    runs = [
        t5tpu(
            "infer",
            *_flags(
                model_dir,
                inputs,
                tmp_path,
                "--gin.INFER_NUM_SHARDS=2",
                f"--gin.INFER_SHARD_ID={shard}",
            ),
        )
        for shard in (1, 0)
    ]
    assert "wait for the other shards" in succeeded(runs[0]).stdout
    assert f"wrote {LINES} predictions" in succeeded(runs[1]).stdout
    assert _result(tmp_path).read_bytes() == reference


@pytest.mark.slow
def test_in_bfloat16_the_file_is_the_same_whatever_the_chunks_shards_and_batch(
    model_dir, inputs, tmp_path
):
    bf16 = "--gin.T5Config.dtype='bfloat16'"
    whole = tmp_path / "whole"
    succeeded(t5tpu("infer", *_flags(model_dir, inputs, whole, bf16)))
    split = tmp_path / "split"
    for shard in (0, 1):
        succeeded(
            t5tpu(
                "infer",
                *_flags(model_dir, inputs, split, bf16),
                "--gin.INFER_CHUNK_SIZE=50",
                "--gin.INFER_BATCH_SIZE=4",
                "--gin.INFER_NUM_SHARDS=2",
                f"--gin.INFER_SHARD_ID={shard}",
            )
        )
    assert _result(split).read_bytes() == _result(whole).read_bytes()
    assert "T5Config.dtype = 'bfloat16'" in (whole / "infer_config.gin").read_text()


@pytest.mark.slow
def test_sigterm_saves_the_chunks_exits_0_and_a_rerun_continues(
    model_dir, inputs, reference, tmp_path
):
    code, stdout, stderr = _signalled_after_two_chunks(model_dir, inputs, tmp_path, signal.SIGTERM)
    assert code == 0, stderr[-2000:]
    assert "SIGTERM: stopped with" in stdout and not _result(tmp_path).exists()
    succeeded(t5tpu("infer", *_flags(model_dir, inputs, tmp_path)))
    assert _result(tmp_path).read_bytes() == reference


@pytest.mark.slow
def test_ctrl_c_keeps_the_chunks_in_one_line_and_a_rerun_continues(
    model_dir, inputs, reference, tmp_path
):
    code, _, stderr = _signalled_after_two_chunks(model_dir, inputs, tmp_path, signal.SIGINT)
    assert code == 130, stderr[-2000:]
    # Said as for any command, without training's hint about SIGTERM.
    assert stderr.strip().splitlines()[-1] == (
        "t5tpu: interrupted; what was saved is complete, rerun the same command to continue"
    )
    parts = tmp_path / "inference" / f"pairs-{STEPS}.jsonl.parts"
    kept = sum(n.endswith(".jsonl") for n in os.listdir(parts))
    _rerun_decodes_only_the_rest(model_dir, inputs, tmp_path, reference, kept)


@pytest.mark.slow
def test_an_input_changed_between_runs_starts_afresh_said_once(model_dir, inputs, tmp_path):
    changed = tmp_path / "pairs.txt"
    changed.write_text(inputs.read_text())
    shard = ["--gin.INFER_NUM_SHARDS=2", "--gin.INFER_SHARD_ID=0"]
    succeeded(t5tpu("infer", *_flags(model_dir, changed, tmp_path, *shard)))
    changed.write_text(inputs.read_text().replace("is duplicate:", "is duplicate?", 7))
    run = succeeded(t5tpu("infer", *_flags(model_dir, changed, tmp_path)))
    assert run.stderr.count("starting afresh") == 1
    assert f"({LINES:,} decoded in" in run.stdout
    fresh = tmp_path / "fresh"
    succeeded(t5tpu("infer", *_flags(model_dir, changed, fresh)))
    assert _result(tmp_path).read_bytes() == _result(fresh).read_bytes()


@pytest.mark.slow
def test_progress_lines_say_done_total_rate_and_eta(model_dir, inputs, tmp_path):
    env = dict(os.environ, T5TPU_PROGRESS_SECONDS="0")
    run = succeeded(t5tpu("infer", *_flags(model_dir, inputs, tmp_path), env=env))
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith(f"infer step {STEPS}: ")]
    assert lines[0].startswith(f"infer step {STEPS}: {CHUNK}/{LINES} examples (10.7%)")
    assert lines[-1].startswith(f"infer step {STEPS}: {LINES}/{LINES} examples (100.0%)")
    assert all(" examples/s  ETA " in ln for ln in lines)


@pytest.mark.slow
def test_two_processes_of_one_run_write_the_file_of_one(model_dir, inputs, reference, tmp_path):
    """jax.distributed on localhost, 2 fake devices a process: the mesh spans both, each
    decodes its rows of every batch, and process 0 writes the chunks and the file."""
    port = free_port()
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    runs = run_together(
        [
            cli_command(
                "infer",
                f"--coordinator_address=localhost:{port}",
                "--num_processes=2",
                f"--process_id={pid}",
                *_flags(model_dir, inputs, tmp_path),
            )
            for pid in range(2)
        ],
        env=env,
    )
    assert f"wrote {LINES} predictions" in succeeded(runs[0]).stdout
    assert "process 0 writes them" in succeeded(runs[1]).stdout
    assert _result(tmp_path).read_bytes() == reference


@pytest.mark.slow
def test_eval_shows_the_same_progress(model_dir, tmp_path):
    env = dict(os.environ, T5TPU_PROGRESS_SECONDS="0")
    run = succeeded(
        t5tpu(
            "eval",
            f"--gin_file={TINY_EXPERIMENT}",
            f"--gin.MODEL_DIR='{model_dir}'",
            f"--gin.EVAL_OUTPUT_DIR='{tmp_path}'",
            "--gin.EVAL_BATCH_SIZE=35",
            env=env,
        )
    )
    lines = [ln for ln in run.stdout.splitlines() if ln.startswith(f"eval step {STEPS} (decode)")]
    assert [ln.split()[4] for ln in lines] == ["35/105", "70/105", "105/105"]


@pytest.mark.slow
def test_a_full_disk_stops_with_one_line_keeps_the_chunks_and_a_rerun_finishes(
    model_dir, inputs, reference, tmp_path
):
    with fault_mounts.tmpfs(tmp_path / "disk", 4 << 20) as disk:
        out = pathlib.Path(disk) / "out"
        out.mkdir()
        filler = fault_mounts.fill(disk, leave_free_bytes=24 << 10)
        run = t5tpu("infer", *_flags(model_dir, inputs, out))
        lines = [ln for ln in run.stderr.splitlines() if ln.strip()]
        assert run.returncode == 1 and len(lines) == 1, run.stderr[-2000:]
        assert "No space left on device" in lines[0]
        parts = out / "inference" / f"pairs-{STEPS}.jsonl.parts"
        saved = sorted(parts.glob("0*.jsonl"))
        assert saved and not _result(out).exists()
        expected = reference.decode().splitlines(keepends=True)
        for chunk in saved:  # each saved chunk holds exactly its inputs' predictions
            start, end = (int(n) for n in chunk.stem.split("-"))
            assert chunk.read_text() == "".join(expected[start:end])
        os.remove(filler)
        rerun = succeeded(t5tpu("infer", *_flags(model_dir, inputs, out)))
        assert f"({LINES - CHUNK * len(saved):,} decoded in" in rerun.stdout
        assert _result(out).read_bytes() == reference
