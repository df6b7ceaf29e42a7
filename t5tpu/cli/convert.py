"""`t5tpu convert`: pretrained T5 weights in (Hugging Face, T5X, Mesh TF) and out (Hugging Face).

    t5tpu convert [--from={hf,t5x,mesh_tf}] --input=PATH --output_dir=DIR [--overwrite]
    t5tpu convert --to=hf --input=CHECKPOINT --output_dir=DIR [--gin_file=MODEL_GIN ...]
        [--lora={merged,adapters,base}]
    t5tpu convert --lora=adapters --input=LORA_CHECKPOINT --output_dir=DIR

--lora writes Hugging Face files (--to=hf is implied).

This module is the command's flags; the conversion is t5tpu.formats.conversion's, imported once
the flags have been parsed (it loads jax, orbax and TensorFlow).
"""

from __future__ import annotations

import argparse

from t5tpu.cli.tool_parser import ToolParser
from t5tpu.errors import UserError

NAME = "convert"
SUMMARY = "pretrained weights in (Hugging Face, T5X, Mesh TF) and out (--to=hf)"
EXAMPLE = "t5tpu convert --input=/path/to/hf_t5_dir --output_dir=/tmp/t5_base"
# The formats --from names: t5tpu.formats.loader.IMPORTERS' keys, and t5tpu's own.
SOURCES = ("hf", "t5x", "mesh_tf", "t5tpu")
_DESCRIPTION = """\
Convert T5 checkpoints. By default a Hugging Face directory, a T5X checkpoint_<step> or a Mesh TF \
model.ckpt-<step> becomes DIR/checkpoint_<step> (orbax, parameters only) plus DIR/model.gin (the \
model's geometry, its vocabulary if the source has one, and INITIAL_CHECKPOINT_PATH): fine-tune \
it with `t5tpu train --gin_file=EXPERIMENT.gin --gin_file=DIR/model.gin`.

With --to=hf, a t5tpu checkpoint_<step> (or a MODEL_DIR's newest) becomes a Hugging Face \
directory; what shapes cannot tell (gated activation, relative position distance, vocabulary) \
comes from --gin_file, else from the model.gin or config.gin beside the checkpoint. A LoRA run's \
checkpoint (or MODEL_DIR) is written merged into its base, or with --lora=adapters as its adapters \
in PEFT's format (adapter_config.json + adapter_model.safetensors), which PEFT loads onto \
--lora=base: the base as the adapters were trained on it (rounded to lora.base_dtype), so that \
PEFT answers as t5tpu does; --lora implies --to=hf."""


def parser() -> ToolParser:
    parser = ToolParser(prog=f"t5tpu {NAME}", description=_DESCRIPTION, example=EXAMPLE)
    parser.add_argument(
        "--from",
        dest="source",
        choices=SOURCES,
        help="format of --input (default: detected)",
    )
    parser.add_argument(
        "--to", choices=["t5tpu", "hf"], help="format to write (default: t5tpu; hf with --lora)"
    )
    parser.add_argument(
        "--input", required=True, metavar="PATH", help="checkpoint to read (local or gs://)"
    )
    parser.add_argument("--output_dir", required=True, metavar="DIR", help="directory to write")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace --output_dir if it is not empty"
    )
    parser.add_argument(
        "--gin_file",
        action="append",
        default=[],
        metavar="FILE",
        help="--to=hf: the model's gin file(s) (default: model.gin or config.gin beside it)",
    )
    parser.add_argument(
        "--lora",
        choices=["merged", "adapters", "base"],
        help="a LoRA run's checkpoint to Hugging Face: the base with the adapters merged "
        "(the default), the adapters alone in PEFT's format, or the base they were trained on "
        "(for PEFT)",
    )
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    args = parser().parse_args(argv)
    # model.gin records the command that wrote it.
    args.command = " ".join(["t5tpu", NAME, *argv])
    return args


def run(args: argparse.Namespace) -> int:
    from t5tpu.formats import conversion

    if args.lora and args.to == "t5tpu":
        raise UserError(f"--lora={args.lora} writes Hugging Face files; drop --to=t5tpu")
    if args.lora or args.to == "hf":
        conversion.to_hf(
            input_path=args.input,
            output_dir=args.output_dir,
            source=args.source,
            overwrite=args.overwrite,
            gin_files=args.gin_file,
            lora_output=args.lora or "merged",
        )
    else:
        conversion.to_t5tpu(
            input_path=args.input,
            output_dir=args.output_dir,
            source=args.source,
            overwrite=args.overwrite,
            command=args.command,
        )
    return 0


def main(argv: list[str]) -> int:
    """`t5tpu convert ...`, in this process."""
    return run(parse_args(argv))
