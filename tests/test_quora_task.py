"""The bundled Quora sample, its split, the CPU vocabulary and the qp_is_duplicate task."""

import hashlib
import os
import subprocess
import sys

import gin
import pytest
import seqio
from t5tpu.tasks import metrics, quora, quora_csv

from t5tpu.data import vocab
from t5tpu.errors import UserError, one_line_message

PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED_QUORA = os.path.join(
    PROJECT_ROOT, "..", "shared", "data", "quora", "quora_duplicate_questions_first8000.tsv"
)
SEQUENCE_LENGTH = {"inputs": 256, "targets": 4}
QUORA_NAMES = [
    "qp_is_duplicate",
    "generate_similar_question",
    "qp_all",
    "qp_is_duplicate_tfds",
    "generate_similar_question_tfds",
    "qp_all_tfds",
]


def _sample(split):
    return list(quora_csv.read_pairs(quora.sample_path(split)))


@pytest.fixture(scope="module")
def task():
    quora.register(vocab.default_vocabulary())
    # Registering again replaces the tasks instead of failing on the duplicate names.
    assert quora.register(vocab.default_vocabulary()) == QUORA_NAMES
    return seqio.get_mixture_or_task(quora.TASK_NAME)


def test_split_rule_is_stable_and_near_ten_percent():
    validation_ids = [i for i in range(1000) if quora_csv.is_validation_pair(i)]
    assert len(validation_ids) == 105
    assert validation_ids[:5] == [0, 4, 11, 36, 52]
    assert [quora_csv.split_of_pair(i) for i in (0, 1)] == ["validation", "train"]


def test_bundled_splits_are_disjoint_and_cover_ids_0_to_999():
    train_ids = [int(p["id"]) for p in _sample("train")]
    validation_ids = [int(p["id"]) for p in _sample("validation")]
    assert (len(train_ids), len(validation_ids)) == (895, 105)
    assert not set(train_ids) & set(validation_ids)
    assert sorted(train_ids + validation_ids) == list(range(1000))
    assert all(quora_csv.is_validation_pair(i) for i in validation_ids)
    assert sum(int(p["is_duplicate"]) for p in _sample("train")) == 344
    assert sum(int(p["is_duplicate"]) for p in _sample("validation")) == 36


def test_bundled_rows_are_byte_identical_to_the_release():
    with open(SHARED_QUORA, encoding="utf-8", newline="") as file:
        source_lines = set(file.read().split("\n"))
    for split in quora_csv.SPLITS:
        with open(quora.sample_path(split), encoding="utf-8", newline="") as file:
            lines = file.read().split("\n")
        assert lines[-1] == ""  # the file ends with a newline
        assert all(line in source_lines for line in lines[:-1])


def test_read_pairs_keeps_a_quoted_newline_inside_its_record():
    pairs = list(quora_csv.read_pairs(SHARED_QUORA))
    assert len(pairs) == 8000
    assert [int(p["id"]) for p in pairs] == list(range(8000))
    record = pairs[2332]
    assert record["id"] == "2332"
    assert record["question1"] == "Which is the best RO water purifier in Ahmedabad?\n"
    assert record["question2"] == "What is the best water purifier available in India?"


def test_task_formats_the_first_train_pair(task):
    dataset = task.get_dataset(SEQUENCE_LENGTH, split="train", shuffle=False)
    first = next(dataset.as_numpy_iterator())
    assert first["id"] == 1
    assert first["inputs_pretokenized"].decode() == (
        "is duplicate: what is the story of kohinoor (koh-i-noor) diamond? <SEP> "
        "what would happen if the indian government stole the kohinoor (koh-i-noor) diamond back?"
    )
    assert first["targets_pretokenized"] == b"0"
    eos = vocab.default_vocabulary().eos_id
    assert eos == 1
    assert first["inputs"][-1] == eos and first["targets"][-1] == eos
    assert task.num_input_examples("train") == 895


def test_task_normalizes_every_example(task):
    dataset = task.get_dataset(SEQUENCE_LENGTH, split="validation", shuffle=False)
    examples = list(dataset.as_numpy_iterator())
    assert len(examples) == 105
    inputs = [ex["inputs_pretokenized"].decode() for ex in examples]
    questions = [text.replace(" <SEP> ", " ") for text in inputs]
    assert all(text == text.lower() and '"' not in text for text in questions)
    assert {ex["targets_pretokenized"] for ex in examples} == {b"0", b"1"}
    # Pair 167 quotes words in its second question; the quotes are gone.
    by_id = dict(zip((int(ex["id"]) for ex in examples), inputs, strict=True))
    assert by_id[167].endswith("which is correct: speak with or speak to?")


def test_postprocess_strips_the_decoded_label(task):
    assert task.postprocess_fn(" 1\n", is_target=False) == "1"


def test_vocabulary_round_trips_real_questions():
    vocabulary = vocab.default_vocabulary()
    assert vocabulary.vocab_size == 1024
    assert vocabulary is vocab.default_vocabulary(vocab.bundled_vocabulary_file())
    questions = [p["question1"].lower().replace('"', "") for p in _sample("train")[:20]]
    questions.append('when do you use "&" instead of "and"?'.replace('"', ""))
    for question in questions:
        assert vocabulary.decode(vocabulary.encode(question)) == question
    assert len(vocabulary.encode("0")) == 1 and len(vocabulary.encode("1")) == 1


def test_missing_vocabulary_file_is_a_user_error(tmp_path):
    missing = str(tmp_path / "nope.model")
    with pytest.raises(UserError) as raised:
        vocab.default_vocabulary(missing)
    assert one_line_message(raised.value) == (
        f"vocabulary file not found: {missing}; bind "
        "default_vocabulary.sentencepiece_model_file to an existing SentencePiece model"
    )


def test_vocabulary_training_is_reproducible(tmp_path):
    out = tmp_path / "cpu_vocab.model"
    script = os.path.join(PROJECT_ROOT, "scripts", "train_cpu_vocab.py")
    subprocess.run([sys.executable, script, "--out", str(out)], check=True, capture_output=True)
    with open(vocab.bundled_vocabulary_file(), "rb") as file:
        shipped = hashlib.sha256(file.read()).hexdigest()
    assert hashlib.sha256(out.read_bytes()).hexdigest() == shipped
    assert os.listdir(tmp_path) == ["cpu_vocab.model"]  # no stray .vocab file


def test_accuracy_and_f1_on_a_hand_computed_example():
    targets = ["1", "0", "1", "1"]
    predictions = ["1", "1", "0", "1"]
    assert metrics.accuracy(targets, predictions) == {"accuracy": 50.0}
    # precision 2/3, recall 2/3 -> F1 2/3
    f1 = metrics.f1_duplicate(targets, predictions)["f1_duplicate"]
    assert f1 == pytest.approx(200 / 3)


def test_invalid_predictions_count_as_wrong():
    targets = ["1", "0", "1", "0"]
    predictions = ["1", "maybe", "", "0"]
    assert metrics.accuracy(targets, predictions) == {"accuracy": 50.0}
    # "maybe" is a false positive, "" a missed duplicate: TP 1, FP 1, FN 1 -> F1 1/2.
    assert metrics.f1_duplicate(targets, predictions) == {"f1_duplicate": 50.0}
    assert metrics.f1_duplicate(["0"], ["0"]) == {"f1_duplicate": 0.0}


def test_register_builtin_tasks_registers_every_quora_task():
    seqio.TaskRegistry.remove(quora.TASK_NAME)
    assert quora.TASK_NAME not in seqio.TaskRegistry.names()
    from t5tpu import tasks

    names = tasks.register_builtin_tasks()
    assert [name for name in names if name in QUORA_NAMES] == QUORA_NAMES
    assert quora.TASK_NAME in seqio.TaskRegistry.names()
    assert {"qp_all", "qp_all_tfds"} <= set(seqio.MixtureRegistry.names())


@pytest.fixture
def gin_bindings():
    """Binds gin parameters for one test, then restores the defaults and the default tasks."""
    yield gin.bind_parameter
    gin.clear_config()
    quora.register(vocab.default_vocabulary())


def _examples(name, split="validation", lengths=None):
    task = seqio.get_mixture_or_task(name)
    dataset = task.get_dataset(lengths or SEQUENCE_LENGTH, split=split, shuffle=False)
    return list(dataset.as_numpy_iterator())


def test_similar_question_task_keeps_duplicates_only(task):
    examples = _examples(quora.SIMILAR_TASK_NAME, lengths={"inputs": 64, "targets": 64})
    duplicates = [p for p in _sample("validation") if p["is_duplicate"] == "1"]
    assert len(examples) == len(duplicates) == 36
    assert [int(ex["id"]) for ex in examples] == [int(p["id"]) for p in duplicates]
    first = examples[0]
    assert first["id"] == 11
    assert first["inputs_pretokenized"] == (
        b"generate similar question: how do i read and find my youtube comments?"
    )
    assert first["targets_pretokenized"] == b"how can i see all my youtube comments?"
    assert all(ex["targets"][-1] == 1 for ex in examples)  # EOS
    generate = seqio.get_mixture_or_task(quora.SIMILAR_TASK_NAME)
    assert [fn.__name__ for fn in generate.metric_fns] == ["bleu", "exact_match"]
    assert [fn.__name__ for fn in task.metric_fns] == ["accuracy", "f1_duplicate"]


def test_normalization_can_be_switched_off(gin_bindings):
    gin_bindings("normalize_questions.normalize", False)
    quora.register(vocab.default_vocabulary())
    first = _examples(quora.SIMILAR_TASK_NAME, lengths={"inputs": 64, "targets": 64})[0]
    assert first["inputs_pretokenized"] == (
        b"generate similar question: How do I read and find my YouTube comments?"
    )
    assert first["targets_pretokenized"] == b"How can I see all my Youtube comments?"
    by_id = {int(ex["id"]): ex["inputs_pretokenized"].decode() for ex in _examples(quora.TASK_NAME)}
    assert by_id[167].endswith('Which is correct: "speak with" or "speak to"?')


def test_mixture_rates_are_equal_by_default_and_set_in_gin(gin_bindings):
    mixture = seqio.get_mixture_or_task(quora.MIXTURE_NAME)
    rates = {t.name: mixture.get_rate(t) for t in mixture.tasks}
    assert rates == {"qp_is_duplicate": 1.0, "generate_similar_question": 1.0}
    gin_bindings("qp_all_rates.generate_similar_question", 0.25)
    quora.register(vocab.default_vocabulary())
    for name, suffix in (("qp_all", ""), ("qp_all_tfds", "_tfds")):
        mixture = seqio.get_mixture_or_task(name)
        rates = {t.name: mixture.get_rate(t) for t in mixture.tasks}
        assert rates == {
            f"qp_is_duplicate{suffix}": 1.0,
            f"generate_similar_question{suffix}": 0.25,
        }


def test_mixture_yields_examples_of_both_tasks(task):
    mixture = seqio.get_mixture_or_task(quora.MIXTURE_NAME)
    lengths = {"inputs": 96, "targets": 32}
    dataset = mixture.get_dataset(lengths, split="validation", shuffle=False, num_epochs=1, seed=0)
    vocabulary = vocab.default_vocabulary()
    prompts = [
        vocabulary.decode(ex["inputs"].tolist()).split(":")[0] for ex in dataset.as_numpy_iterator()
    ]
    # Sampling stops when it draws the task that ran out: the 36 similar-question examples.
    # At equal rates about as many is_duplicate examples (of 105) come out by then.
    assert prompts.count("generate similar question") == 36
    assert prompts.count("is duplicate") == 38


def test_tasks_read_a_prepared_directory(gin_bindings, tmp_path):
    kaggle_csv = os.path.join(os.path.dirname(SHARED_QUORA), "kaggle_train_head999.csv")
    quora_csv.prepare(kaggle_csv, str(tmp_path))
    gin_bindings("quora_data_dir.path", str(tmp_path))
    quora.register(vocab.default_vocabulary())
    is_duplicate = seqio.get_mixture_or_task(quora.TASK_NAME)
    assert is_duplicate.num_input_examples("train") == 895
    examples = _examples(quora.TASK_NAME)
    assert len(examples) == 104  # the sample's 105 less pair 999, which the CSV lacks
    assert examples[0]["inputs_pretokenized"].decode() == (
        "is duplicate: what is the step by step guide to invest in share market in india? <SEP> "
        "what is the step by step guide to invest in share market?"
    )
    assert sum(ex["targets_pretokenized"] == b"1" for ex in examples) == 36
    assert len(_examples(quora.SIMILAR_TASK_NAME, lengths={"inputs": 64, "targets": 64})) == 36


def test_missing_prepared_directory_is_a_user_error(gin_bindings, tmp_path):
    gin_bindings("quora_data_dir.path", str(tmp_path / "nope"))
    with pytest.raises(UserError, match=r"no prepared Quora data in .*nope \(stats.json missing\)"):
        quora.register(vocab.default_vocabulary())


@pytest.mark.parametrize("stats", ["{not json", '{"input": "train.csv"}', "[]"])
def test_a_stats_file_prepare_quora_did_not_write_is_a_user_error(gin_bindings, tmp_path, stats):
    (tmp_path / "stats.json").write_text(stats)
    gin_bindings("quora_data_dir.path", str(tmp_path))
    with pytest.raises(UserError, match=r"stats.json is not the stats.json `t5tpu prepare-quora`"):
        quora.register(vocab.default_vocabulary())


@pytest.fixture(scope="module")
def qqp_tfds_dir(tmp_path_factory):
    """glue/qqp built by tensorflow-datasets' own builder into a temporary data_dir, from GLUE-
    format files made of 60 real pairs (offline: the download is replaced by those files)."""
    from unittest import mock

    import tensorflow_datasets as tfds
    from tensorflow_datasets.text import glue

    root = tmp_path_factory.mktemp("qqp")
    extracted = root / "extracted" / "QQP"
    extracted.mkdir(parents=True)
    with open(SHARED_QUORA, encoding="utf-8") as file:
        header, *rows = [line for line in file.read().split("\n") if line][:61]
    for name, part in (("train", rows[:40]), ("dev", rows[40:])):
        (extracted / f"{name}.tsv").write_text("\n".join([header, *part]) + "\n")
    (extracted / "test.tsv").write_text("id\tquestion1\tquestion2\n0\tA?\tB?\n")
    # tfds looks up the builder's checksum file through importlib_resources, which this
    # environment lacks; with no code path it skips checksums, which a faked download has not.
    glue.Glue.code_path = None
    try:
        with mock.patch.object(
            tfds.download.DownloadManager,
            "download_and_extract",
            return_value=str(root / "extracted"),
        ):
            builder = tfds.builder("glue/qqp", data_dir=str(root / "data"))
            builder.download_and_prepare()
    finally:
        del glue.Glue.code_path
    return str(root / "data"), rows


def test_tfds_tasks_read_glue_qqp_from_the_bound_data_dir(gin_bindings, qqp_tfds_dir):
    data_dir, rows = qqp_tfds_dir
    gin_bindings("qqp_tfds_data_dir.path", data_dir)
    quora.register(vocab.default_vocabulary())
    dev = [row.split("\t") for row in rows[40:]]
    examples = _examples("qp_is_duplicate_tfds")
    # glue/qqp numbers rows by position in dev.tsv (idx) and shuffles them when built.
    by_id = {int(ex["id"]): ex for ex in examples}
    assert sorted(by_id) == list(range(20))
    for idx, (_, _, _, question1, question2, label) in enumerate(dev):
        expected = f"is duplicate: {question1.lower()} <SEP> {question2.lower()}".replace('"', "")
        assert by_id[idx]["inputs_pretokenized"].decode() == expected
        assert by_id[idx]["targets_pretokenized"].decode() == label
    similar = _examples("generate_similar_question_tfds", lengths={"inputs": 64, "targets": 64})
    duplicates = {i for i, row in enumerate(dev) if row[5] == "1"}
    assert {int(ex["id"]) for ex in similar} == duplicates and len(duplicates) == 6
    mixture = seqio.get_mixture_or_task("qp_all_tfds")
    train = mixture.get_dataset({"inputs": 96, "targets": 32}, split="train", num_epochs=1)
    assert len(list(train.as_numpy_iterator())) > 0


def test_bleu_and_exact_match_by_hand():
    # One n-gram of four wrong: precisions 3/4, 2/3, 1/2 and (no 4-gram matches, smoothed as
    # sacrebleu does by default) 1/2; no brevity penalty -> BLEU = (1/8) ** (1/4).
    assert metrics.bleu(["a b c d"], ["a b c e"])["bleu"] == pytest.approx(100 * 0.125**0.25)
    assert metrics.exact_match(["a b c d", "x"], ["a b c e", "x"]) == {"exact_match": 50.0}


def test_generation_metrics_on_real_validation_targets(task):
    examples = _examples(quora.SIMILAR_TASK_NAME, lengths={"inputs": 64, "targets": 64})
    targets = [ex["targets_pretokenized"].decode() for ex in examples]
    assert metrics.bleu(targets, targets)["bleu"] == pytest.approx(100.0)
    assert metrics.exact_match(targets, targets) == {"exact_match": 100.0}
    # Predicting each pair's first question (copying the input) scores what sacrebleu gives it.
    copies = [ex["inputs_pretokenized"].decode().split(": ", 1)[1] for ex in examples]
    assert metrics.exact_match(targets, copies) == {"exact_match": 0.0}
    assert 0.0 < metrics.bleu(targets, copies)["bleu"] < 100.0


def test_training_inputs_are_what_every_front_end_makes_of_the_raw_lines(task):
    """The tasks make each input with the model_input that t5tpu infer, t5tpu.load and serve
    call on a raw line (tasks/shaping.py): the same text for every pair of the sample."""
    from t5tpu.tasks import shaping

    from t5tpu.storage import run_record

    recorded = shaping.for_task(quora.MIXTURE_NAME)
    assert recorded == run_record.InputShaping(run_record.QUORA, normalize=True)
    pairs = {int(p["id"]): p for p in _sample("validation")}
    made = {int(ex["id"]): ex["inputs_pretokenized"].decode() for ex in _examples(quora.TASK_NAME)}
    raw = {i: quora.is_duplicate_line(p["question1"], p["question2"]) for i, p in pairs.items()}
    assert made == {i: shaping.shape(recorded, line) for i, line in raw.items()}
    assert sum(made[i] != raw[i] for i in made) > 50  # most pairs are capitalised as written
    similar = _examples(quora.SIMILAR_TASK_NAME, lengths={"inputs": 64, "targets": 64})
    for ex in similar:
        line = quora.similar_question_line(pairs[int(ex["id"])]["question1"])
        assert ex["inputs_pretokenized"].decode() == shaping.shape(recorded, line)
