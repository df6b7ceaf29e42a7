"""A user task module, loaded through MIXTURE_OR_TASK_MODULE by the CLI tests.

`memorize_similar_questions`: 32 duplicate pairs of the bundled Quora sample, input
"generate similar question: <q1>", target <q2>; metric exact match (percentage).
"""

import itertools

import seqio
import tensorflow as tf
from t5tpu.tasks import quora_csv

from t5tpu import package_files
from t5tpu.data import vocab

SAMPLE = package_files.asset("quora_sample", "train.tsv")
NUM_PAIRS = 32


def _pairs():
    duplicates = (p for p in quora_csv.read_pairs(SAMPLE) if p["is_duplicate"] == "1")
    return [
        (p["question1"].lower(), p["question2"].lower())
        for p in itertools.islice(duplicates, NUM_PAIRS)
    ]


def _dataset(split, shuffle_files, seed=None):
    del split, shuffle_files, seed
    inputs, targets = zip(*_pairs(), strict=True)
    return tf.data.Dataset.from_tensor_slices(
        {"inputs": ["generate similar question: " + q for q in inputs], "targets": list(targets)}
    )


def exact_match(targets, predictions):
    return {
        "exact_match": 100.0
        * sum(t == p for t, p in zip(targets, predictions, strict=True))
        / len(targets)
    }


vocabulary = vocab.default_vocabulary()
seqio.TaskRegistry.remove("memorize_similar_questions")
seqio.TaskRegistry.add(
    "memorize_similar_questions",
    source=seqio.FunctionDataSource(
        _dataset, splits=["train"], num_input_examples={"train": NUM_PAIRS}
    ),
    preprocessors=[
        seqio.preprocessors.tokenize,
        seqio.preprocessors.append_eos_after_trim,
    ],
    output_features={
        "inputs": seqio.Feature(vocabulary, add_eos=True),
        "targets": seqio.Feature(vocabulary, add_eos=True),
    },
    metric_fns=[exact_match],
)
