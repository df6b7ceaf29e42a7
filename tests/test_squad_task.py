"""squad_v1 and squad_v2 on real rows of the SQuAD dev files in ../shared/data: sources (official
JSON by path; tensorflow-datasets prepared offline from the same rows), preprocessing, truncation,
postprocessing and scoring through seqio's Evaluator, and the errors a user can cause."""

import importlib.resources
import importlib.util
import json
import os
import socket
import subprocess
import sys
from unittest import mock

import gin
import numpy as np
import pytest
import seqio
import tensorflow_datasets as tfds
from t5tpu.tasks import squad

from t5tpu.config import gin_setup
from t5tpu.data import availability, pipeline, vocab
from t5tpu.errors import UserError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SQUAD_DIR = os.path.join(ROOT, "..", "shared", "data", "squad")
V1_FILE = os.path.join(SQUAD_DIR, "dev-v1.1.json")
V2_FILE = os.path.join(SQUAD_DIR, "dev-v2.0-cs224n-part-a.json")
LENGTHS = {"inputs": 512, "targets": 32}


def register(bindings: str = "") -> dict[str, seqio.Task]:
    """Registers the SQuAD tasks with `bindings` parsed, as a runner does after parsing gin."""
    gin_setup.import_configurables()
    gin.clear_config()
    gin.parse_config(bindings)
    return {task.name: task for task in squad.register(vocab.default_vocabulary())}


@pytest.fixture(scope="module")
def tasks():
    yield register(
        f"squad_v1_source.validation_file = '{V1_FILE}'\n"
        f"squad_v2_source.validation_file = '{V2_FILE}'\n"
    )
    gin.clear_config()


def examples(task, lengths=LENGTHS, take=None, ids=None):
    """The first `take` validation examples in file order (those with `ids` among them)."""
    ds = task.get_dataset(lengths, split="validation", shuffle=False, num_epochs=1)
    rows = list(ds.take(take or -1).as_numpy_iterator())
    return [r for r in rows if r["id"].decode() in ids] if ids else rows


def test_v1_first_dev_question_in_t5_format(tasks):
    ds = tasks["squad_v1"].get_dataset(LENGTHS, split="validation", shuffle=False)
    first = next(ds.as_numpy_iterator())
    with open(V1_FILE, encoding="utf-8") as f:
        paragraph = json.load(f)["data"][0]["paragraphs"][0]
    assert first["id"] == b"56be4db0acb8001400a502ec"
    assert first["inputs_pretokenized"].decode() == (
        "question: Which NFL team represented the AFC at Super Bowl 50? context: "
        + paragraph["context"]
    )
    assert first["targets_pretokenized"] == b"Denver Broncos"
    assert first["answers"].tolist() == [b"Denver Broncos"] * 3
    vocabulary = vocab.default_vocabulary()
    assert first["targets"].tolist() == vocabulary.encode("Denver Broncos") + [vocabulary.eos_id]
    assert first["inputs"][-1] == vocabulary.eos_id
    assert vocabulary.decode(first["inputs"].tolist()) == first["inputs_pretokenized"].decode()


def test_json_sources_hold_every_question(tasks):
    assert tasks["squad_v1"].num_input_examples("validation") == 10570
    assert tasks["squad_v2"].num_input_examples("validation") == 2805
    rows = squad.read_squad_json(V2_FILE, require_answers=False)
    assert sum(not answers for answers in rows["text"]) == 1527  # unanswerable, as PROVENANCE says


def test_v2_unanswerable_question_gets_the_no_answer_target(tasks):
    rows = examples(tasks["squad_v2"], lengths={"inputs": 256, "targets": 32}, take=6)
    by_question = {r["question"].decode(): r for r in rows}
    unanswerable = by_question["Who gave their name to Normandy in the 1000's and 1100's"]
    assert unanswerable["targets_pretokenized"].decode() == squad.NO_ANSWER == "unanswerable"
    assert unanswerable["answers"].tolist() == []
    inputs = unanswerable["inputs_pretokenized"].decode()
    assert inputs.startswith(
        "question: Who gave their name to Normandy in the 1000's and 1100's context: The Normans"
    )
    answerable = by_question["When were the Normans in Normandy?"]
    assert answerable["targets_pretokenized"] == b"10th and 11th centuries"
    assert len(answerable["answers"]) == 4


def test_long_context_is_truncated_and_the_answer_past_the_cut_is_lost(tasks):
    # Question 226 of the file, "Which Panthers RB scored 6 TDs ...?": 738 pieces, and the
    # answer "Jonathan Stewart" lies past piece 511.
    question_id = "56bf6b303aeaaa14008c960f"
    vocabulary = vocab.default_vocabulary()
    (cut,) = examples(tasks["squad_v1"], take=230, ids={question_id})
    (whole,) = examples(
        tasks["squad_v1"], lengths={"inputs": 1024, "targets": 32}, take=230, ids={question_id}
    )
    assert len(cut["inputs"]) == 512 and cut["inputs"][-1] == vocabulary.eos_id
    assert len(whole["inputs"]) == 738 + 1
    assert cut["targets_pretokenized"] == b"Jonathan Stewart"
    assert "Jonathan Stewart" not in vocabulary.decode(cut["inputs"].tolist())
    assert "Jonathan Stewart" in vocabulary.decode(whole["inputs"].tolist())
    # The question comes first, so it is kept whole.
    assert vocabulary.decode(cut["inputs"].tolist()).startswith(
        "question: Which Panthers RB scored 6 TDs in the 13 games leading up to Super Bowl 50?"
    )


def test_postprocessing_reads_gold_answers_and_no_answer():
    example = {"answers": [b"Denver Broncos", "Broncos"]}
    assert squad.postprocess_v1("x", example=example, is_target=True) == [
        "Denver Broncos",
        "Broncos",
    ]
    assert squad.postprocess_v1(" Denver Broncos ") == "Denver Broncos"
    assert squad.postprocess_v1(squad.NO_ANSWER) == squad.NO_ANSWER  # v1 has no such answer
    assert squad.postprocess_v2(" unanswerable ") == ""
    assert squad.postprocess_v2("Rollo") == "Rollo"


def _score_through_seqio(task_name, predict):
    """seqio's Evaluator over the first 40 validation questions, with `predict` in place of a
    model: it maps the model features of a batch to the predicted token ids."""
    evaluator = seqio.Evaluator(
        task_name,
        pipeline.feature_converter(pack=False),
        eval_split="validation",
        sequence_length={"inputs": 256, "targets": 32},
        num_examples=40,
        logger_cls=(),
    )

    def predict_fn(ds):
        return [(int(i), predict(features)) for i, features in ds.as_numpy_iterator()]

    future, _ = evaluator.evaluate(compute_metrics=True, step=0, predict_fn=predict_fn)
    return future.result()[task_name]


def _first_answer(features):
    """The decoder targets (EOS, then padding): exactly the first gold answer, the training
    target. Every prediction has the same length, as the model's do."""
    return features["decoder_target_tokens"].tolist()


def test_seqio_scores_the_training_targets_100(tasks):
    assert _score_through_seqio("squad_v1", _first_answer) == {"exact_match": 100.0, "f1": 100.0}
    # v2: the unanswerable ones' target "unanswerable" is postprocessed to "" and matches too.
    v2 = _score_through_seqio("squad_v2", _first_answer)
    assert v2["exact"] == v2["f1"] == v2["HasAns_exact"] == v2["NoAns_exact"] == 100.0
    assert v2["HasAns_total"] + v2["NoAns_total"] == v2["total"] == 40.0
    assert v2["NoAns_total"] == 23.0  # counted in the file


def test_seqio_scores_always_no_answer_as_the_v2_script_does(tasks):
    vocabulary = vocab.default_vocabulary()
    no_answer = vocabulary.encode(squad.NO_ANSWER) + [vocabulary.eos_id]
    v2 = _score_through_seqio("squad_v2", lambda features: no_answer)
    assert (v2["HasAns_exact"], v2["HasAns_f1"]) == (0.0, 0.0)
    assert (v2["NoAns_exact"], v2["NoAns_f1"]) == (100.0, 100.0)
    assert v2["exact"] == v2["f1"] == pytest.approx(100 * 23 / 40)


def _small_squad_file(tmp_path, source, name):
    """The first two paragraphs of a real dev file, in the official format."""
    with open(source, encoding="utf-8") as f:
        article = json.load(f)["data"][0]
    small = {"version": "small", "data": [{**article, "paragraphs": article["paragraphs"][:2]}]}
    path = tmp_path / name
    path.write_text(json.dumps(small), encoding="utf-8")
    return str(path)


def _prepare_tfds_offline(tfds_name, json_file, data_dir, monkeypatch):
    """Runs tfds' own squad builder on a local file instead of the download (no internet here)."""
    if importlib.util.find_spec("importlib_resources") is None:
        # tensorflow-datasets 4.9.10 imports importlib_resources when preparing a built-in
        # dataset but declares it only for Python < 3.9; the standard library's module serves.
        monkeypatch.setitem(sys.modules, "importlib_resources", importlib.resources)
    files = {"train": json_file, "dev": json_file}
    with mock.patch.object(
        tfds.download.DownloadManager, "download_and_extract", return_value=files
    ):
        tfds.builder(tfds_name, data_dir=data_dir).download_and_prepare()


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_tfds_source_gives_the_same_examples_as_the_json_source(version, tmp_path, monkeypatch):
    task_name, source_file = {"v1": ("squad_v1", V1_FILE), "v2": ("squad_v2", V2_FILE)}[version]
    small = _small_squad_file(tmp_path, source_file, f"small_{version}.json")
    data_dir = str(tmp_path / "tfds")
    _prepare_tfds_offline(squad.TFDS_NAMES[task_name].split(":")[0], small, data_dir, monkeypatch)

    from_tfds = register(f"squad_{version}_source.tfds_data_dir = '{data_dir}'")[task_name]
    assert isinstance(from_tfds.source, seqio.TfdsDataSource)
    assert from_tfds.source.tfds_dataset.name == squad.TFDS_NAMES[task_name]
    tfds_rows = examples(from_tfds, lengths={"inputs": 256, "targets": 32})
    from_json = register(f"squad_{version}_source.validation_file = '{small}'")[task_name]
    json_rows = examples(from_json, lengths={"inputs": 256, "targets": 32})
    gin.clear_config()

    def comparable(rows):
        keys = ("inputs_pretokenized", "targets_pretokenized", "inputs", "targets", "answers")
        return {r["id"]: {k: np.asarray(r[k]).tolist() for k in keys} for r in rows}

    assert len(tfds_rows) == len(json_rows) > 10
    assert comparable(tfds_rows) == comparable(json_rows)  # tfds stores them in another order


def _refuse_downloads(monkeypatch):
    def offline(builder, *args, **kwargs):
        raise ConnectionError(f"Failed to resolve the host of {builder.name}")

    monkeypatch.setattr(tfds.core.DatasetBuilder, "download_and_prepare", offline)


def _set_dns(monkeypatch, resolves: bool, proxy: str | None = None):
    """This machine's DNS as the test needs it (here no download host resolves)."""

    def getaddrinfo(host, *args, **kwargs):
        if not resolves:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("192.0.2.1", 443))]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    for name in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY"):
        monkeypatch.delenv(name, raising=False)
    if proxy:
        monkeypatch.setenv("HTTPS_PROXY", proxy)


def test_tfds_data_neither_prepared_nor_downloadable_is_one_user_error(tmp_path, monkeypatch):
    """Runners check the data before they start: unchecked, tfds' failed download surfaced as a
    60-line requests traceback from inside the first batch."""
    data_dir = str(tmp_path / "tfds")
    register(f"squad_v1_source.tfds_data_dir = '{data_dir}'")
    _refuse_downloads(monkeypatch)
    _set_dns(monkeypatch, resolves=True)
    with pytest.raises(UserError) as error:
        availability.check_readable("squad_v1", "validation", "EVAL_SPLIT")
    gin.clear_config()
    assert str(error.value) == (
        "cannot read the 'validation' split of task 'squad_v1': tfds squad/v1.1/3.0.0 is not "
        f"prepared in {data_dir}/squad/v1.1/3.0.0 and preparing it failed (ConnectionError: "
        "Failed to resolve the host of squad); prepare it on a machine with internet and bind "
        "squad_v1_source.tfds_data_dir to its folder, or bind the task's own files in gin "
        "(docs/USAGE.md: Tasks and data)"
    )


def test_offline_the_check_fails_at_once_instead_of_retrying_the_download(tmp_path, monkeypatch):
    """tfds retries each URL for ~3.5 minutes before it gives up; a machine that resolves none
    of the download hosts is told at once, and never starts the download."""
    register(f"squad_v1_source.tfds_data_dir = '{tmp_path / 'tfds'}'")
    _set_dns(monkeypatch, resolves=False)
    monkeypatch.setattr(
        tfds.core.DatasetBuilder, "download_and_prepare", lambda *_: pytest.fail("downloaded")
    )
    with pytest.raises(UserError) as error:
        availability.check_readable("squad_v1", "train")
    assert "failed (no network: cannot resolve rajpurkar.github.io, storage.googleapis.com)" in (
        str(error.value)
    )
    # Behind a proxy, names need not resolve locally: the download is tried.
    _refuse_downloads(monkeypatch)
    _set_dns(monkeypatch, resolves=False, proxy="http://proxy.example:3128")
    with pytest.raises(UserError, match="ConnectionError: Failed to resolve the host of squad"):
        availability.check_readable("squad_v1", "train")
    gin.clear_config()


def test_prepared_tfds_data_passes_the_check_without_a_download(tmp_path, monkeypatch):
    small = _small_squad_file(tmp_path, V1_FILE, "small_v1.json")
    data_dir = str(tmp_path / "tfds")
    _prepare_tfds_offline("squad/v1.1", small, data_dir, monkeypatch)
    register(f"squad_v1_source.tfds_data_dir = '{data_dir}'")
    _refuse_downloads(monkeypatch)
    availability.check_readable("squad_v1", "validation", "EVAL_SPLIT")  # raises if it downloads
    availability.check_readable("squad_v1", "train")
    gin.clear_config()


@pytest.mark.parametrize("shared", [True, False], ids=["shared data_dir", "data_dir per host"])
def test_hosts_prepare_a_tfds_data_set_one_after_another(shared, tmp_path):
    """On a pod slice every host runs the check: process 0 prepares first, so hosts sharing a
    gs:// data_dir do not race to write it; hosts with their own data_dir each prepare theirs."""
    small = _small_squad_file(tmp_path, V1_FILE, "small_v1.json")
    log = tmp_path / "prepared_by"
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    workers = [
        subprocess.Popen(
            [sys.executable, __file__, small, str(tmp_path / ("tfds" if shared else f"tfds{pid}"))]
            + [str(log), str(pid), str(port)],
            cwd=ROOT,
            env=dict(os.environ, HTTPS_PROXY="http://proxy.example:3128"),  # no DNS probe
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for pid in (0, 1)
    ]
    rows = []
    for worker in workers:
        out, err = worker.communicate(timeout=300)
        assert worker.returncode == 0, err[-3000:]
        rows.append(json.loads(out.splitlines()[-1])["rows"])
    assert log.read_text().split() == (["0"] if shared else ["0", "1"])
    assert rows[0] == rows[1] > 10


def _prepare_on_one_of_two_hosts(small, data_dir, log, process_id, port):
    import jax
    from jax.experimental import multihost_utils

    jax.distributed.initialize(f"localhost:{port}", 2, process_id)
    task = register(f"squad_v1_source.tfds_data_dir = '{data_dir}'")["squad_v1"]
    assert not task.source.tfds_dataset.builder.is_prepared()  # made before it is prepared
    multihost_utils.sync_global_devices("both builders made")
    sys.modules.setdefault("importlib_resources", importlib.resources)  # _prepare_tfds_offline
    prepare = tfds.core.DatasetBuilder.download_and_prepare

    def logged(builder, *args, **kwargs):
        with open(log, "a") as f:
            f.write(f"{process_id}\n")
        return prepare(builder, *args, **kwargs)

    files = {"train": small, "dev": small}
    with (
        mock.patch.object(tfds.core.DatasetBuilder, "download_and_prepare", logged),
        mock.patch.object(
            tfds.download.DownloadManager, "download_and_extract", return_value=files
        ),
    ):
        availability.check_readable("squad_v1", "validation")
    print(json.dumps({"rows": len(examples(task, lengths={"inputs": 256, "targets": 32}))}))


def test_missing_or_malformed_files_are_user_errors(tmp_path):
    with pytest.raises(UserError, match="SQuAD file not found: /no/such.json"):
        register("squad_v1_source.train_file = '/no/such.json'")
    not_squad = tmp_path / "not_squad.json"
    not_squad.write_text('{"rows": []}')
    with pytest.raises(UserError, match="is not SQuAD JSON"):
        register(f"squad_v2_source.validation_file = '{not_squad}'")
    with pytest.raises(UserError, match="has no answer.*use squad_v2"):
        register(f"squad_v1_source.validation_file = '{V2_FILE}'")
    gin.clear_config()


def test_a_split_without_a_file_says_which_macro_to_set():
    task = register(f"squad_v1_source.validation_file = '{V1_FILE}'")["squad_v1"]
    gin.clear_config()
    with pytest.raises(UserError, match="squad_v1 has no train file: set SQUAD_V1_TRAIN_FILE"):
        task.get_dataset(LENGTHS, split="train")


if __name__ == "__main__":
    _prepare_on_one_of_two_hosts(*sys.argv[1:4], int(sys.argv[4]), int(sys.argv[5]))
