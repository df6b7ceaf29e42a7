"""Faults of every writer that is not a checkpoint's (storage/atomic_files.py): a full disk (a
small tmpfs), a read-only folder (a read-only bind mount), and a folder where the writer puts a
file (or a file where it makes a folder). Each ends in one line of the right class
(EnvironmentFault, exit 1: the machine; UserError, exit 2: the input), every file there before
is byte-identical, no temporary file is left, and the same write completes once the fault is
gone.

The matrix calls the writers in-process; three tests run the command line end to end (eval to a
full disk, convert to a read-only folder, prepare-quora to a full disk). Checkpoints' faults are
tests/test_faults.py's. The compilation cache never fails a run: its read-only and blocked
cases are tests/test_startup.py's, its full disk is checked here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import pathlib
import shutil
from collections.abc import Callable
from types import SimpleNamespace
from unittest import mock

import fault_mounts
import flax.linen as nn
import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cli_runs import TINY_EXPERIMENT, file_digests, t5tpu
from t5tpu.tasks import quora_csv
from tiny import tiny_config

from t5tpu.config import gin_setup
from t5tpu.data import vocab
from t5tpu.errors import EnvironmentFault, UserError
from t5tpu.formats import conversion, hf_format
from t5tpu.formats.vocabulary_source import VocabularySource
from t5tpu.model.network import Transformer
from t5tpu.runners import evaluator, infer_chunks, prediction_files, results_dir
from t5tpu.storage import compilation_cache, summaries
from t5tpu.storage import model_dir as paths
from t5tpu.storage.writer_lock import WriterLock

# Room for every writer's earlier output (the largest: a converted checkpoint, under 1 MiB).
DISK_BYTES = 8 << 20
FULL = "No space left on device"
# What a writer leaves behind when it fails half-way, unless it cleans up.
LEFTOVERS = (".tmp", "t5tpu-staging")

# --- the writers ---------------------------------------------------------------------------
# Each writes its output into `folder`; `version` 1 is the earlier output, 2 the one that meets
# the fault. Outputs are made large enough that a full disk is met while writing them.

CONFIG = tiny_config(emb_dim=32, num_heads=2, head_dim=16, mlp_dim=64)
BUNDLED = VocabularySource("sentencepiece", vocab.bundled_vocabulary_file(), 0)


@functools.cache
def _params(version: int):
    """The tiny model's parameters, every one `version` (shapes traced, nothing compiled)."""
    tokens = jnp.ones((1, 4), jnp.int32)
    shapes = jax.eval_shape(Transformer(CONFIG).init, jax.random.PRNGKey(0), tokens, tokens)
    return jax.tree_util.tree_map(
        lambda s: np.full(s.shape, version, np.float32), nn.unbox(shapes["params"])
    )


@functools.cache
def _hf_dir(version: int, root: str) -> str:
    """A Hugging Face directory to convert, outside the folders under test."""
    directory = os.path.join(root, f"hf_source_{version}")
    hf_format.export(_params(version), CONFIG, directory, BUNDLED)
    return directory


@functools.cache
def _quora_input(version: int, root: str) -> str:
    """A Quora TSV with pairs in both splits (about one in ten goes to validation)."""
    path = os.path.join(root, f"pairs_{version}.tsv")
    question = "how do I learn " + "python " * 40
    rows = [
        f"{i}\t{2 * i}\t{2 * i + 1}\t{question}{i}?\tversion {version}\t{i % 2}"
        for i in range(1, 81)
    ]
    pathlib.Path(path).write_text("\t".join(quora_csv.FIELDS) + "\n" + "\n".join(rows) + "\n")
    return path


def _text(version: int) -> str:
    return f"# version {version}\n" + "SOME_SETTING = 'a value of some length'\n" * 400


def _eval_metrics(folder, version, root):
    """TaskEvaluator._record: TensorBoard events in eval/ and eval_metrics.json."""
    record = evaluator.TaskEvaluator.__new__(evaluator.TaskEvaluator)
    record.metrics_file = paths.eval_metrics(str(folder), "validation")
    record.summaries_dir = paths.eval_summaries(str(folder), "validation")
    record._writer = None
    examples = SimpleNamespace(cardinality=lambda: 8)
    record.evaluator = SimpleNamespace(
        cached_task_datasets={f"task_{n}": examples for n in range(20)}
    )
    try:
        record._record(version, {f"task_{n}": {"accuracy": n / version} for n in range(20)})
    finally:
        if record._writer is not None:
            with contextlib.suppress(Exception):  # already said by the write that failed
                record._writer.close()


def _tensorboard(folder, version, root):
    writer = summaries.writer(str(folder / "train"))
    try:
        for step in range(3):
            writer.write_scalars(version * 1000 + step, {f"loss_{n}": 1.0 for n in range(20)})
        writer.flush()
    finally:
        with contextlib.suppress(Exception):
            writer.close()


def _train_config(folder, version, root):
    """config.gin, an earlier different one kept as config_to_step_<version>.gin."""
    with mock.patch.object(gin, "operative_config_str", return_value=_text(version)):
        kept = str(folder / paths.kept_train_config(version))
        gin_setup.write_operative_config(str(folder / paths.TRAIN_CONFIG), kept)


def _eval_config(folder, version, root):
    with mock.patch.object(gin, "operative_config_str", return_value=_text(version)):
        results_dir.write_config(str(folder / paths.EVAL_CONFIG))


def _lines(start: int, end: int, version: int) -> list[str]:
    return [
        prediction_files.json_line(f"input {i} " * 50, f"prediction {i} v{version}")
        for i in range(start, end)
    ]


def _chunk(folder, version, root):
    """A chunk of `t5tpu infer`, beside the ones before it."""
    store = infer_chunks.ChunkStore(str(folder / "q-2.jsonl"), {"inputs": "fingerprint"})
    store.open(writer=True)
    start = 100 * (version - 1)
    store.write(infer_chunks.Span(start, start + 100), _lines(start, start + 100, version))


def _predictions_chunks(folder, version, root):
    store = infer_chunks.ChunkStore(str(folder / "q-2.jsonl"), {"version": version})
    store.open(writer=True)
    store.write(infer_chunks.Span(0, 100), _lines(0, 100, version))
    store.record_end(100)


def _predictions(folder, version, root):
    """The merge of a run's chunks into the predictions file (the chunks made beforehand)."""
    store = infer_chunks.ChunkStore(str(folder / "q-2.jsonl"), {"version": version})
    store.merge(store.complete())


def _hf_export(folder, version, root):
    hf_format.export(_params(version), CONFIG, str(folder / "hf"), BUNDLED)


def _convert(folder, version, root):
    """`t5tpu convert --from=hf --overwrite` into folder/converted."""
    conversion.to_t5tpu(
        input_path=_hf_dir(version, root),
        output_dir=str(folder / "converted"),
        source="hf",
        overwrite=True,
        command="t5tpu convert",
    )


def _prepare_quora(folder, version, root):
    quora_csv.prepare(_quora_input(version, root), str(folder / "quora"), overwrite=True)


def _quora_tsv(folder, version, root):
    rows = quora_csv.read_pairs(_quora_input(version, root))
    quora_csv.write_pairs(str(folder / "pairs.tsv"), rows)


def _writer_lock(folder, version, root):
    with WriterLock(str(folder / paths.TRAIN_LOCK)):
        pass


@dataclasses.dataclass(frozen=True)
class Writer:
    write: Callable  # (folder, version, root) -> None
    blocked: str  # what is made the wrong kind in the third fault, relative to the folder
    kind: str  # what is put there: "folder" (where a file goes) or "file" (where a folder goes)
    setting: str  # what the read-only error tells the user to change
    prepare: Callable | None = None  # made before the fault, without one


WRITERS = {
    "eval metrics": Writer(_eval_metrics, "eval_metrics.json", "folder", "EVAL_OUTPUT_DIR"),
    "tensorboard events": Writer(_tensorboard, "train", "file", "MODEL_DIR"),
    "train config": Writer(_train_config, "config.gin", "folder", "MODEL_DIR"),
    "eval config": Writer(_eval_config, "eval_config.gin", "folder", "EVAL_OUTPUT_DIR"),
    "infer chunk": Writer(
        _chunk, "q-2.jsonl.parts/000000000100-000000000200.jsonl", "folder", "INFER_OUTPUT_DIR"
    ),
    "infer predictions": Writer(
        _predictions, "q-2.jsonl", "folder", "INFER_OUTPUT_DIR", prepare=_predictions_chunks
    ),
    "hf export": Writer(_hf_export, "hf/config.json", "folder", "--output_dir"),
    "convert output": Writer(_convert, "converted", "file", "--output_dir"),
    "prepare-quora": Writer(_prepare_quora, "quora/validation.tfrecord", "folder", "--output_dir"),
    "quora tsv": Writer(_quora_tsv, "pairs.tsv", "folder", "the path given"),
    "writer lock": Writer(_writer_lock, paths.TRAIN_LOCK, "folder", "MODEL_DIR"),
}


# --- what every fault must look like -------------------------------------------------------


def _write(writer: Writer, folder, version: int, root) -> None:
    if writer.prepare:
        writer.prepare(folder, version, root)
    writer.write(folder, version, root)


def _refused(writer: Writer, folder, root, expected: type) -> str:
    """The one-line message of `expected` that writing version 2 into `folder` raises."""
    with pytest.raises(Exception) as caught:  # noqa: PT011 (the class is checked below)
        writer.write(folder, 2, root)
    error = caught.value
    assert isinstance(error, expected), f"{type(error).__name__}: {error}"
    message = str(error)
    assert message and "\n" not in message, message
    return message


def _assert_kept(before: dict, folder) -> None:
    """Every file in `before` still in `folder`, byte for byte, and no temporary left."""
    after = file_digests(folder)
    changed = sorted(p for p, digest in before.items() if after.get(p) != digest)
    assert not changed, f"changed or lost: {changed}"
    names = [n for _, dirs, files in os.walk(folder) for n in dirs + files]
    left = [n for n in names if any(mark in n for mark in LEFTOVERS)]
    assert not left, f"left behind: {left}"


def _seeded(writer: Writer, folder, root) -> None:
    """The earlier output, and a file of another run beside it."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "earlier_run.txt").write_text("written by an earlier run\n")
    _write(writer, folder, 1, root)
    if writer.prepare:
        writer.prepare(folder, 2, root)


def _disk_full(writer: Writer, tmp_path, root) -> str:
    with fault_mounts.tmpfs(tmp_path / "disk", DISK_BYTES) as disk:
        folder = pathlib.Path(disk, "out")
        _seeded(writer, folder, root)
        filler = fault_mounts.fill(disk, leave_free_bytes=0)
        before = file_digests(folder)
        message = _refused(writer, folder, root, EnvironmentFault)
        assert FULL in message and str(folder) in message, message
        _assert_kept(before, folder)
        os.remove(filler)
        writer.write(folder, 2, root)  # the rerun, with room again
    return message


def _read_only(writer: Writer, tmp_path, root) -> str:
    source = tmp_path / "source"
    _seeded(writer, source, root)
    before = file_digests(source)
    with fault_mounts.read_only_view(source, tmp_path / "read_only") as view:
        message = _refused(writer, pathlib.Path(view), root, UserError)
    assert view in message and writer.setting in message, message
    _assert_kept(before, source)
    writer.write(source, 2, root)  # the rerun, into a writable folder
    return message


def _wrong_kind(writer: Writer, tmp_path, root) -> str:
    folder = tmp_path / "out"
    _seeded(writer, folder, root)
    blocked = folder / writer.blocked
    if blocked.exists():
        fault_mounts.remove(blocked)
    if writer.kind == "folder":
        fault_mounts.folder_where_file(blocked)
    else:
        fault_mounts.file_where_folder(blocked)
    before = file_digests(folder)
    message = _refused(writer, folder, root, UserError)
    # Said by the writer, or by the reader of the earlier file (storage.user_files).
    assert str(blocked) in message and f"a {writer.kind}" in message, message
    _assert_kept(before, folder)
    fault_mounts.remove(blocked)
    _write(writer, folder, 2, root)  # the rerun, the thing in the way removed
    return message


FAULT_CASES = {"disk full": _disk_full, "read-only": _read_only, "wrong kind": _wrong_kind}


@pytest.mark.parametrize("fault", list(FAULT_CASES))
@pytest.mark.parametrize("name", list(WRITERS))
def test_a_writer_fault_is_one_line_and_loses_nothing(name, fault, tmp_path, tmp_path_factory):
    root = str(tmp_path_factory.getbasetemp())  # the writers' inputs, made once
    message = FAULT_CASES[fault](WRITERS[name], tmp_path, root)
    print(f"{name} / {fault}: {message}")


def test_a_disk_that_fills_while_events_are_written_is_one_line(tmp_path):
    """clu's writer reports a failed write on the call after it, wrapped in its AsyncError."""
    with fault_mounts.tmpfs(tmp_path / "disk", 1 << 20) as disk:
        fault_mounts.fill(disk, leave_free_bytes=8 << 10)  # room for the file, not the events
        writer = summaries.writer(os.path.join(disk, "train"), setting="MODEL_DIR")
        with pytest.raises(EnvironmentFault, match=FULL):
            writer.write_scalars(0, {f"loss_{n}": 1.0 for n in range(1000)})
            writer.flush()  # fails here, or at the write after
            writer.write_scalars(1, {"loss": 1.0})
            writer.flush()
        with contextlib.suppress(Exception):
            writer.close()


# --- the compilation cache: a warning, never a failure -------------------------------------


def test_a_nearly_full_cache_disk_is_skipped_with_one_warning(tmp_path, monkeypatch, capsys):
    # An earlier test in this worker may have turned a cache on: enable() would keep that one.
    previous = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", None)
    try:
        _enable_on_a_nearly_full_disk(tmp_path, monkeypatch, capsys)
    finally:
        jax.config.update("jax_compilation_cache_dir", previous)


def _enable_on_a_nearly_full_disk(tmp_path, monkeypatch, capsys):
    with fault_mounts.tmpfs(tmp_path / "disk", 1 << 20) as disk:
        cache = os.path.join(disk, "cache")
        monkeypatch.setenv(compilation_cache.ENV, cache)
        assert compilation_cache.enable() is None
    [warning] = capsys.readouterr().err.splitlines()
    assert f"compilation cache {cache} cannot be written" in warning and "MiB free" in warning
    assert not jax.config.jax_compilation_cache_dir


def test_trim_removes_the_empty_entries_a_full_disk_left(tmp_path):
    """JAX never rewrites an entry that exists, so an empty one would warn at every start."""
    (tmp_path / "jit_cut-cache").write_bytes(b"")
    (tmp_path / "jit_whole-cache").write_bytes(b"x" * 1000)
    assert compilation_cache.trim(str(tmp_path)) == 1
    assert os.listdir(tmp_path) == ["jit_whole-cache"]


# --- through the command line --------------------------------------------------------------


def _one_error_line(run, code: int) -> str:
    """The run's one error line, once it exited `code` with a short stderr (as
    test_faults.py: at most 3 lines, e.g. a routine warning of the data pipeline)."""
    assert run.returncode == code, (run.returncode, run.stderr[-3000:])
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("t5tpu: error: ")]
    assert len(lines) <= 3 and len(errors) == 1, run.stderr[-3000:]
    return errors[0]


def test_eval_to_a_full_disk_is_exit_1_and_keeps_earlier_results(trained_tiny, tmp_path):
    earlier = {"1": {"qp_is_duplicate": {"accuracy": 50.0, "num_examples": 8}}}
    args = [
        f"--gin_file={TINY_EXPERIMENT}",
        "--gin.EVAL_NUM_EXAMPLES=8",
        f"--gin.MODEL_DIR='{trained_tiny}'",
    ]
    with fault_mounts.tmpfs(tmp_path / "disk", 1 << 20) as disk:
        out = pathlib.Path(disk, "out")
        out.mkdir()
        (out / "eval_metrics.json").write_text(json.dumps(earlier))
        (out / "eval_config.gin").write_text("# an earlier eval\n")
        before = file_digests(out)
        fault_mounts.fill(disk, leave_free_bytes=0)
        run = t5tpu("eval", *args, f"--gin.EVAL_OUTPUT_DIR='{out}'")
        line = _one_error_line(run, 1)
        assert FULL in line and str(out) in line, line
        _assert_kept(before, out)
    # The rerun, with room again, is the matrix's (eval metrics, disk full).


def test_convert_to_a_read_only_folder_is_exit_2_naming_it(trained_tiny, tmp_path):
    source = tmp_path / "source"
    source.mkdir()
    (source / "earlier.txt").write_text("kept\n")
    with fault_mounts.read_only_view(source, tmp_path / "read_only") as view:
        output = os.path.join(view, "hf")
        run = t5tpu("convert", "--to=hf", f"--input={trained_tiny}", f"--output_dir={output}")
    line = _one_error_line(run, 2)
    assert output in line and "--output_dir" in line, line
    assert os.listdir(source) == ["earlier.txt"]


def test_prepare_quora_to_a_full_disk_is_exit_1_and_leaves_nothing(tmp_path):
    pairs = _quora_input(1, str(tmp_path))
    with fault_mounts.tmpfs(tmp_path / "disk", 1 << 20) as disk:
        out = pathlib.Path(disk, "quora")
        out.mkdir()
        (out / "notes.txt").write_text("the user's own file\n")
        fault_mounts.fill(disk, leave_free_bytes=0)
        run = t5tpu("prepare-quora", f"--input={pairs}", f"--output_dir={out}")
        line = _one_error_line(run, 1)
        assert FULL in line and str(out) in line, line
        assert os.listdir(out) == ["notes.txt"]
    shutil.rmtree(tmp_path / "disk", ignore_errors=True)


def test_a_staging_folder_left_by_a_killed_convert_does_not_block_the_rerun(tmp_path):
    """A convert killed mid-write leaves its staging folder in --output_dir; the same command,
    without --overwrite, converts and removes it."""
    output = tmp_path / "converted"
    (output / ".t5tpu-staging-99999").mkdir(parents=True)
    (output / ".t5tpu-staging-99999" / "partial").write_bytes(b"\0" * 100)
    conversion.to_t5tpu(
        input_path=_hf_dir(1, str(tmp_path)),
        output_dir=str(output),
        source="hf",
        overwrite=False,
        command="t5tpu convert",
    )
    names = sorted(p.name for p in output.iterdir())
    assert not [n for n in names if n.startswith(".t5tpu-staging-")], names
    assert any(n.startswith("checkpoint_") for n in names), names
