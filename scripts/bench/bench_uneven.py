"""Greedy decoding of real text with outputs of uneven length: t5tpu's engine (float32 and
bfloat16) against CTranslate2 (float32 and int8) on the same weights and inputs.

    .venv/bin/pip install ctranslate2
    .venv/bin/python scripts/bench/bench_uneven.py --num_inputs=512 --batch_sizes 1 8 32

The model is T5 1.1 small's geometry with the bundled vocabulary after one training step
(scripts/bench/bench_infer.py makes it), exported to Hugging Face's format. Weights that close to
random decode most inputs to the full length, so the output layer's EOS row is scaled
(--eos_scale) until greedy outputs end at uneven lengths. The inputs are Quora questions from
the bundled sample. t5tpu runs through `t5tpu.load` (the engine `t5tpu infer` uses),
CTranslate2 through `Translator.translate_batch` (two threads); each is timed on a second pass
over the inputs (the first compiles). Prints one JSON object per measurement, with how many
outputs equal the first implementation's of that batch size.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_infer  # noqa: E402

EOS = 1


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num_inputs", type=int, default=512)
    parser.add_argument("--batch_sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--max_length", type=int, default=32)
    parser.add_argument("--eos_scale", type=float, default=1.15)
    parser.add_argument("--work_dir", default="/tmp/t5tpu_bench_infer")
    parser.add_argument("--skip", default="", help="comma list of: t5tpu, bf16, ct2, int8")
    return parser.parse_args(argv)


def _questions(count: int) -> list[str]:
    questions = []
    for split in ("validation", "train"):
        path = os.path.join(bench_infer.ROOT, "t5tpu", "assets", "quora_sample", f"{split}.tsv")
        with open(path) as f:
            for row in csv.DictReader(f, delimiter="\t"):
                questions += [row["question1"], row["question2"]]
    return questions[:count]


def _uneven_hf_dir(args) -> str:
    """The exported small model with its EOS output row scaled."""
    model_args = bench_infer._parse(["--model=small", f"--work_dir={args.work_dir}"])
    hf_dir = bench_infer._hf_dir(model_args, bench_infer._model_dir(model_args))
    folder = f"{hf_dir}-eos{args.eos_scale:g}"
    if not os.path.isdir(folder):
        from safetensors.numpy import load_file, save_file

        shutil.copytree(hf_dir, folder)
        path = os.path.join(folder, "model.safetensors")
        weights = load_file(path)
        weights["lm_head.weight"][EOS] *= args.eos_scale
        save_file(weights, path, metadata={"format": "pt"})
    return folder


def _t5tpu(folder, texts, batch_size, max_length, dtype) -> tuple[float, list[list[int]]]:
    import t5tpu

    model = t5tpu.load(folder, batch_size=batch_size, max_target_length=max_length, dtype=dtype)
    ids = [model.engine.encode(text).ids for text in texts]
    start = time.perf_counter()
    model.engine.generate(ids, _request(max_length))  # compiles every shape the run meets
    first = time.perf_counter() - start
    start = time.perf_counter()
    out = model.engine.generate(ids, _request(max_length))
    seconds = time.perf_counter() - start
    print(
        json.dumps(
            {
                "impl": f"t5tpu {dtype}",
                "batch_size": batch_size,
                "first_pass_s": round(first, 2),
                "second_pass_s": round(seconds, 2),
                "ratio": round(first / seconds, 2),
            }
        )
    )
    return seconds, [_until_eos(row.tolist()) for row in out]


def _request(max_length):
    from t5tpu.model.decoding_settings import DecodingSettings
    from t5tpu.model.engine import Request

    return Request(DecodingSettings(), max_length)


def _until_eos(ids: list[int]) -> list[int]:
    return ids[: ids.index(EOS)] if EOS in ids else [i for i in ids if i]


def _ct2(folder, texts, batch_size, max_length, compute_type) -> tuple[float, list[list[int]]]:
    import ctranslate2
    import transformers

    converted = f"{folder}-ct2"
    if not os.path.isdir(converted):
        ctranslate2.converters.TransformersConverter(folder).convert(converted)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    translator = ctranslate2.Translator(
        converted, device="cpu", compute_type=compute_type, inter_threads=1, intra_threads=2
    )
    tokens = [tokenizer.convert_ids_to_tokens(tokenizer.encode(t)) for t in texts]
    # min_decoding_length=0: T5 may end an output at its first step (CTranslate2's default: 1).
    options = dict(
        max_batch_size=batch_size,
        beam_size=1,
        max_decoding_length=max_length,
        min_decoding_length=0,
    )
    translator.translate_batch(tokens, **options)
    start = time.perf_counter()
    results = translator.translate_batch(tokens, **options)
    seconds = time.perf_counter() - start
    # The model's ids by CTranslate2's own vocabulary: the model has more ids than the bundled
    # SentencePiece model has pieces, and the tokenizer maps the others to <unk>.
    with open(os.path.join(converted, "shared_vocabulary.json")) as f:
        vocabulary = {token: i for i, token in enumerate(json.load(f))}
    ids = [[vocabulary[token] for token in r.hypotheses[0]] for r in results]
    return seconds, [[i for i in row if i != EOS] for row in ids]


def main(argv=None) -> None:
    args = _parse(argv)
    folder = _uneven_hf_dir(args)
    texts = _questions(args.num_inputs)
    skip = set(args.skip.split(","))
    runs = {
        "t5tpu float32": lambda b: _t5tpu(folder, texts, b, args.max_length, "float32"),
        "t5tpu bfloat16": lambda b: _t5tpu(folder, texts, b, args.max_length, "bfloat16"),
        "ctranslate2 float32": lambda b: _ct2(folder, texts, b, args.max_length, "float32"),
        "ctranslate2 int8": lambda b: _ct2(folder, texts, b, args.max_length, "int8"),
    }
    keys = {"t5tpu float32": "t5tpu", "t5tpu bfloat16": "bf16"}
    keys |= {"ctranslate2 float32": "ct2", "ctranslate2 int8": "int8"}
    for batch_size in args.batch_sizes:
        reference = None
        for name, run in runs.items():
            if keys[name] in skip:
                continue
            seconds, outputs = run(batch_size)
            reference = reference or outputs
            lengths = [len(row) + 1 for row in outputs]
            same = sum(a == b for a, b in zip(outputs, reference, strict=True))
            print(
                json.dumps(
                    {
                        "impl": name,
                        "batch_size": batch_size,
                        "inputs": len(texts),
                        "examples_per_s": round(len(texts) / seconds, 1),
                        "new_tokens_per_s": round(sum(lengths) / seconds, 1),
                        "mean_output_tokens": round(float(np.mean(lengths)), 1),
                        "same_as_first": same,
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
