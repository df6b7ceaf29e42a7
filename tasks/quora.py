"""The Quora question-pairs tasks and their mixture.

qp_is_duplicate:            "is duplicate: <question1> <SEP> <question2>" -> "1" or "0"
generate_similar_question:  duplicates only, "generate similar question: <question1>" -> question2
qp_all:                     a mixture of the two (rates from `qp_all_rates`, equal by default)

The pairs come from the sample bundled with t5tpu, or from a directory that `t5tpu prepare-quora`
wrote when `quora_data_dir.path` is bound (experiment files bind it to the QUORA_DATA_DIR macro).
The same tasks over tensorflow-datasets' glue/qqp are named with a `_tfds` suffix; its data
directory is `qqp_tfds_data_dir.path`. Every source is mapped to the same fields (id, question1,
question2, is_duplicate) first, so the preprocessors after that are shared.

Questions are lower-cased and their double quotes dropped (`normalize_questions`) by
`model_input`, the one function that makes a model input of a line in the tasks' words: training
calls it, and so does every front end with a raw line (tasks/shaping.py). Registered by
`register`, which t5tpu.tasks.register_builtin_tasks calls once gin is parsed. `is_duplicate`
and `similar_question` ask a model trained on these tasks, in the tasks' words; `routes` offers
the same questions to `t5tpu serve`.
"""

from __future__ import annotations

import json
import os

import gin
import numpy as np
from t5tpu.tasks import metrics, quora_csv, registry, serving

from t5tpu import package_files, validators
from t5tpu.data import availability
from t5tpu.errors import UserError
from t5tpu.runtime.lazy_imports import seqio, tf
from t5tpu.storage import remote, user_files

TASK_NAME = "qp_is_duplicate"
SIMILAR_TASK_NAME = "generate_similar_question"
MIXTURE_NAME = "qp_all"
TFDS_SUFFIX = "_tfds"
TFDS_NAME = "glue/qqp:2.0.0"
SAMPLE_DIR = package_files.asset("quora_sample")
SEPARATOR = "<SEP>"
DATA_DIR_SETTING = "QUORA_DATA_DIR"
# stats.json lists every rejected row of the input; a file far larger than the full release's
# would be is not one.
MAX_STATS_BYTES = 256 << 20


@gin.configurable
def quora_data_dir(path: str | None = None) -> str | None:
    """A directory written by `t5tpu prepare-quora`, or None for the bundled sample."""
    return path


@gin.configurable
def qqp_tfds_data_dir(path: str | None = None) -> str | None:
    """tfds's data_dir for glue/qqp; None is tfds's default (~/tensorflow_datasets)."""
    return path


@gin.configurable
def qp_all_rates(
    qp_is_duplicate: float = 1.0, generate_similar_question: float = 1.0
) -> dict[str, float]:
    """Sampling rates of the qp_all mixture's tasks (relative weights)."""
    return {TASK_NAME: qp_is_duplicate, SIMILAR_TASK_NAME: generate_similar_question}


# --- sources: each yields {"id", "question1", "question2", "is_duplicate"} -----------------------


def sample_path(split: str) -> str:
    return os.path.join(SAMPLE_DIR, f"{split}.tsv")


def _count_pairs(split: str) -> int:
    return sum(1 for _ in quora_csv.read_pairs(sample_path(split)))


def quora_dataset(split: str, shuffle_files: bool, seed: int | None = None) -> tf.data.Dataset:
    """The pairs of one split of the bundled sample, in file order.

    shuffle_files and seed are part of seqio's source contract; with one small file per split
    there are no files to shuffle, and the Task shuffles examples itself when asked.
    """
    del shuffle_files, seed
    pairs = list(quora_csv.read_pairs(sample_path(split)))
    return tf.data.Dataset.from_tensor_slices(
        {
            "id": np.array([int(p["id"]) for p in pairs], dtype=np.int64),
            "question1": [p["question1"] for p in pairs],
            "question2": [p["question2"] for p in pairs],
            "is_duplicate": np.array([int(p["is_duplicate"]) for p in pairs], dtype=np.int64),
        }
    )


def _sample_source() -> seqio.DataSource:
    splits = quora_csv.SPLITS
    return seqio.FunctionDataSource(
        dataset_fn=quora_dataset,
        splits=splits,
        num_input_examples={split: _count_pairs(split) for split in splits},
    )


def _prepared_source(data_dir: str) -> seqio.DataSource:
    """The TFRecord splits that `t5tpu prepare-quora` wrote into `data_dir`, whose stats.json
    (read through the storage layer, as every gs:// file t5tpu reads) gives each split's size.
    The TFRecords themselves are tf.data's to read: availability.check_readable checks them
    before a run."""
    stats_path = os.path.join(data_dir, quora_csv.STATS_FILE)
    remote.check_storage(data_dir, DATA_DIR_SETTING)
    # stats.json is renamed into place last, so its presence means the splits are complete.
    if not remote.is_file(stats_path, DATA_DIR_SETTING):
        raise UserError(
            f"no prepared Quora data in {data_dir} ({quora_csv.STATS_FILE} missing); run "
            f"`t5tpu prepare-quora --input=train.csv --output_dir={data_dir}` or fix QUORA_DATA_DIR"
        )
    source = seqio.TFExampleDataSource(
        split_to_filepattern={
            split: os.path.join(data_dir, name) for split, name in quora_csv.OUTPUT_FILES.items()
        },
        feature_description=quora_csv.tfrecord_feature_description(),
        num_input_examples=_split_sizes(stats_path, data_dir),
    )
    # The counts are what prepare-quora wrote: a split holding fewer records lost some.
    setattr(source, availability.EXACT_SIZES, True)
    return source


def _split_sizes(stats_path: str, data_dir: str) -> dict[str, int]:
    """{split: pairs} of a stats.json, refused in one line unless it is the file prepare-quora
    writes: seqio sizes its shuffling and epochs by these numbers."""
    text = user_files.read_text(stats_path, what=DATA_DIR_SETTING, max_bytes=MAX_STATS_BYTES)
    try:
        stats = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise _not_stats(stats_path, data_dir, f"not JSON: {e}") from None
    pairs = stats.get("pairs") if isinstance(stats, dict) else None
    if not isinstance(pairs, dict):
        raise _not_stats(stats_path, data_dir, "no 'pairs' object")
    for split in quora_csv.SPLITS:
        count = pairs.get(split)
        if not validators.is_whole(count, low=0):
            raise _not_stats(stats_path, data_dir, f"pairs[{split!r}] is not a count")
    return {split: pairs[split] for split in quora_csv.SPLITS}


def _not_stats(stats_path: str, data_dir: str, why: str) -> UserError:
    return UserError(
        f"{stats_path} is not the stats.json `t5tpu prepare-quora` writes ({why[:200]}); run it "
        f"again with --output_dir={data_dir} --overwrite, or fix QUORA_DATA_DIR"
    )


def _pairs_source() -> seqio.DataSource:
    data_dir = quora_data_dir()
    return _prepared_source(data_dir) if data_dir else _sample_source()


def _tfds_source() -> seqio.DataSource:
    # glue/qqp's test split has no labels (-1), so only train and validation are offered.
    source = seqio.TfdsDataSource(
        TFDS_NAME, tfds_data_dir=qqp_tfds_data_dir(), splits=quora_csv.SPLITS
    )
    setattr(source, availability.DATA_DIR_BINDING, "qqp_tfds_data_dir.path")
    return source


def from_glue_features(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """glue/qqp's {idx, question1, question2, label} -> the fields the Quora sources have."""

    def rename(example: dict) -> dict:
        return {
            "id": tf.cast(example["idx"], tf.int64),
            "question1": example["question1"],
            "question2": example["question2"],
            "is_duplicate": tf.cast(example["label"], tf.int64),
        }

    return dataset.map(rename, num_parallel_calls=tf.data.AUTOTUNE)


# --- preprocessors ---------------------------------------------------------------------------


@gin.configurable
def normalize_questions(normalize: bool = True) -> bool:
    """Whether the tasks lower-case the questions and remove double quotes, as the original
    recipe did. Bind `normalize_questions.normalize = False` to train on the text as written
    (both tasks); the run's record carries the choice to every front end."""
    return normalize


def normalized(question: str) -> str:
    """A question as the tasks normalize it: lower-cased, double quotes removed."""
    return question.lower().replace('"', "")


def is_duplicate_line(question1: str, question2: str) -> str:
    """A pair in qp_is_duplicate's words, before normalization."""
    return f"is duplicate: {question1} {SEPARATOR} {question2}"


def similar_question_line(question: str) -> str:
    """A question in generate_similar_question's words, before normalization."""
    return f"generate similar question: {question}"


def model_input(line: str, normalize: bool = True) -> str:
    """The model input these tasks make of a line in their words ("is duplicate: Q1 <SEP> Q2",
    "generate similar question: Q"): every question normalized, the separator kept. Training
    makes its inputs with this very function, and so does every front end with a raw line."""
    if not normalize:
        return line
    return SEPARATOR.join(normalized(part) for part in line.split(SEPARATOR))


def format_is_duplicate(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """A pair in text-to-text form: model_input(is_duplicate_line(...)) -> "1" or "0"; the id
    is kept to trace predictions back to pairs."""
    normalize = normalize_questions()

    def inputs(question1: str, question2: str) -> str:
        return model_input(is_duplicate_line(question1, question2), normalize)

    def to_text(example: dict) -> dict:
        return {
            "id": example["id"],
            "inputs": example["inputs"],
            "targets": tf.strings.as_string(example["is_duplicate"]),
        }

    made = registry.with_python_text(
        dataset, inputs, fields=("question1", "question2"), output="inputs"
    )
    return made.map(to_text, num_parallel_calls=tf.data.AUTOTUNE)


def keep_duplicates(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """Only pairs marked duplicate: their second question is a paraphrase of the first."""
    return dataset.filter(lambda example: tf.equal(example["is_duplicate"], 1))


def format_similar_question(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """model_input(similar_question_line(question1)) -> question2 (normalized alike), keeping
    the pair id."""
    normalize = normalize_questions()

    def inputs(question: str) -> str:
        return model_input(similar_question_line(question), normalize)

    def target(question: str) -> str:
        return normalized(question) if normalize else question

    made = registry.with_python_text(dataset, inputs, fields=("question1",), output="inputs")
    made = registry.with_python_text(made, target, fields=("question2",), output="targets")
    return made.map(
        lambda ex: {"id": ex["id"], "inputs": ex["inputs"], "targets": ex["targets"]},
        num_parallel_calls=tf.data.AUTOTUNE,
    )


def strip_output(output: str, example: dict | None = None, is_target: bool = False) -> str:
    """The decoded text without surrounding whitespace, so " 1" and "1" compare equal."""
    del example, is_target
    return output.strip()


# --- registration ----------------------------------------------------------------------------

METRICS = {
    TASK_NAME: [metrics.accuracy, metrics.f1_duplicate],
    SIMILAR_TASK_NAME: [metrics.bleu, metrics.exact_match],
}
_FORMATTING = {
    TASK_NAME: [format_is_duplicate],
    SIMILAR_TASK_NAME: [keep_duplicates, format_similar_question],
}


def _add_task(name: str, source, first_steps: list, vocabulary: seqio.Vocabulary) -> seqio.Task:
    """(Re-)registers one task: source -> first_steps -> format (normalized) -> tokenize."""
    kind = name.removesuffix(TFDS_SUFFIX)
    return registry.add_text_task(
        name,
        source=source,
        vocabulary=vocabulary,
        preprocessors=[*first_steps, *_FORMATTING[kind]],
        postprocess_fn=strip_output,
        metric_fns=METRICS[kind],
    )


def _add_mixture(name: str, suffix: str) -> seqio.Mixture:
    seqio.MixtureRegistry.remove(name)
    rates = [(task + suffix, rate) for task, rate in qp_all_rates().items()]
    return seqio.MixtureRegistry.add(name, rates)


def tasks_of(name: str) -> tuple[str, ...] | None:
    """The tasks a run of task or mixture `name` trains on, if `name` is one of these; read
    from the names alone (nothing registered)."""
    suffix = TFDS_SUFFIX if name.endswith(TFDS_SUFFIX) else ""
    kind = name.removesuffix(suffix)
    if kind == MIXTURE_NAME:
        return tuple(task + suffix for task in (TASK_NAME, SIMILAR_TASK_NAME))
    return (name,) if kind in (TASK_NAME, SIMILAR_TASK_NAME) else None


def register(vocabulary: seqio.Vocabulary) -> list[str]:
    """(Re-)registers every Quora task and mixture with `vocabulary`; returns their names.

    Sources are chosen now, from what gin binds, and read only when a dataset is requested, so
    registering the tfds tasks needs neither the network nor the data.
    """
    registered = []
    for suffix, source, first_steps in (
        ("", _pairs_source(), []),
        (TFDS_SUFFIX, _tfds_source(), [from_glue_features]),
    ):
        for kind in (TASK_NAME, SIMILAR_TASK_NAME):
            registered.append(_add_task(kind + suffix, source, first_steps, vocabulary))
        registered.append(_add_mixture(MIXTURE_NAME + suffix, suffix))
    return [item.name for item in registered]


# --- asking a trained model ------------------------------------------------------------------
# The routes put the questions in the tasks' words; the model normalizes them as its run did
# (model_input, with the run's normalize_questions, as it shapes every raw input).


def _is_positive(prediction: str) -> bool:
    return strip_output(prediction) == metrics.POSITIVE_LABEL


IS_DUPLICATE = serving.Route(
    name="is_duplicate",
    task=TASK_NAME,
    aliases=(TASK_NAME + TFDS_SUFFIX,),
    fields=(serving.Field("question1"), serving.Field("question2")),
    prompt=is_duplicate_line,
    respond=_is_positive,
    decoding={"max_new_tokens": 4},  # "1" or "0" and EOS
)
SIMILAR_QUESTION = serving.Route(
    name="similar_question",
    task=SIMILAR_TASK_NAME,
    aliases=(SIMILAR_TASK_NAME + TFDS_SUFFIX,),
    fields=(serving.Field("question"),),
    prompt=similar_question_line,
)


def routes() -> tuple[serving.Route, ...]:
    """What `t5tpu serve` offers for these tasks: POST /v1/is_duplicate and
    /v1/similar_question."""
    return (IS_DUPLICATE, SIMILAR_QUESTION)


def is_duplicate(
    model: registry.TextModel, question1: str, question2: str, *, check_task: bool = True
) -> bool:
    """Whether a model trained on qp_is_duplicate takes the two questions to ask the same thing
    (a model trained on another task is refused unless check_task=False)."""
    values = {"question1": question1, "question2": question2}
    return IS_DUPLICATE.ask(model, values, check_task=check_task)


def similar_question(
    model: registry.TextModel, question: str, *, check_task: bool = True, **decoding_settings
) -> str:
    """A question like `question`, from a model trained on generate_similar_question;
    decoding_settings are T5Model.predict's (num_beams, temperature, ...)."""
    values = {"question": question}
    return SIMILAR_QUESTION.ask(model, values, check_task=check_task, **decoding_settings)
