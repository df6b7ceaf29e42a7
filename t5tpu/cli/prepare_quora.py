"""`t5tpu prepare-quora`: the full Quora question pairs as TFRecord splits for the Quora tasks.

The reading, splitting and writing are t5tpu.tasks.quora_csv's (which loads TensorFlow only when
it reads or writes); this module is the command's flags and what it prints.
"""

from __future__ import annotations

import argparse
import os

from t5tpu.cli.tool_parser import ToolParser
from t5tpu.tasks import quora_csv

NAME = "prepare-quora"
SUMMARY = "the full Quora pairs (Kaggle train.csv or GLUE's QQP TSV) as TFRecord splits"
EXAMPLE = "t5tpu prepare-quora --input=train.csv --output_dir=gs://my-bucket/quora"
# How many rejected rows the command prints; stats.json lists them all.
_PRINTED_REJECTIONS = 20


def parser() -> ToolParser:
    parser = ToolParser(
        prog=f"t5tpu {NAME}",
        description="Split Quora question pairs (Kaggle train.csv or a QQP TSV, local or gs://) "
        "into TFRecord train/validation files (about 10% validation, by a hash of the pair id) "
        "and stats.json. Set QUORA_DATA_DIR to the output directory to train on them.",
        example=EXAMPLE,
    )
    parser.add_argument(
        "--input", required=True, metavar="PATH", help="train.csv or a .tsv; local or gs://"
    )
    parser.add_argument(
        "--output_dir", required=True, metavar="DIR", help="where the splits go; local or gs://"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace existing output")
    parser.add_argument(
        "--quoting",
        choices=("csv", "none"),
        default="csv",
        help="csv: fields may be quoted and hold commas, tabs and newlines, as in "
        "Kaggle's train.csv and Quora's TSV release; none: one record per line and quotes are "
        "text, as GLUE's QQP files are written",
    )
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    return parser().parse_args(argv)


def run(args: argparse.Namespace) -> int:
    stats = quora_csv.prepare(
        input_path=args.input,
        output_dir=args.output_dir,
        overwrite=args.overwrite,
        quoting=args.quoting,
    )
    print(summary(stats, args.output_dir), flush=True)
    return 0


def main(argv: list[str]) -> int:
    """`t5tpu prepare-quora --input=PATH --output_dir=DIR [--overwrite]`, in this process."""
    return run(parse_args(argv))


def summary(stats: quora_csv.PrepareStats, output_dir: str) -> str:
    """What the command prints: counts per split, duplicate fraction and the rejected rows."""
    lines = [
        f"read {stats.input} ({stats.format})",
        *(
            f"{split}: {stats.pairs[split]} pairs, {stats.duplicates[split]} duplicates -> "
            f"{os.path.join(output_dir, quora_csv.OUTPUT_FILES[split])}"
            for split in quora_csv.SPLITS
        ),
        f"duplicates: {stats.duplicate_fraction:.1%} of {sum(stats.pairs.values())} pairs",
        f"rejected: {len(stats.rejected)} rows",
    ]
    lines += [f"  {r.describe()}" for r in stats.rejected[:_PRINTED_REJECTIONS]]
    if len(stats.rejected) > _PRINTED_REJECTIONS:
        lines.append(f"  ... all {len(stats.rejected)} are listed in {quora_csv.STATS_FILE}")
    if stats.blank_lines:
        lines.append(
            f"blank lines skipped: {len(stats.blank_lines)} (listed in {quora_csv.STATS_FILE})"
        )
    return "\n".join(lines)
