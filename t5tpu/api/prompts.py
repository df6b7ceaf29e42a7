"""Model inputs for the seed notebooks' helpers (answer, is_duplicate, similar_question), made by
the registered task's own preprocessing, so a prompt is exactly what the model saw in training
(with Quora's lower-casing, or not, as `normalize_questions.normalize` is bound in gin).

A raw example goes through the task's preprocessors up to tokenization (seqio's
`preprocess_precache`); seqio's tokenizer keeps the text as `inputs_pretokenized`.
"""

from __future__ import annotations

from t5tpu.runtime.lazy_imports import tf
from t5tpu.tasks import metrics, quora, registry, squad

SQUAD_V1 = squad.V1_TASK
POSITIVE_LABEL = metrics.POSITIVE_LABEL


def _task_input(task_name: str, example: dict) -> str:
    task = registry.get_task(task_name)
    dataset = task.preprocess_precache(tf.data.Dataset.from_tensors(example))
    (processed,) = list(dataset.as_numpy_iterator())
    return processed["inputs_pretokenized"].decode("utf-8")


def quora_pair(question1: str, question2: str) -> str:
    return _task_input(
        quora.TASK_NAME,
        {
            "id": tf.constant(0, tf.int64),
            "question1": question1,
            "question2": question2,
            "is_duplicate": tf.constant(0, tf.int64),
        },
    )


def similar_question(question: str) -> str:
    # The task keeps duplicate pairs only: the placeholder pair is marked as one.
    return _task_input(
        quora.SIMILAR_TASK_NAME,
        {
            "id": tf.constant(0, tf.int64),
            "question1": question,
            "question2": question,
            "is_duplicate": tf.constant(1, tf.int64),
        },
    )


def squad(question: str, context: str, *, task: str = SQUAD_V1) -> str:
    return _task_input(
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


def postprocess(task_name: str, prediction: str) -> str:
    """The task's own post-processing of a prediction (SQuAD v2's 'unanswerable' -> '')."""
    return registry.get_task(task_name).postprocess_fn(prediction, example=None, is_target=False)
