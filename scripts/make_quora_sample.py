"""Writes the Quora sample that t5tpu ships: pairs 0..999, split into train and validation.

Rows are copied byte for byte from the source file; which split a pair goes to is decided by
`t5tpu.tasks.quora_csv.is_validation_pair`, so re-running this script gives identical files.

    python scripts/make_quora_sample.py [--source PATH] [--out_dir DIR]
"""

import argparse
import os
import sys

PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, PROJECT_ROOT)  # lets the script run from a checkout without installing

from t5tpu.tasks import quora_csv  # noqa: E402

DEFAULT_SOURCE = os.path.join(
    PROJECT_ROOT, "..", "shared", "data", "quora", "quora_duplicate_questions_first8000.tsv"
)
DEFAULT_OUT_DIR = os.path.join(PROJECT_ROOT, "t5tpu", "assets", "quora_sample")
SAMPLE_SIZE = 1000


def sample_pairs(source: str) -> list[dict[str, str]]:
    """The pairs with ids 0..SAMPLE_SIZE-1, in file order; fails if any is missing."""
    pairs = [p for p in quora_csv.read_pairs(source) if int(p["id"]) < SAMPLE_SIZE]
    ids = sorted(int(p["id"]) for p in pairs)
    if ids != list(range(SAMPLE_SIZE)):
        raise SystemExit(f"{source}: expected each of ids 0..{SAMPLE_SIZE - 1} exactly once")
    return pairs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", default=DEFAULT_SOURCE, help="Quora question pairs TSV")
    parser.add_argument("--out_dir", default=DEFAULT_OUT_DIR, help="where the splits go")
    args = parser.parse_args()

    pairs = sample_pairs(args.source)
    os.makedirs(args.out_dir, exist_ok=True)
    for split in quora_csv.SPLITS:
        rows = [p for p in pairs if quora_csv.split_of_pair(int(p["id"])) == split]
        path = os.path.join(args.out_dir, f"{split}.tsv")
        quora_csv.write_pairs(path, rows)
        duplicates = sum(int(p["is_duplicate"]) for p in rows)
        print(f"{split}: {len(rows)} pairs, {duplicates / len(rows):.1%} duplicates -> {path}")
    total_duplicates = sum(int(p["is_duplicate"]) for p in pairs)
    print(f"all: {len(pairs)} pairs, {total_duplicates / len(pairs):.1%} duplicates")


if __name__ == "__main__":
    main()
