"""SQuAD v1.1 and v2.0 as text-to-text seqio tasks, squad_v1 and squad_v2, and `answer`, which
asks a model trained on them.

Input "question: <question> context: <context>" (T5's format), target the first gold answer;
every gold answer is kept in the feature "answers" for scoring (t5tpu.tasks.squad_metrics).
v2.0's unanswerable questions have the target NO_ANSWER ("unanswerable"), which is scored as the
empty answer. Sources are official JSON files bound in gin (squad_v1_source / squad_v2_source),
else tensorflow-datasets' squad/v1.1 and squad/v2.0. Long contexts are truncated, question first,
not split into windows (docs/PERFORMANCE.md, "SQuAD", says how many answers that loses).
"""

from __future__ import annotations

import functools
import json

import gin
from t5tpu.tasks import registry, squad_metrics

from t5tpu.errors import UserError
from t5tpu.runtime.lazy_imports import seqio, tf

V1_TASK = "squad_v1"
V2_TASK = "squad_v2"
NO_ANSWER = "unanswerable"
SPLITS = ("train", "validation")
TFDS_NAMES = {V1_TASK: "squad/v1.1:3.0.0", V2_TASK: "squad/v2.0:3.0.0"}
_MACROS = {V1_TASK: "SQUAD_V1", V2_TASK: "SQUAD_V2"}


# --- reading the official JSON format -------------------------------------------------------


@functools.cache
def read_squad_json(path: str, require_answers: bool) -> dict[str, list]:
    """One row per question of an official SQuAD JSON file, as columns.

    Answer texts and starts are lists of lists (empty for v2.0's unanswerable questions).
    With require_answers (v1.1), a question without answers is an error.
    """
    if not tf.io.gfile.exists(path):
        raise UserError(f"SQuAD file not found: {path}; bind an existing dev-v1.1.json-format file")
    with tf.io.gfile.GFile(path) as f:
        try:
            articles = json.loads(f.read())["data"]
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError):
            raise UserError(
                f"{path} is not SQuAD JSON: expected {{'data': [articles]}} as in dev-v1.1.json"
            ) from None
    columns = {k: [] for k in ("id", "title", "context", "question", "text", "answer_start")}
    try:
        for article in articles:
            for paragraph in article["paragraphs"]:
                for qa in paragraph["qas"]:
                    _append_question(columns, article, paragraph, qa, path, require_answers)
    except (KeyError, TypeError) as e:
        raise UserError(
            f"{path}: a question misses field {e}; expected the dev-v1.1.json format"
        ) from None
    if not columns["id"]:
        raise UserError(f"{path} holds no questions; point it at a SQuAD JSON file")
    return columns


def _append_question(columns, article, paragraph, qa, path, require_answers) -> None:
    answers = qa["answers"]
    if require_answers and not answers:
        raise UserError(
            f"{path}: question {qa['id']} has no answer, which SQuAD v1.1 does not allow; "
            "use squad_v2 (SQUAD_V2_* files) for data with unanswerable questions"
        )
    columns["id"].append(qa["id"])
    columns["title"].append(article.get("title", ""))
    columns["context"].append(paragraph["context"])
    columns["question"].append(qa["question"])
    columns["text"].append([answer["text"] for answer in answers])
    columns["answer_start"].append([int(answer["answer_start"]) for answer in answers])


def _json_dataset(columns: dict) -> tf.data.Dataset:
    """The columns as a dataset with tfds' squad features, so both sources share preprocessing."""
    return tf.data.Dataset.from_tensor_slices(
        {
            # tf.constant first: from_tensor_slices converts Python lists much more slowly.
            **{key: tf.constant(columns[key]) for key in ("id", "title", "context", "question")},
            "answers": {
                "text": _ragged(columns["text"], tf.string),
                "answer_start": _ragged(columns["answer_start"], tf.int32),
            },
        }
    )


def _ragged(rows: list[list], dtype: tf.DType) -> tf.RaggedTensor:
    """Rows of different lengths (built from flat values: tf.ragged.constant is slow)."""
    flat = [value for row in rows for value in row]
    values = tf.constant(flat, dtype=dtype) if flat else tf.zeros([0], dtype=dtype)
    return tf.RaggedTensor.from_row_lengths(values, [len(row) for row in rows])


# --- choosing the source in gin -------------------------------------------------------------


def _json_source(task_name: str, files: dict[str, str | None]) -> seqio.DataSource:
    require_answers = task_name == V1_TASK
    loaded = {
        split: read_squad_json(path, require_answers) for split, path in files.items() if path
    }

    def dataset_fn(split: str, shuffle_files: bool, seed: int | None = None) -> tf.data.Dataset:
        del shuffle_files, seed  # one file per split; the Task shuffles examples when asked
        if split not in loaded:
            raise UserError(
                f"{task_name} has no {split} file: set {_MACROS[task_name]}_{split.upper()}_FILE"
                f" (or bind no file at all to read tfds {TFDS_NAMES[task_name]})"
            )
        return _json_dataset(loaded[split])

    return seqio.FunctionDataSource(
        dataset_fn=dataset_fn,
        splits=SPLITS,
        num_input_examples={split: len(columns["id"]) for split, columns in loaded.items()},
    )


def _source(task_name, train_file, validation_file, tfds_data_dir) -> seqio.DataSource:
    if train_file or validation_file:
        return _json_source(task_name, {"train": train_file, "validation": validation_file})
    return seqio.TfdsDataSource(
        tfds_name=TFDS_NAMES[task_name], tfds_data_dir=tfds_data_dir, splits=SPLITS
    )


@gin.configurable
def squad_v1_source(
    train_file: str | None = None,
    validation_file: str | None = None,
    tfds_data_dir: str | None = None,
) -> seqio.DataSource:
    """SQuAD v1.1 from official JSON files if any is given, else from tfds squad/v1.1."""
    return _source(V1_TASK, train_file, validation_file, tfds_data_dir)


@gin.configurable
def squad_v2_source(
    train_file: str | None = None,
    validation_file: str | None = None,
    tfds_data_dir: str | None = None,
) -> seqio.DataSource:
    """SQuAD v2.0 from official JSON files if any is given, else from tfds squad/v2.0."""
    return _source(V2_TASK, train_file, validation_file, tfds_data_dir)


# --- preprocessing and postprocessing -------------------------------------------------------


def format_question_context(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """tfds squad features -> {"inputs", "targets", "answers", "id", "question", "context"}."""

    def to_text(example: dict) -> dict:
        answers = example["answers"]["text"]
        target = tf.cond(tf.size(answers) > 0, lambda: answers[0], lambda: tf.constant(NO_ANSWER))
        inputs = tf.strings.join(
            ["question: ", example["question"], " context: ", example["context"]]
        )
        return {
            "id": example["id"],
            "question": example["question"],
            "context": example["context"],
            "inputs": inputs,
            "targets": target,
            "answers": answers,
        }

    return dataset.map(to_text, num_parallel_calls=tf.data.AUTOTUNE)


def postprocess_v1(output: str, example: dict | None = None, is_target: bool = False):
    """A prediction without surrounding whitespace; for a target, every gold answer."""
    if is_target:
        return _gold_answers(example)
    return output.strip()


def postprocess_v2(output: str, example: dict | None = None, is_target: bool = False):
    """As postprocess_v1, and the NO_ANSWER prediction becomes "", v2's empty answer."""
    if is_target:
        return _gold_answers(example)
    prediction = output.strip()
    return "" if prediction == NO_ANSWER else prediction


def _gold_answers(example: dict | None) -> list[str]:
    if example is None or "answers" not in example:
        raise ValueError("scoring SQuAD needs the example's 'answers' feature")
    return [a.decode("utf-8") if isinstance(a, bytes) else str(a) for a in example["answers"]]


# --- registration ---------------------------------------------------------------------------


def _add_task(name, source, vocabulary, postprocess_fn, metric_fn) -> seqio.Task:
    return registry.add_text_task(
        name,
        source=source,
        vocabulary=vocabulary,
        preprocessors=[format_question_context],
        postprocess_fn=postprocess_fn,
        metric_fns=[metric_fn],
    )


def register(vocabulary: seqio.Vocabulary) -> list[seqio.Task]:
    """(Re-)registers squad_v1 and squad_v2 with `vocabulary`, reading their sources from gin."""
    return [
        _add_task(V1_TASK, squad_v1_source(), vocabulary, postprocess_v1, squad_metrics.squad_v1),
        _add_task(V2_TASK, squad_v2_source(), vocabulary, postprocess_v2, squad_metrics.squad_v2),
    ]


# --- asking a trained model -----------------------------------------------------------------


def answer_prompt(question: str, context: str, *, task: str = V1_TASK) -> str:
    """The input that `task` (squad_v1 or squad_v2) makes of a question and its context."""
    return registry.preprocessed_input(
        task,
        {
            "id": "",
            "title": "",
            "question": question,
            "context": context,
            # Only the target is made from the answers: a placeholder answer (an empty list has
            # a static shape the format step cannot index in graph mode).
            "answers": {"text": tf.constant([""]), "answer_start": tf.constant([0], tf.int32)},
        },
    )


def answer(
    model: registry.TextModel,
    question: str,
    context: str,
    *,
    task: str = V1_TASK,
    **decoding_settings,
) -> str:
    """A SQuAD-trained model's answer ("" when a squad_v2 model finds none in the context);
    decoding_settings are T5Model.predict's (num_beams, max_length, ...)."""
    prompt = answer_prompt(question, context, task=task)
    prediction = model.predict([prompt], **decoding_settings)[0]
    return registry.get_task(task).postprocess_fn(prediction, example=None, is_target=False)
