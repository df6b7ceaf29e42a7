"""gs:// reads of everything a run reads besides MODEL_DIR, on a local GCS emulator: the
vocabulary, text-to-text files, SQuAD JSON, a prepared Quora directory (stats.json and the
TFRecords a task lists), a tfds data_dir and a Mesh TF checkpoint's prefix. Each is asked
through the storage layer (storage.remote: epath, bounded by the storage answer time) before
TensorFlow's own client, which no emulator can stand in for, touches it: a missing object, a
missing bucket and a closed port each end in one line naming it.

The checks run in this process against one emulator (the module's fixture points epath's gcsfs
at it); two runs of the command line show the same end to end.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import time

import gcs_emulator
import gin
import pytest
from cli_runs import ROOT, TINY_EXPERIMENT, cli_command, free_port
from fuzzing import assert_refused

from t5tpu.errors import UserError, one_line_message

pytestmark = pytest.mark.skipif(
    not all(importlib.util.find_spec(n) for n in ("gcp_storage_emulator", "gcsfs")),
    reason="gcp-storage-emulator and gcsfs not installed (pip install -c constraints.txt "
    "-e '.[test]')",
)

BUCKET = gcs_emulator.BUCKET
GS = f"gs://{BUCKET}"
MISSING_BUCKET = "gs://no-such-bucket-t5tpu"
ANSWER_SECONDS = 3  # T5TPU_STORAGE_ANSWER_SECONDS here, and in the command-line runs
# A closed port is reported after the answer time; the rest is this process's own work.
CLOSED_PORT_BOUND_SECONDS = ANSWER_SECONDS + 3
TSV = "input\ttarget\nwhat is one plus one?\ttwo\nname a colour\tred\n"
SQUAD = {
    "data": [
        {
            "title": "t",
            "paragraphs": [
                {
                    "context": "Paris is the capital of France.",
                    "qas": [
                        {
                            "id": "q1",
                            "question": "What is the capital of France?",
                            "answers": [{"text": "Paris", "answer_start": 0}],
                        }
                    ],
                }
            ],
        }
    ]
}


def _reset_clients() -> None:
    """Forgets the gcsfs client (it reads STORAGE_EMULATOR_HOST when made) and the buckets
    already found, so the next question goes to the endpoint the environment names now."""
    import gcsfs
    from etils.epath import backend, gpath

    from t5tpu.storage import remote

    # epath decides once per process whether gs:// goes through TensorFlow (EPATH_USE_TF): a
    # test file run earlier in this worker may already have had it decide.
    gpath._is_tf_installed.cache_clear()
    type(backend.fsspec_backend)._get_filesystem.cache_clear()
    gcsfs.GCSFileSystem.clear_instance_cache()
    remote._FOUND_BUCKETS.clear()


def _point_at(monkeypatch, endpoint: str) -> None:
    for name, value in gcs_emulator.client_environment(endpoint).items():
        monkeypatch.setenv(name, value)
    _reset_clients()


@pytest.fixture(scope="module")
def endpoint(tmp_path_factory):
    """The emulator, with this process's gs:// client pointed at it and the bucket holding
    one valid file of each kind (under the names the tests use)."""

    with gcs_emulator.running_emulator() as url, pytest.MonkeyPatch.context() as patch:
        _point_at(patch, url)
        patch.setenv("T5TPU_STORAGE_ANSWER_SECONDS", str(ANSWER_SECONDS))
        _upload_valid_files(url, tmp_path_factory.mktemp("valid"))
        _import_readers()
        yield url
    _reset_clients()


def _import_readers() -> None:
    """The readers' modules imported before any test: assert_refused bounds a read's time and
    memory, not an import's (jax, flax, TensorFlow, seqio, tfds)."""
    import tensorflow_datasets  # noqa: F401
    from t5tpu.tasks import quora, squad, text_to_text  # noqa: F401

    from t5tpu.data import availability  # noqa: F401
    from t5tpu.formats import loader, mesh_tf_format  # noqa: F401


def _upload_valid_files(url: str, local: pathlib.Path) -> None:
    from t5tpu.tasks import quora_csv

    from t5tpu.data import vocab

    vocabulary = pathlib.Path(vocab.bundled_vocabulary_file()).read_bytes()
    gcs_emulator.upload(url, "vocab/spiece.model", vocabulary)
    gcs_emulator.upload(url, "text/train.tsv", TSV.encode())
    gcs_emulator.upload(url, "squad/dev.json", json.dumps(SQUAD).encode())
    csv = local / "pairs.tsv"
    rows = [f"{i}\t{2 * i}\t{2 * i + 1}\tquestion {i}?\tquery {i}?\t{i % 2}" for i in range(1, 41)]
    csv.write_text("\t".join(quora_csv.FIELDS) + "\n" + "\n".join(rows) + "\n")
    quora_csv.prepare(str(csv), str(local / "quora"))
    for name in ("stats.json", "train.tfrecord"):  # validation.tfrecord left out: a lost file
        gcs_emulator.upload(url, f"quora/{name}", (local / "quora" / name).read_bytes())
    # A Mesh TF checkpoint whose data file was not copied: only its index is there.
    prefix = str(local / "model.ckpt-5")
    _write_tf_checkpoint(prefix, {"shared/embedding": [[1.0, 2.0]], "global_step": 5})
    gcs_emulator.upload(
        url, "mesh/model.ckpt-5.index", pathlib.Path(prefix + ".index").read_bytes()
    )


def _write_tf_checkpoint(prefix: str, variables: dict) -> None:
    """A TensorFlow name-based checkpoint, as the `t5` library's Saver writes them."""
    import tensorflow as tf

    names = list(variables)
    tensors = [tf.constant(value) for value in variables.values()]
    tf.raw_ops.SaveV2(
        prefix=prefix, tensor_names=names, shape_and_slices=[""] * len(names), tensors=tensors
    )


@pytest.fixture
def closed_port(endpoint, monkeypatch):
    """The gs:// client pointed at a port where nothing listens, for one test."""
    _point_at(monkeypatch, f"http://127.0.0.1:{free_port()}")
    yield
    monkeypatch.undo()
    _reset_clients()


def refused(read, *, naming: str, saying: str) -> UserError:
    """The one-line UserError `read()` ends in, within the bound of a closed port's answer."""
    outcome = assert_refused(read, max_seconds=CLOSED_PORT_BOUND_SECONDS)
    assert isinstance(outcome, UserError), f"read instead of refused: {outcome!r}"
    assert naming in str(outcome) and saying in str(outcome), str(outcome)
    return outcome


# --- one reader per resource kind: what the run calls before its TensorFlow reads ----------


def read_vocabulary(path: str):
    from t5tpu.data import vocab

    vocab._load_vocabulary.cache_clear()  # as a new process: the file is asked again
    try:
        return vocab.default_vocabulary(path)
    except UserError as e:  # as the command line prints it, without the call gin adds
        raise UserError(one_line_message(e)) from None


def read_text_task(path: str):
    from t5tpu.tasks import text_to_text

    from t5tpu.data import vocab

    gin.bind_parameter("text_to_text.train_files", path)
    return text_to_text.register(vocab.default_vocabulary())


def read_squad(path: str):
    from t5tpu.tasks import squad

    squad.read_squad_json.cache_clear()
    return squad.read_squad_json(path, require_answers=True)


def read_quora_dir(path: str):
    from t5tpu.tasks import quora

    return quora._prepared_source(path)


def read_records(path: str, name: str = "gcs_records"):
    """check_readable of a task whose train split is the TFRecord files `path` names."""
    import seqio
    from t5tpu.tasks import quora_csv

    from t5tpu.data import availability, vocab

    seqio.TaskRegistry.remove(name)
    seqio.TaskRegistry.add(
        name,
        source=seqio.TFExampleDataSource(
            {"train": path}, feature_description=quora_csv.tfrecord_feature_description()
        ),
        output_features={"inputs": seqio.Feature(vocab.default_vocabulary())},
    )
    return availability.check_readable(name, "train")


def read_tfds_dir(path: str, monkeypatch):
    from t5tpu.tasks import squad

    from t5tpu.data import availability, vocab

    # As offline: a data set not prepared there is reported, never downloaded into the bucket.
    monkeypatch.setattr(availability, "_unresolvable_download_hosts", lambda _: ["squad's"])
    gin.bind_parameter("squad_v1_source.tfds_data_dir", path)
    squad.register(vocab.default_vocabulary())
    return availability.check_readable("squad_v1", "validation")


def read_mesh_tf(path: str):
    from t5tpu.formats import loader

    return loader.detect_format(path, "--input")


def read_mesh_tf_data(data_path: str):
    """Mesh TF's reader of the checkpoint whose data file is `data_path`: its index and data
    files are asked through the storage layer before TensorFlow's checkpoint reader opens them
    (formats/mesh_tf_format.py)."""
    from t5tpu.formats import mesh_tf_format

    return mesh_tf_format.MeshTFCheckpoint(data_path.split(".data-")[0])


# --- present files are read through the emulator --------------------------------------------


def test_present_files_are_read_through_the_storage_layer(endpoint):
    from t5tpu.data import vocab

    local = vocab.default_vocabulary()
    remote = read_vocabulary(f"{GS}/vocab/spiece.model")
    assert remote.encode("two plus two") == local.encode("two plus two")
    assert read_text_task(f"{GS}/text/train.tsv") == ["text_to_text"]
    assert read_squad(f"{GS}/squad/dev.json")["text"] == [["Paris"]]
    source = read_quora_dir(f"{GS}/quora")
    stats = json.loads(gcs_emulator.read_object(endpoint, "quora/stats.json"))
    assert source.num_input_examples("train") == stats["pairs"]["train"] > 0


# --- a missing object: one line naming it ---------------------------------------------------

MISSING_OBJECT = {
    "vocabulary": (read_vocabulary, f"{GS}/vocab/nope.model", "vocabulary file not found"),
    "text_to_text": (read_text_task, f"{GS}/text/nope.tsv", "TRAIN_FILES: no file matches"),
    "squad": (read_squad, f"{GS}/squad/nope.json", "SQuAD file not found"),
    "quora_stats": (read_quora_dir, f"{GS}/nope", "no prepared Quora data"),
    "tfrecords": (read_records, f"{GS}/quora/validation.tfrecord", "no file"),
    "tfrecord_pattern": (read_records, f"{GS}/quora/valid*.tfrecord", "no file matches"),
    "mesh_tf": (read_mesh_tf, f"{GS}/mesh/model.ckpt-9", "does not exist"),
    "mesh_tf_data": (read_mesh_tf_data, f"{GS}/mesh/model.ckpt-5.data-00000-of-00001", "no file"),
}


@pytest.mark.parametrize("kind", list(MISSING_OBJECT))
def test_a_missing_object_is_one_line_naming_it(kind, endpoint):
    read, path, saying = MISSING_OBJECT[kind]
    refused(lambda: read(path), naming=path, saying=saying)


def test_a_tfds_data_set_missing_from_its_gcs_data_dir_is_one_line(endpoint, monkeypatch):
    path = f"{GS}/tfds"
    refused(lambda: read_tfds_dir(path, monkeypatch), naming=path, saying="is not prepared in")


# --- a missing bucket: one line naming the bucket, none created -----------------------------

MISSING_BUCKET_READS = {
    "vocabulary": (read_vocabulary, f"{MISSING_BUCKET}/spiece.model"),
    "text_to_text": (read_text_task, f"{MISSING_BUCKET}/train.tsv"),
    "squad": (read_squad, f"{MISSING_BUCKET}/dev.json"),
    "quora_dir": (read_quora_dir, f"{MISSING_BUCKET}/quora"),
    "tfrecords": (read_records, f"{MISSING_BUCKET}/train-*.tfrecord"),
    "mesh_tf": (read_mesh_tf, f"{MISSING_BUCKET}/model.ckpt-5"),
}


@pytest.mark.parametrize("kind", list(MISSING_BUCKET_READS))
def test_a_missing_bucket_is_one_line_naming_it(kind, endpoint):
    read, path = MISSING_BUCKET_READS[kind]
    refused(lambda: read(path), naming=MISSING_BUCKET, saying="does not exist")
    assert gcs_emulator.bucket_names(endpoint) == [BUCKET]


def test_a_missing_bucket_of_a_tfds_data_dir_is_one_line(endpoint, monkeypatch):
    path = f"{MISSING_BUCKET}/tfds"
    refused(lambda: read_tfds_dir(path, monkeypatch), naming=path, saying="does not exist")


# --- a closed port: one line within the storage answer time ---------------------------------

# Paths of present objects: only the storage's silence can stop them.
CLOSED = {
    "vocabulary": (read_vocabulary, f"{GS}/vocab/spiece.model"),
    "text_to_text": (read_text_task, f"{GS}/text/train.tsv"),
    "squad": (read_squad, f"{GS}/squad/dev.json"),
    "quora_dir": (read_quora_dir, f"{GS}/quora"),
    "tfrecords": (read_records, f"{GS}/quora/train.tfrecord"),
    "mesh_tf": (read_mesh_tf, f"{GS}/mesh/model.ckpt-5"),
}


@pytest.mark.parametrize("kind", list(CLOSED))
def test_a_closed_port_is_one_line_within_the_answer_time(kind, closed_port):
    read, path = CLOSED[kind]
    refused(lambda: read(path), naming=path, saying="did not answer")


def test_a_closed_port_before_a_tfds_data_dir_is_one_line(closed_port, monkeypatch):
    path = f"{GS}/tfds"
    refused(lambda: read_tfds_dir(path, monkeypatch), naming=path, saying="did not answer")


# --- the command line ------------------------------------------------------------------------


def run_cli(argv: list[str], endpoint: str, tmp_path) -> tuple[int, list[str], float]:
    """(exit code, non-empty stderr lines, seconds) of `t5tpu ARGV` with the gs:// client
    pointed at `endpoint` and a local MODEL_DIR."""
    import subprocess

    env = {
        **os.environ,
        **gcs_emulator.client_environment(endpoint),
        "T5TPU_STORAGE_ANSWER_SECONDS": str(ANSWER_SECONDS),
    }
    start = time.monotonic()
    run = subprocess.run(
        cli_command(*argv, f"--gin.MODEL_DIR='{tmp_path / 'model'}'"),
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    seconds = time.monotonic() - start
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    return run.returncode, [line for line in run.stderr.splitlines() if line.strip()], seconds


def test_infer_with_a_missing_gcs_vocabulary_is_one_line(endpoint, tmp_path):
    path = f"{GS}/vocab/missing.model"
    code, lines, _ = run_cli(
        [
            "infer",
            f"--gin_file={TINY_EXPERIMENT}",
            f"--gin.default_vocabulary.sentencepiece_model_file='{path}'",
            "--gin.INFER_INPUTS=['is this a question?']",
        ],
        endpoint,
        tmp_path,
    )
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("t5tpu: error: vocabulary file not found: ") and path in lines[0]


def test_train_on_a_gcs_quora_dir_behind_a_closed_port_is_one_line_in_bounded_time(tmp_path):
    closed = f"http://127.0.0.1:{free_port()}"
    code, lines, seconds = run_cli(
        ["train", f"--gin_file={TINY_EXPERIMENT}", f"--gin.QUORA_DATA_DIR='{GS}/quora'"],
        closed,
        tmp_path,
    )
    assert code == 2 and len(lines) == 1, lines
    assert f"QUORA_DATA_DIR={GS}/quora" in lines[0] and "did not answer" in lines[0]
    assert seconds < 60  # start-up, then at most the answer time; not gcsfs' retries


def test_a_storage_answer_time_that_is_not_a_number_is_one_line(monkeypatch):
    from t5tpu.storage import remote

    monkeypatch.setenv("T5TPU_STORAGE_ANSWER_SECONDS", "twenty")
    with pytest.raises(UserError, match="T5TPU_STORAGE_ANSWER_SECONDS='twenty' is not a number"):
        remote.answered(lambda: None, path="gs://bucket/file", setting="MODEL_DIR")
    monkeypatch.setenv("T5TPU_STORAGE_ANSWER_SECONDS", "2.5")
    assert remote.answer_seconds() == 2.5
