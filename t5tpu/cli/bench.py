"""`t5tpu bench`: how fast a gin-configured T5 trains, scores and decodes on this machine.

    t5tpu bench --gin_file=configs/models/t5_1_1/small.gin [--compare_hf] [--json] [--gin.N=V]

This module is the command: its flags and its output. The measuring is bench_workloads' (t5tpu),
bench_hf's (--compare_hf), bench_limits' (the machine's limits), bench_kernels' (the workloads'
own matmuls alone), bench_timing's and bench_report's, imported once the flags have been
parsed, since they load jax (and torch).
docs/PERFORMANCE.md records results and how they were taken; the benchmarks beyond these
workloads (infer at scale, CTranslate2, serve under load, a step's profile) are scripts/bench/'s,
each with its command in its header.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os

from t5tpu.bench.workload_names import WORKLOADS
from t5tpu.cli.gin_flags import rewrite_gin_shorthand
from t5tpu.cli.tool_parser import ToolParser
from t5tpu.errors import UserError

NAME = "bench"
SUMMARY = "speed of a model's train step, scoring and decoding (optionally against HF PyTorch)"
EXAMPLE = "t5tpu bench --gin_file=configs/models/t5_1_1/small.gin --compare_hf"
_DESCRIPTION = """\
Measure how fast the model of the gin files trains, scores and decodes on whatever backend JAX \
finds, with random weights and random token ids (no vocabulary is read: it runs offline). \
T5Config.dtype picks the precision (--gin.T5Config.dtype="'float32'" or "'bfloat16'": bfloat16 \
matmul inputs with float32 accumulation, float32 master weights in training, weights cast to \
bfloat16 once for scoring and decoding). One JSON line per result, then a table; with --json, \
only one JSON line per workload.

First the machine's limits, each probed --limit_probes times in this run and taken as the median \
of the best --limit_best: the FLOP/s of a large matmul in float32 and in bfloat16 with float32 \
accumulation, and the memory bandwidth of a streaming sum and of a 1-row GEMV. Every workload \
reports fraction_of_limit against them (train and score against the peak of the model's \
dtype). train: one jit'd train step: compile seconds, median seconds/step after warm-up, \
tokens/s, and achieved FLOP/s over the matmul peak. score: forward pass and per-example \
log-likelihood through the engine `t5tpu eval` and the Python API score with, tokens/s, FLOP/s \
over the peak. greedy, sampling (--temperature, --top_k), beam: the engine's generate, which \
`t5tpu infer`, the Python API and serve run, decoding exactly --decode_length new tokens (EOS \
never stops it), seconds per batch, new tokens/s, and the memory floor of a step (weights and \
caches read once at the measured bandwidth) over the step's time (the prefill, a decode of one \
token timed alone, left out). compile seconds: train's compile; for the engine's workloads, its \
first call less a warm one. Beside each of these, dense_matmul_ms: the workload's own weight \
matmuls timed alone at its shapes, and dense_share, their time over the step's (how much of the \
step is XLA's matmul kernels). pipeline: examples/s the seqio pipeline of a real task delivers \
at the same lengths, against what the train step consumes.

--compare_hf runs the same workloads through Hugging Face transformers' PyTorch \
T5ForConditionalGeneration of the same geometry in the same process, alternating t5tpu and HF \
repetitions so load hits both alike, and reports t5tpu/HF ratios of the medians."""


def parser() -> ToolParser:
    p = ToolParser(prog=f"t5tpu {NAME}", description=_DESCRIPTION, example=EXAMPLE)
    p.add_gin_flags(gin_file_help="model gin file(s)")
    p.add_argument("--batch_size", type=int, default=8, help="examples per train/score batch")
    p.add_argument("--input_length", type=int, default=128, help="tokens per input")
    p.add_argument("--target_length", type=int, default=32, help="tokens per target")
    p.add_argument("--decode_batch_size", type=int, default=None, help="default: --batch_size")
    p.add_argument("--decode_length", type=int, default=32, help="new tokens per example")
    p.add_argument("--num_beams", type=int, default=4, help="beams of the beam workload")
    p.add_argument("--beam_alpha", type=float, default=0.6, help="beam search length penalty")
    p.add_argument("--temperature", type=float, default=1.0, help="of the sampling workload")
    p.add_argument("--top_k", type=int, default=0, help="of the sampling workload (0: all ids)")
    p.add_argument(
        "--optimizer", choices=("adamw", "adafactor"), default="adamw", help="of the train step"
    )
    p.add_argument("--dropout_rate", type=float, default=0.0, help="dropout while training")
    p.add_argument("--steps", type=int, default=10, help="timed repetitions per workload")
    p.add_argument("--warmup", type=int, default=2, help="untimed repetitions before them")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated subset")
    p.add_argument("--compare_hf", action="store_true", help="also run HF PyTorch T5")
    p.add_argument(
        "--compare_float32",
        action="store_true",
        help="also run the bfloat16 model in float32, alternating (bfloat16/float32 ratios)",
    )
    p.add_argument("--matmul_size", type=int, default=None, help="peak probe (CPU 2048, else 8192)")
    p.add_argument(
        "--stream_mb", type=int, default=None, help="bandwidth probes' MiB (CPU 256, else 2048)"
    )
    p.add_argument("--limit_probes", type=int, default=11, help="probes of each machine limit")
    p.add_argument("--limit_best", type=int, default=3, help="limit = median of the best N probes")
    p.add_argument(
        "--json",
        action="store_true",
        help="print only one JSON line per workload (the details still go to --output)",
    )
    p.add_argument("--pipeline_task", default="qp_is_duplicate", help="task of the pipeline")
    p.add_argument("--pipeline_batches", type=int, default=100, help="batches the pipeline times")
    p.add_argument(
        "--pipeline_vocabulary",
        choices=("bundled", "gin"),
        default="bundled",
        help="tokenize with the bundled CPU vocabulary, or the one the gin files bind",
    )
    p.add_argument("--output", default=None, help="also append the JSON lines to this file")
    p.add_argument("--seed", type=int, default=0, help="weights, inputs and dropout")
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    args = parser().parse_args(rewrite_gin_shorthand(argv))
    args.workloads = [w for w in args.workloads.split(",") if w]
    unknown = sorted(set(args.workloads) - set(WORKLOADS))
    if unknown:
        raise UserError(f"unknown workload(s) {', '.join(unknown)}; use {','.join(WORKLOADS)}")
    if args.decode_batch_size is None:
        args.decode_batch_size = args.batch_size
    lengths = (args.input_length, args.target_length, args.decode_length)
    if min(args.batch_size, args.decode_batch_size, *lengths) < 1:
        raise UserError(
            "--batch_size, --decode_batch_size, --input_length, --target_length and "
            "--decode_length must be >= 1"
        )
    if args.steps < 1 or args.warmup < 0 or args.num_beams < 1:
        raise UserError("--steps and --num_beams must be >= 1 and --warmup >= 0")
    if args.temperature <= 0 or args.top_k < 0:
        raise UserError("--temperature must be > 0 and --top_k >= 0 (sampling; greedy is its own)")
    if min(args.limit_probes, args.limit_best, args.stream_mb or 1, args.matmul_size or 1) < 1:
        raise UserError("--limit_probes, --limit_best, --stream_mb and --matmul_size must be >= 1")
    missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
    if args.compare_hf and missing:
        raise UserError(
            f"--compare_hf needs {' and '.join(missing)}: pip install -e '.[parity]' in the "
            "t5tpu checkout"
        )
    return args


def run(args: argparse.Namespace) -> int:
    from t5tpu.bench import report, workloads

    model = workloads.build_model(args)  # gin files parsed before anything is written
    if args.compare_float32:
        workloads.float32_twin(model)  # refused before anything is written
    output = open(args.output, "a") if args.output else None  # noqa: SIM115

    def emit(result: dict) -> None:
        line = json.dumps(result, sort_keys=True)
        if not args.json:  # --json keeps stdout to the summary lines
            print(line, flush=True)
        if output:
            output.write(line + "\n")
            output.flush()

    try:
        emit(report.machine_info() | {"dtype": model.config.dtype, "args": vars(args)})
        results = workloads.run_workloads(args, emit, model)
        emit({"workload": "machine_end", "load_average_1m": os.getloadavg()[0]})
    finally:
        if output:
            output.close()
    if args.json:
        for line in report.summary(results):
            print(json.dumps(line, sort_keys=True), flush=True)
    else:
        print(report.table(results), flush=True)
    return 0


def main(argv: list[str]) -> int:
    """`t5tpu bench ...`, in this process."""
    return run(parse_args(argv))
