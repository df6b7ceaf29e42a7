"""Inference on a large file: examples/s and peak memory of `t5tpu infer`, against an older
checkout of t5tpu, transformers' pipeline and CTranslate2 on the same inputs.

    .venv/bin/python scripts/bench/bench_infer.py --model=tiny --num_inputs=100000
    .venv/bin/python scripts/bench/bench_infer.py --model=small --num_inputs=2000 --compare=hf,ct2
    .venv/bin/python scripts/bench/bench_infer.py --model=tiny --num_inputs=20000 --before=/tmp/old

The inputs are Quora pairs drawn (with replacement, seeded) from the bundled sample, written as
the qp_is_duplicate task writes them, so their lengths follow the sample's. The model is the
tiny CPU experiment or T5 1.1 small's geometry (with the bundled vocabulary) after one training
step: weights close to random, which decode to the full target length. --before is a checkout
of an older t5tpu, run from its own folder: `git worktree add /tmp/old b3f264c`, then
`ln -s ../tasks /tmp/old/t5tpu/tasks; ln -s ../configs /tmp/old/t5tpu/configs` (what an
install maps them to).
--compare=ct2 needs `pip install ctranslate2` (not a t5tpu dependency). Prints one JSON object
per measurement; docs/PERFORMANCE.md has the results.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import random
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXPERIMENT = "configs/experiments/qp_is_duplicate_tiny_cpu.gin"
SMALL = [
    "--gin_file=configs/models/t5_1_1/small.gin",
    "--gin.default_vocabulary.sentencepiece_model_file=@bundled_vocabulary_file()",
    "--gin.default_vocabulary.extra_ids=0",
]


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("tiny", "small"), default="tiny")
    parser.add_argument("--num_inputs", type=int, nargs="+", default=[10000])
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--input_length", type=int, default=128)
    parser.add_argument("--target_length", type=int, default=None, help="default: the task's")
    parser.add_argument("--work_dir", default="/tmp/t5tpu_bench_infer")
    parser.add_argument("--before", default=None, help="an older t5tpu checkout to compare")
    parser.add_argument("--compare", default="", help="comma list of: hf, ct2")
    parser.add_argument("--compare_inputs", type=int, default=None, help="lines for hf/ct2")
    return parser.parse_args(argv)


def _inputs(path: str, count: int, seed: int = 0) -> None:
    rows = []
    for split in ("train", "validation"):
        with open(os.path.join(ROOT, "t5tpu", "assets", "quora_sample", f"{split}.tsv")) as f:
            rows.extend(csv.DictReader(f, delimiter="\t"))
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(count):
            row = rng.choice(rows)
            f.write(f"is duplicate: {row['question1']} <SEP> {row['question2']}\n")


def _gin(args) -> list[str]:
    lengths = f"{{'inputs': {args.input_length}, 'targets': {args.target_length or 4}}}"
    return [
        f"--gin_file={EXPERIMENT}",
        *(SMALL if args.model == "small" else []),
        f"--gin.TASK_FEATURE_LENGTHS={lengths}",
    ]


def _t5tpu(*argv) -> list[str]:
    return [sys.executable, "-m", "t5tpu.cli.main", *argv]


def _model_dir(args) -> str:
    folder = os.path.join(args.work_dir, f"model-{args.model}")
    if not os.path.isdir(os.path.join(folder, "checkpoint_1")):
        flags = ["--gin.TRAIN_STEPS=1", "--gin.BATCH_SIZE=8", "--gin.EVAL_PERIOD=0"]
        subprocess.run(
            _t5tpu("train", *_gin(args), f"--gin.MODEL_DIR='{folder}'", *flags),
            cwd=ROOT,
            check=True,
            capture_output=True,
        )
    return folder


def _measured(argv: list[str], cwd: str) -> dict:
    """Wall seconds and peak resident memory (MB) of one command, run in a child process of
    its own so that the peak is that command's."""
    wrapper = (
        "import resource, subprocess, sys, time\n"
        "t = time.time(); r = subprocess.run(sys.argv[1:], capture_output=True, text=True)\n"
        "print(r.returncode, time.time() - t, "
        "resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, flush=True)\n"
        "sys.stdout.write(r.stdout[-4000:]); sys.stderr.write(r.stderr[-4000:])\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", wrapper, *argv], cwd=cwd, capture_output=True, text=True
    )
    code, seconds, peak_kb = run.stdout.splitlines()[0].split()
    if code != "0":
        raise SystemExit(f"failed: {' '.join(argv)}\n{run.stderr[-3000:]}")
    return {"seconds": float(seconds), "peak_mb": int(peak_kb) / 1024, "stdout": run.stdout}


def _infer(args, model_dir: str, inputs: str, count: int, *, checkout: str, label: str) -> dict:
    out = os.path.join(args.work_dir, f"out-{label}-{count}")
    subprocess.run(["rm", "-rf", out], check=True)
    argv = _t5tpu(
        "infer",
        *_gin(args),
        f"--gin.MODEL_DIR='{model_dir}'",
        f"--gin.INFER_INPUT_FILE='{inputs}'",
        f"--gin.INFER_OUTPUT_DIR='{out}'",
        f"--gin.INFER_BATCH_SIZE={args.batch_size}",
    )
    result = _measured(argv, cwd=checkout)
    stdout = result.pop("stdout")
    decoded = re.search(r"decoded in ([\d.]+) s, ([\d.]+) examples/s", stdout)
    return {
        "impl": label,
        "model": args.model,
        "inputs": count,
        "batch_size": args.batch_size,
        **result,
        "examples_per_s": count / result["seconds"],
        "decode_examples_per_s": float(decoded[2]) if decoded else None,
    }


def _hf_dir(args, model_dir: str) -> str:
    folder = os.path.join(args.work_dir, f"hf-{args.model}")
    if not os.path.isdir(folder):
        argv = _t5tpu("convert", "--to=hf", f"--input={model_dir}", f"--output_dir={folder}")
        subprocess.run(argv, cwd=ROOT, check=True, capture_output=True)
    return folder


def _texts(path: str, count: int | None) -> list[str]:
    with open(path) as f:
        return [line.rstrip("\n") for line in f][:count]


def _hf_pipeline(args, hf_dir: str, texts: list[str]) -> dict:
    os.environ.setdefault("USE_TF", "0")
    import transformers

    pipe = transformers.pipeline("text2text-generation", model=hf_dir, device="cpu")
    start = time.time()
    pipe(
        texts,
        batch_size=args.batch_size,
        max_new_tokens=args.target_length or 4,
        do_sample=False,
        truncation=True,
    )
    seconds = time.time() - start
    return {
        "impl": "transformers pipeline",
        "inputs": len(texts),
        "seconds": seconds,
        "examples_per_s": len(texts) / seconds,
    }


def _ctranslate2(args, hf_dir: str, texts: list[str]) -> dict:
    import ctranslate2
    import transformers

    folder = hf_dir + "-ct2"
    if not os.path.isdir(folder):
        converter = ctranslate2.converters.TransformersConverter(hf_dir)
        converter.convert(folder)
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    translator = ctranslate2.Translator(folder, device="cpu", inter_threads=1)
    start = time.time()
    tokens = [
        tokenizer.convert_ids_to_tokens(tokenizer.encode(t)[: args.input_length]) for t in texts
    ]
    translator.translate_batch(
        tokens,
        max_batch_size=args.batch_size,
        beam_size=1,
        max_decoding_length=args.target_length or 4,
    )
    seconds = time.time() - start
    return {
        "impl": "ctranslate2 float32",
        "inputs": len(texts),
        "seconds": seconds,
        "examples_per_s": len(texts) / seconds,
    }


def main(argv=None) -> None:
    args = _parse(argv)
    os.makedirs(args.work_dir, exist_ok=True)
    model_dir = _model_dir(args)
    for count in args.num_inputs:
        inputs = os.path.join(args.work_dir, f"inputs-{count}.txt")
        if not os.path.exists(inputs):
            _inputs(inputs, count)
        print(json.dumps(_infer(args, model_dir, inputs, count, checkout=ROOT, label="t5tpu")))
        if args.before:
            result = _infer(args, model_dir, inputs, count, checkout=args.before, label="before")
            print(json.dumps(result))
        compare = [c for c in args.compare.split(",") if c]
        texts = _texts(inputs, args.compare_inputs)
        for name in compare:
            run = {"hf": _hf_pipeline, "ct2": _ctranslate2}[name]
            print(json.dumps({"model": args.model, **run(args, _hf_dir(args, model_dir), texts)}))


if __name__ == "__main__":
    main()
