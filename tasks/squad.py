"""SQuAD v1.1 and v2.0 as text-to-text seqio tasks, squad_v1 and squad_v2, and `answer`, which
asks a model trained on them.

Input "question: <question> context: <context>" (T5's format), target the first gold answer;
every gold answer is kept in the feature "answers" for scoring (t5tpu.tasks.squad_metrics).
v2.0's unanswerable questions have the target NO_ANSWER ("unanswerable"), which is scored as the
empty answer. Sources are official JSON files bound in gin (squad_v1_source / squad_v2_source),
else tensorflow-datasets' squad/v1.1 and squad/v2.0. Long contexts are truncated, question first,
not split into windows (docs/PERFORMANCE.md, "SQuAD", says how many answers that loses).
`routes` offers `answer` to `t5tpu serve`.
"""

from __future__ import annotations

import functools

import gin
from t5tpu.tasks import registry, serving, squad_metrics

from t5tpu import validators
from t5tpu.data import availability
from t5tpu.errors import UserError
from t5tpu.runtime.lazy_imports import seqio, tf
from t5tpu.storage import remote, user_files

V1_TASK = "squad_v1"
V2_TASK = "squad_v2"
NO_ANSWER = "unanswerable"
SPLITS = ("train", "validation")
TFDS_NAMES = {V1_TASK: "squad/v1.1:3.0.0", V2_TASK: "squad/v2.0:3.0.0"}
_MACROS = {V1_TASK: "SQUAD_V1", V2_TASK: "SQUAD_V2"}
WHAT = "SQuAD file"


# --- reading the official JSON format -------------------------------------------------------


@functools.cache
def read_squad_json(path: str, require_answers: bool, setting: str = WHAT) -> dict[str, list]:
    """One row per question of an official SQuAD JSON file, as columns.

    Answer texts and starts are lists of lists (empty for v2.0's unanswerable questions).
    With require_answers (v1.1), a question without answers is an error. The file is read
    through the storage layer (a gs:// one within the storage answer time) and every field
    the task uses is checked for its type here: a wrong one would otherwise fail inside tf.data.
    `setting` names the binding that gave `path`.
    """
    if not remote.is_file(path, setting):
        raise UserError(f"SQuAD file not found: {path}; bind an existing dev-v1.1.json-format file")
    document = user_files.read_json(path, what=WHAT)
    articles = _fields(document, {"data": list}, path, "the file")[0]
    columns = {k: [] for k in ("id", "title", "context", "question", "text", "answer_start")}
    for a, article in enumerate(articles):
        where = f"article {a}"
        (paragraphs,) = _fields(article, {"paragraphs": list}, path, where)
        (title,) = _fields({"title": "", **article}, {"title": str}, path, where)
        for p, paragraph in enumerate(paragraphs):
            where = f"paragraph {p} of article {a}"
            context, qas = _fields(paragraph, {"context": str, "qas": list}, path, where)
            for q, qa in enumerate(qas):
                question = _question(qa, path, f"question {q} of {where}", require_answers)
                columns["title"].append(title)
                columns["context"].append(context)
                for key, value in question.items():
                    columns[key].append(value)
    if not columns["id"]:
        raise UserError(f"{path} holds no questions; point it at a SQuAD JSON file")
    return columns


def _question(qa, path: str, where: str, require_answers: bool) -> dict:
    """One question's id, question, answer texts and starts, each of the type SQuAD gives it."""
    qa_id, question, answers = _fields(
        qa, {"id": str, "question": str, "answers": list}, path, where
    )
    if require_answers and not answers:
        raise UserError(
            f"{path}: question {qa_id} has no answer, which SQuAD v1.1 does not allow; "
            "use squad_v2 (SQUAD_V2_* files) for data with unanswerable questions"
        )
    checked = [
        _fields(answer, {"text": str, "answer_start": int}, path, f"answer {i} of {where}")
        for i, answer in enumerate(answers)
    ]
    return {
        "id": qa_id,
        "question": question,
        "text": [text for text, _ in checked],
        "answer_start": [start for _, start in checked],
    }


def _fields(value, expected: dict[str, type], path: str, where: str) -> list:
    """value[key] for each key of `expected`, which must be there with that type (a JSON
    true/false is not a number)."""
    if not isinstance(value, dict):
        raise _not_squad(path, f"{where} is {_json_type(value)}, not an object")
    found = []
    for key, kind in expected.items():
        if key not in value:
            raise _not_squad(path, f"{where} has no {key!r}")
        item = value[key]
        if not validators.is_instance(item, kind):
            raise _not_squad(
                path, f"{where}'s {key!r} is {_json_type(item)}, not {_JSON_TYPES[kind]}"
            )
        unfit = _unfit_for_tensorflow(item)
        if unfit:
            raise _not_squad(path, f"{where}'s {key!r} {unfit}")
        found.append(item)
    return found


_JSON_TYPES = {
    dict: "an object",
    list: "a list",
    str: "a string",
    int: "an integer",
    float: "a number",
    bool: "true/false",
    type(None): "null",
}


def _json_type(value) -> str:
    return _JSON_TYPES.get(type(value), type(value).__name__)


def _unfit_for_tensorflow(item) -> str | None:
    """Why tf.constant would refuse the value, else None: text must be UTF-8 (a JSON escape can
    hold a lone surrogate, which is not), an answer start a 32-bit integer."""
    if isinstance(item, str):
        try:
            item.encode("utf-8")
        except UnicodeEncodeError:
            return "holds a lone surrogate escape (\\ud800-\\udfff), which is not text"
    elif isinstance(item, int) and not -(2**31) <= item < 2**31:
        return f"is {item}, beyond a 32-bit integer"
    return None


def _not_squad(path: str, problem: str) -> UserError:
    return UserError(
        f"{path} is not SQuAD JSON: {problem}; expected {{'data': [articles]}} as in dev-v1.1.json"
    )


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
        split: read_squad_json(path, require_answers, _setting(task_name, split))
        for split, path in files.items()
        if path
    }

    def dataset_fn(split: str, shuffle_files: bool, seed: int | None = None) -> tf.data.Dataset:
        del shuffle_files, seed  # one file per split; the Task shuffles examples when asked
        if split not in loaded:
            raise UserError(
                f"{task_name} has no {split} file: set {_setting(task_name, split)}"
                f" (or bind no file at all to read tfds {TFDS_NAMES[task_name]})"
            )
        return _json_dataset(loaded[split])

    return seqio.FunctionDataSource(
        dataset_fn=dataset_fn,
        splits=SPLITS,
        num_input_examples={split: len(columns["id"]) for split, columns in loaded.items()},
    )


def _setting(task_name: str, split: str) -> str:
    """The macro that names a split's file (experiments bind the source's files to it)."""
    return f"{_MACROS[task_name]}_{split.upper()}_FILE"


def _source(task_name, train_file, validation_file, tfds_data_dir) -> seqio.DataSource:
    if train_file or validation_file:
        return _json_source(task_name, {"train": train_file, "validation": validation_file})
    source = seqio.TfdsDataSource(
        tfds_name=TFDS_NAMES[task_name], tfds_data_dir=tfds_data_dir, splits=SPLITS
    )
    setattr(source, availability.DATA_DIR_BINDING, f"{task_name}_source.tfds_data_dir")
    return source


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


def answer_line(question: str, context: str) -> str:
    """T5's SQuAD input: "question: <question> context: <context>". Training makes its inputs
    with this function, and so do `answer` and /v1/answer."""
    return f"question: {question} context: {context}"


def format_question_context(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """tfds squad features -> {"inputs", "targets", "answers", "id", "question", "context"}."""

    def to_text(example: dict) -> dict:
        answers = example["answers"]["text"]
        target = tf.cond(tf.size(answers) > 0, lambda: answers[0], lambda: tf.constant(NO_ANSWER))
        return {
            "id": example["id"],
            "question": example["question"],
            "context": example["context"],
            "inputs": registry.python_text(answer_line, example["question"], example["context"]),
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


def _route(task: str, postprocess_fn) -> serving.Route:
    return serving.Route(
        name="answer",
        task=task,
        fields=(serving.Field("question"), serving.Field("context")),
        prompt=answer_line,
        respond=postprocess_fn,
    )


ANSWER = {V1_TASK: _route(V1_TASK, postprocess_v1), V2_TASK: _route(V2_TASK, postprocess_v2)}


def routes() -> tuple[serving.Route, ...]:
    """What `t5tpu serve` offers: POST /v1/answer, in the words of the SQuAD task the model was
    trained on (squad_v1 when it does not say) unless a request's parameter "task" names one."""
    return tuple(ANSWER.values())


def answer(
    model: registry.TextModel,
    question: str,
    context: str,
    *,
    task: str | None = None,
    check_task: bool = True,
    **decoding_settings,
) -> str:
    """A SQuAD-trained model's answer ("" when a squad_v2 model finds none in the context);
    `task`: squad_v1 or squad_v2, default the one the model was trained on (a model of another
    task is refused unless check_task=False); decoding_settings are T5Model.predict's
    (num_beams, max_length, ...)."""
    if task is not None and task not in ANSWER:
        raise UserError(f"task={task!r}: answer takes {' or '.join(ANSWER)}")
    route = serving.chosen(tuple(ANSWER.values()), task, model.tasks)
    values = {"question": question, "context": context}
    return route.ask(model, values, check_task=check_task, **decoding_settings)
