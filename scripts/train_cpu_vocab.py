"""Trains the small SentencePiece vocabulary that t5tpu's CPU models use.

A unigram model of exactly 1,024 pieces with T5's special ids (pad 0, eos 1, unk 2, no bos),
trained on the questions of the bundled Quora sample plus the task prompts and labels. Training
is deterministic (one thread, every sentence in file order, fixed seed), so re-running this
script reproduces the shipped file byte for byte; tests/test_quora_task.py checks that.

    python scripts/train_cpu_vocab.py [--sample_dir DIR] [--out PATH]
"""

import argparse
import os
import sys

import sentencepiece as spm

PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, PROJECT_ROOT)  # lets the script run from a checkout without installing

from t5tpu.tasks import quora_csv  # noqa: E402

DEFAULT_SAMPLE_DIR = os.path.join(PROJECT_ROOT, "t5tpu", "assets", "quora_sample")
DEFAULT_OUT = os.path.join(PROJECT_ROOT, "t5tpu", "assets", "cpu_vocab.model")
VOCAB_SIZE = 1024
SEPARATOR = "<SEP>"
# The prompts and labels the tasks write around the questions. Repeating them makes the trainer
# keep their words as whole pieces ("0" and "1" become one token each), so they cost few tokens.
TASK_STRINGS = (
    "is duplicate:",
    "generate similar question:",
    "question:",
    "context:",
    SEPARATOR,
    "0",
    "1",
)
TASK_STRING_REPEATS = 20
SEED = 20240101


def training_sentences(sample_dir: str) -> list[str]:
    """Both questions of every pair in the sample (train, then validation), then task strings."""
    sentences = []
    for split in quora_csv.SPLITS:
        for pair in quora_csv.read_pairs(os.path.join(sample_dir, f"{split}.tsv")):
            sentences += [pair["question1"], pair["question2"]]
    return sentences + list(TASK_STRINGS) * TASK_STRING_REPEATS


def train_vocabulary(sample_dir: str) -> bytes:
    """Returns the serialized SentencePiece model trained on the sample in `sample_dir`."""
    spm.set_random_generator_seed(SEED)
    model = _BytesWriter()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(training_sentences(sample_dir)),
        model_writer=model,  # the model comes back in memory: no stray .vocab file is written
        model_type="unigram",
        vocab_size=VOCAB_SIZE,
        pad_id=0,
        eos_id=1,
        unk_id=2,
        bos_id=-1,
        # The separator is one piece; otherwise the script boundaries in "<SEP>" split it in five.
        user_defined_symbols=[SEPARATOR],
        # Every character of the sample gets a piece, so the demo data never decodes to <unk>.
        character_coverage=1.0,
        # Determinism: one thread, all sentences in order, no sampling.
        num_threads=1,
        input_sentence_size=0,
        shuffle_input_sentence=False,
        minloglevel=2,
    )
    return model.data


class _BytesWriter:
    """The writer SentencePiece's trainer calls with the serialized model."""

    def __init__(self) -> None:
        self.data = b""

    def write(self, data: bytes) -> None:
        self.data += data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sample_dir", default=DEFAULT_SAMPLE_DIR, help="train/validation TSVs")
    parser.add_argument("--out", default=DEFAULT_OUT, help="where the .model file goes")
    args = parser.parse_args()

    model = train_vocabulary(args.sample_dir)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "wb") as file:
        file.write(model)
    print(f"wrote {args.out} ({len(model)} bytes, {VOCAB_SIZE} pieces)")


if __name__ == "__main__":
    main()
