"""`t5tpu bench`: how fast a gin-configured T5 trains, scores and decodes on this machine.

    t5tpu bench --gin_file=configs/models/t5_1_1/small.gin [--compare_hf] [--gin.NAME=VALUE ...]

Builds the model of the gin files on whatever backend JAX finds, with random weights and random
token ids (no vocabulary is needed), and measures, one JSON line each, then a short table:

- train:    one jit'd train step (trainer.compile_train_step, donated state): compile seconds,
            median seconds/step after warm-up, tokens/s (batch x (inputs + targets)), examples/s,
            model FLOPs utilization = analytic forward+backward FLOPs / step time / the peak
            FLOP/s of a large matmul measured on the same device in the same run;
- score:    forward pass and per-example log-likelihood, tokens/s;
- greedy, beam: decoding exactly `--decode_length` new tokens (EOS never stops it), seconds per
            batch and new tokens/s;
- pipeline: examples/s the seqio pipeline of a real task delivers at the same feature lengths,
            and its ratio to what the train step consumes.

`--compare_hf` runs the same workloads through Hugging Face transformers' PyTorch
T5ForConditionalGeneration of the same geometry (random weights, AdamW on both sides) in the same
process and prints t5tpu/HF ratios. docs/PERFORMANCE.md records results and how they were taken.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import logging
import os
import platform
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from t5tpu.errors import ArgumentParser, UserError

WORKLOADS = ("train", "score", "greedy", "beam", "pipeline")
HF = "hf_torch"
OURS = "t5tpu"


def parse_args(argv: list[str]) -> argparse.Namespace:
    from t5tpu.cli.main import rewrite_gin_shorthand

    p = ArgumentParser(prog="t5tpu bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--gin_file", action="append", default=[], help="model gin file(s)")
    p.add_argument("--gin_bindings", action="append", default=[], help="'NAME = VALUE'")
    p.add_argument("--gin_search_paths", default="", help="comma-separated directories")
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--input_length", type=int, default=128)
    p.add_argument("--target_length", type=int, default=32)
    p.add_argument("--decode_batch_size", type=int, default=None, help="default: --batch_size")
    p.add_argument("--decode_length", type=int, default=32, help="new tokens per example")
    p.add_argument("--num_beams", type=int, default=4)
    p.add_argument("--beam_alpha", type=float, default=0.6)
    p.add_argument("--optimizer", choices=("adamw", "adafactor"), default="adamw")
    p.add_argument("--dropout_rate", type=float, default=0.0)
    p.add_argument("--steps", type=int, default=10, help="timed repetitions per workload")
    p.add_argument("--warmup", type=int, default=2, help="untimed repetitions before them")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated subset")
    p.add_argument("--compare_hf", action="store_true", help="also run HF PyTorch T5")
    p.add_argument("--matmul_size", type=int, default=None, help="peak probe (CPU 2048, else 8192)")
    p.add_argument("--pipeline_task", default="qp_is_duplicate")
    p.add_argument("--pipeline_batches", type=int, default=100)
    p.add_argument(
        "--pipeline_vocabulary",
        choices=("bundled", "gin"),
        default="bundled",
        help="tokenize with the bundled CPU vocabulary, or the one the gin files bind",
    )
    p.add_argument("--output", default=None, help="also append the JSON lines to this file")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(rewrite_gin_shorthand(argv))
    args.workloads = [w for w in args.workloads.split(",") if w]
    unknown = sorted(set(args.workloads) - set(WORKLOADS))
    if unknown:
        raise UserError(f"unknown workload(s) {', '.join(unknown)}; use {','.join(WORKLOADS)}")
    args.decode_batch_size = args.decode_batch_size or args.batch_size
    if min(args.batch_size, args.input_length, args.target_length, args.decode_length) < 1:
        raise UserError("batch size and lengths must be positive")
    if args.steps < 1 or args.warmup < 0 or args.num_beams < 1:
        raise UserError("--steps and --num_beams must be >= 1 and --warmup >= 0")
    missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
    if args.compare_hf and missing:
        raise UserError(
            f"--compare_hf needs {' and '.join(missing)}: pip install -e '.[test]' in the "
            "t5tpu checkout"
        )
    return args


# ---------------------------------------------------------------- model and inputs


def build_model(args):
    """The gin-configured EncoderDecoderModel with a stand-in vocabulary (ids only, EOS 1)."""
    import seqio

    from t5tpu import gin_setup
    from t5tpu.model.encoder_decoder import EncoderDecoderModel
    from t5tpu.model.network import T5Config

    search_paths = [p for p in args.gin_search_paths.split(",") if p]
    # Model files leave DROPOUT_RATE to the run files; the benchmark sets dropout from its flag.
    bindings = [*args.gin_bindings, f"T5Config.dropout_rate = {args.dropout_rate!r}"]
    # gin logs every search path it tries as an error; only the outcome matters here.
    root_logger = logging.getLogger()
    level = root_logger.level
    root_logger.setLevel(logging.CRITICAL)
    try:
        gin_setup.parse(args.gin_file, bindings, search_paths)
    finally:
        root_logger.setLevel(level)
    try:
        config = T5Config()
    except ValueError as e:
        raise UserError(f"bad gin config for the benchmark: {str(e).splitlines()[0]}") from None
    vocabulary = seqio.PassThroughVocabulary(config.vocab_size, eos_id=1)
    return EncoderDecoderModel(config=config, vocabulary=vocabulary)


def random_batch(
    rng: np.random.Generator, batch: int, input_length: int, target_length: int, vocab_size: int
) -> dict[str, np.ndarray]:
    """Full-length rows of random ids in [2, vocab): no padding, every target token counts."""
    inputs = rng.integers(2, vocab_size, size=(batch, input_length), dtype=np.int32)
    targets = rng.integers(2, vocab_size, size=(batch, target_length), dtype=np.int32)
    decoder_inputs = np.concatenate([np.zeros((batch, 1), np.int32), targets[:, :-1]], axis=1)
    return {
        "encoder_input_tokens": inputs,
        "decoder_input_tokens": decoder_inputs,
        "decoder_target_tokens": targets,
        "decoder_loss_weights": np.ones_like(targets, np.float32),
    }


# ---------------------------------------------------------------- FLOPs


def forward_flops(config, batch: int, input_length: int, target_length: int) -> float:
    """Matmul FLOPs (2 per multiply-add) of one forward pass; attention counted dense (no causal
    halving), embeddings lookups, norms and softmax left out, as MFU conventions do."""
    d, ff, inner = config.emb_dim, config.mlp_dim, config.num_heads * config.head_dim
    mlp = len(config.mlp_activations) * d * ff + ff * d
    encoder_token = 4 * d * inner + mlp + 2 * input_length * inner
    decoder_token = (
        4 * d * inner  # self-attention projections
        + 2 * target_length * inner  # self-attention scores and values
        + 2 * d * inner  # cross-attention query and output
        + 2 * input_length * inner  # cross-attention scores and values
        + mlp
    )
    cross_kv = 2 * d * inner * input_length  # per decoder layer, per example
    macs = batch * (
        input_length * encoder_token * config.num_encoder_layers
        + (target_length * decoder_token + cross_kv) * config.num_decoder_layers
        + target_length * d * config.vocab_size
    )
    return 2.0 * macs


def decode_flops(
    config, batch: int, input_length: int, new_tokens: int, num_beams: int = 1
) -> float:
    """The encoder and cross-attention keys/values once per example, then one decoder token per
    step and hypothesis, attending to the positions decoded so far and to the encoder output."""
    d, ff, inner = config.emb_dim, config.mlp_dim, config.num_heads * config.head_dim
    mlp = len(config.mlp_activations) * d * ff + ff * d
    per_token = (
        config.num_decoder_layers * (6 * d * inner + mlp + 2 * input_length * inner)
        + d * config.vocab_size
    )
    self_attention = config.num_decoder_layers * 2 * inner * sum(range(1, new_tokens + 1))
    once = forward_flops(config, batch, input_length, 0)  # encoder + cross-attention K/V
    return once + 2.0 * batch * num_beams * (new_tokens * per_token + self_attention)


# ---------------------------------------------------------------- timing


@dataclasses.dataclass
class Workload:
    """One prepared (compiled, warmed) workload: `run` does one repetition and returns what to
    wait for; `report` turns the median seconds of a repetition into result fields."""

    run: Callable[[], object]
    report: Callable[[float], dict]


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


def median_seconds(fns: list[Callable[[], object]], warmup: int, steps: int) -> list[float]:
    """Median seconds per call of each function. Calls alternate between the functions, so a
    change in machine load (other users of a shared CPU) hits every one alike."""
    for fn in fns:
        for _ in range(warmup):
            _timed(fn)
    times = [[] for _ in fns]
    for _ in range(steps):
        for fn, seconds in zip(fns, times, strict=True):
            seconds.append(_timed(fn))
    return [statistics.median(seconds) for seconds in times]


def measure(workloads: list[Workload], warmup: int, steps: int) -> list[dict]:
    seconds = median_seconds([w.run for w in workloads], warmup, steps)
    return [w.report(s) for w, s in zip(workloads, seconds, strict=True)]


def compile_seconds(jitted, *example_args):
    """(compiled executable, seconds to lower and compile it, XLA's cost estimate)."""
    start = time.perf_counter()
    compiled = jitted.lower(*example_args).compile()
    seconds = time.perf_counter() - start
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else (cost or {})
    return compiled, seconds, {k: float(cost[k]) for k in ("flops", "bytes accessed") if k in cost}


def peak_matmul_flops(dtype, size: int, steps: int = 5) -> float:
    """FLOP/s of a size x size x size matmul in `dtype` on the default device."""
    keys = jax.random.split(jax.random.PRNGKey(0))
    a, b = (jax.random.normal(k, (size, size), dtype) for k in keys)
    matmul = jax.jit(jnp.matmul)
    (seconds,) = median_seconds([lambda: matmul(a, b)], warmup=2, steps=steps)
    return 2.0 * size**3 / seconds


# ---------------------------------------------------------------- t5tpu workloads


def bench_train(model, args, batch, peak: float) -> Workload:
    from t5tpu.data import batches
    from t5tpu.partitioning import Partitioner
    from t5tpu.training import optim, trainer

    optimizer = optim.adamw(1e-4) if args.optimizer == "adamw" else optim.adafactor(1e-3)
    partitioner = Partitioner()
    lengths = (args.input_length, args.target_length)
    _, shardings = trainer.state_shardings(model, optimizer, partitioner, *lengths)
    state = jax.jit(
        lambda rng: trainer.initial_state(model, optimizer, rng, *lengths), out_shardings=shardings
    )(jax.random.PRNGKey(args.seed))
    step = trainer.compile_train_step(model, optimizer, shardings, partitioner)
    batch = batches.to_global(batch, partitioner.batch_sharding())
    seed = jax.random.PRNGKey(1)
    compiled, compile_s, cost = compile_seconds(step, state, batch, seed)
    flops = 3.0 * forward_flops(model.config, args.batch_size, *lengths)

    def run():
        nonlocal state
        state, metrics = compiled(state, batch, seed)  # the old state is donated
        return state, metrics

    def report(seconds: float) -> dict:
        return {
            **_throughput(seconds, args.batch_size, sum(lengths)),
            "compile_seconds": compile_s,
            "flops_per_step": flops,
            "mfu": flops / seconds / peak,
            "optimizer": args.optimizer,
            **_xla_cost(cost),
        }

    return Workload(run, report)


def bench_score(model, args, batch) -> Workload:
    params = _random_params(model, args)
    features = {k: jnp.asarray(v) for k, v in batch.items()}
    compiled, compile_s, cost = compile_seconds(jax.jit(model.score), params, features)
    lengths = (args.input_length, args.target_length)
    flops = forward_flops(model.config, args.batch_size, *lengths)

    def report(seconds: float) -> dict:
        return {
            **_throughput(seconds, args.batch_size, sum(lengths)),
            "compile_seconds": compile_s,
            "flops_per_step": flops,
            **_xla_cost(cost),
        }

    return Workload(lambda: compiled(params, features), report)


def bench_decode(model, args, inputs: np.ndarray, num_beams: int) -> Workload:
    from t5tpu.model import decoding

    params = _random_params(model, args)
    length = args.decode_length
    if num_beams == 1:
        fn = lambda p, x: decoding.decode(model.module, p, x, length, eos_id=-1)
    else:
        fn = lambda p, x: decoding.beam_search(
            model.module, p, x, length, -1, num_beams, args.beam_alpha
        )[0]
    tokens = jnp.asarray(inputs)
    compiled, compile_s, _ = compile_seconds(jax.jit(fn), params, tokens)
    out = compiled(params, tokens)
    if out.shape != (len(inputs), length) or not bool(jnp.all(out[:, -1] > 0)):
        raise RuntimeError(f"decoding did not produce {length} tokens per row")
    flops = decode_flops(model.config, len(inputs), args.input_length, length, num_beams)

    def report(seconds: float) -> dict:
        return _decode_result(seconds, len(inputs), args, num_beams) | {
            "compile_seconds": compile_s,
            "flops_per_batch": flops,
        }

    return Workload(lambda: compiled(params, tokens), report)


def bench_pipeline(args) -> dict:
    """Examples/s from a real task's seqio training stream, after its first batch."""
    import gin

    from t5tpu.data import pipeline, registry

    if args.pipeline_vocabulary == "bundled":
        gin.bind_parameter("default_vocabulary.sentencepiece_model_file", None)
    lengths = {"inputs": args.input_length, "targets": args.target_length}
    registry.get_task(args.pipeline_task)
    stream = pipeline.train_batches(args.pipeline_task, lengths, args.batch_size, args.seed, False)
    next(stream)
    start = time.perf_counter()
    for _ in range(args.pipeline_batches):
        next(stream)
    seconds = time.perf_counter() - start
    return {
        "task": args.pipeline_task,
        "vocabulary": args.pipeline_vocabulary,
        "examples_per_s": args.pipeline_batches * args.batch_size / seconds,
    }


def _random_params(model, args):
    import flax.linen as nn

    return jax.jit(lambda rng: nn.unbox(model.init(rng, args.input_length, args.target_length)))(
        jax.random.PRNGKey(args.seed)
    )


def _throughput(seconds: float, batch: int, tokens_per_example: int) -> dict:
    return {
        "seconds_per_step": seconds,
        "tokens_per_s": batch * tokens_per_example / seconds,
        "examples_per_s": batch / seconds,
    }


def _decode_result(seconds: float, batch: int, args, num_beams: int) -> dict:
    new_tokens = batch * args.decode_length
    return {
        "num_beams": num_beams,
        "batch_size": batch,
        "new_tokens_per_example": args.decode_length,
        "seconds_per_batch": seconds,
        "new_tokens_per_s": new_tokens / seconds,
        "seconds_per_token": seconds / new_tokens,
    }


def _xla_cost(cost: dict) -> dict:
    return {f"xla_{k.replace(' ', '_')}": v for k, v in cost.items()}


# ---------------------------------------------------------------- Hugging Face PyTorch


def hf_model(config, dtype: str):
    """transformers' T5ForConditionalGeneration with the same geometry and random weights."""
    import torch
    import transformers

    if config.mlp_activations not in (("gelu", "linear"), ("relu",)):
        raise UserError(
            f"--compare_hf supports T5 1.0/1.1 feed-forwards, not {config.mlp_activations}"
        )
    hf_config = transformers.T5Config(
        vocab_size=config.vocab_size,
        d_model=config.emb_dim,
        d_kv=config.head_dim,
        d_ff=config.mlp_dim,
        num_layers=config.num_encoder_layers,
        num_decoder_layers=config.num_decoder_layers,
        num_heads=config.num_heads,
        relative_attention_num_buckets=config.relative_attention_num_buckets,
        relative_attention_max_distance=config.relative_attention_max_distance,
        dropout_rate=config.dropout_rate,
        feed_forward_proj="gated-gelu" if len(config.mlp_activations) == 2 else "relu",
        tie_word_embeddings=config.logits_via_embedding,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(hf_config)
    return model.to(getattr(torch, dtype))


def hf_train(model, args, batch) -> Workload:
    import torch

    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
    inputs = torch.as_tensor(batch["encoder_input_tokens"], dtype=torch.long)
    labels = torch.as_tensor(batch["decoder_target_tokens"], dtype=torch.long)

    def step():
        loss = model(input_ids=inputs, attention_mask=inputs > 0, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def report(seconds: float) -> dict:
        return _throughput(seconds, args.batch_size, args.input_length + args.target_length)

    return Workload(step, report)


def hf_score(model, args, batch) -> Workload:
    import torch

    inputs = torch.as_tensor(batch["encoder_input_tokens"], dtype=torch.long)
    decoder_inputs = torch.as_tensor(batch["decoder_input_tokens"], dtype=torch.long)
    targets = torch.as_tensor(batch["decoder_target_tokens"], dtype=torch.long)

    @torch.inference_mode()
    def score():
        model.eval()
        logits = model(
            input_ids=inputs, attention_mask=inputs > 0, decoder_input_ids=decoder_inputs
        ).logits
        log_p = torch.log_softmax(logits.float(), dim=-1)
        log_p.gather(-1, targets[..., None])[..., 0].sum(-1)

    def report(seconds: float) -> dict:
        return _throughput(seconds, args.batch_size, args.input_length + args.target_length)

    return Workload(score, report)


def hf_decode(model, args, inputs: np.ndarray, num_beams: int) -> Workload:
    """generate() with its KV cache; min_new_tokens keeps EOS from ending rows early."""
    import torch

    ids = torch.as_tensor(inputs, dtype=torch.long)
    length = args.decode_length
    beam_options = {"num_beams": num_beams}
    if num_beams > 1:
        beam_options["length_penalty"] = args.beam_alpha

    @torch.inference_mode()
    def generate():
        model.eval()
        return model.generate(
            input_ids=ids,
            attention_mask=ids > 0,
            max_new_tokens=length,
            min_new_tokens=length,
            do_sample=False,
            use_cache=True,
            **beam_options,
        )

    produced = generate().shape[1] - 1  # generate() returns the start token too
    if produced != length:
        raise RuntimeError(f"HF generate produced {produced} tokens, not {length}")

    def report(seconds: float) -> dict:
        return _decode_result(seconds, len(inputs), args, num_beams)

    def run():
        generate()  # torch ran eagerly: nothing is left to wait for

    return Workload(run, report)


# ---------------------------------------------------------------- report


def machine_info() -> dict:
    device = jax.devices()[0]
    return {
        "workload": "machine",
        "backend": jax.default_backend(),
        "device": getattr(device, "device_kind", str(device)),
        "device_count": jax.device_count(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "load_average_1m": os.getloadavg()[0],
        "jax": jax.__version__,
    }


def ratios(results: list[dict]) -> list[dict]:
    """t5tpu/HF throughput ratios for every workload measured on both sides."""
    by_key = {(r["workload"], r.get("impl")): r for r in results}
    out = []
    for workload in WORKLOADS:
        ours, theirs = by_key.get((workload, OURS)), by_key.get((workload, HF))
        if ours and theirs:
            metric = "new_tokens_per_s" if "new_tokens_per_s" in ours else "tokens_per_s"
            out.append(
                {
                    "workload": workload,
                    "impl": f"{OURS}/{HF}",
                    "metric": metric,
                    "ratio": ours[metric] / theirs[metric],
                }
            )
    return out


def derived(results: list[dict]) -> list[dict]:
    """Beam vs greedy time per token; input pipeline vs train-step consumption."""
    by_key = {(r["workload"], r.get("impl")): r for r in results}
    out = []
    for impl in (OURS, HF):
        greedy, beam = by_key.get(("greedy", impl)), by_key.get(("beam", impl))
        if greedy and beam:
            ratio = beam["seconds_per_token"] / greedy["seconds_per_token"]
            out.append({"workload": "beam/greedy", "impl": impl, "time_per_token_ratio": ratio})
    train, pipeline = by_key.get(("train", OURS)), by_key.get(("pipeline", OURS))
    if train and pipeline:
        ratio = pipeline["examples_per_s"] / train["examples_per_s"]
        out.append({"workload": "pipeline/train", "impl": OURS, "examples_per_s_ratio": ratio})
    return out


def table(results: list[dict]) -> str:
    rows = [("workload", "impl", "seconds", "throughput", "compile s", "note")]
    for r in results:
        if "seconds_per_step" in r:
            seconds, rate = r["seconds_per_step"], f"{r['tokens_per_s']:.0f} tok/s"
        elif "seconds_per_batch" in r:
            seconds, rate = r["seconds_per_batch"], f"{r['new_tokens_per_s']:.1f} new tok/s"
        elif "examples_per_s" in r:
            seconds, rate = None, f"{r['examples_per_s']:.0f} ex/s"
        else:
            seconds, rate = None, ""
        note = next(
            (
                f"{k} {r[k]:.3g}"
                for k in ("mfu", "ratio", "time_per_token_ratio", "examples_per_s_ratio")
                if k in r
            ),
            "",
        )
        compile_s = f"{r['compile_seconds']:.1f}" if "compile_seconds" in r else ""
        rows.append(
            (
                r["workload"],
                r.get("impl", ""),
                "" if seconds is None else f"{seconds:.4f}",
                rate,
                compile_s,
                note,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows
    )


# ---------------------------------------------------------------- main


def run_workloads(args, emit: Callable[[dict], None]) -> list[dict]:
    results = []

    def record(workload: str, impl: str, fields: dict) -> None:
        result = {"workload": workload, "impl": impl, **fields}
        results.append(result)
        emit(result)

    def compare(workload: str, ours: Callable[[], Workload], theirs: Callable[[], Workload]):
        prepared = [ours()] + ([theirs()] if hf is not None else [])
        for impl, fields in zip(
            (OURS, HF), measure(prepared, args.warmup, args.steps), strict=False
        ):
            record(workload, impl, fields)

    model = build_model(args)
    rng = np.random.default_rng(args.seed)
    vocab = model.config.vocab_size
    batch = random_batch(rng, args.batch_size, args.input_length, args.target_length, vocab)
    decode_inputs = rng.integers(2, vocab, (args.decode_batch_size, args.input_length), np.int32)
    hf = hf_model(model.config, model.config.dtype) if args.compare_hf else None

    if "train" in args.workloads:
        size = args.matmul_size or (2048 if jax.default_backend() == "cpu" else 8192)
        peak = peak_matmul_flops(model.config.activation_dtype, size)
        record("peak_matmul", OURS, {"size": size, "flops_per_s": peak})
        compare(
            "train",
            lambda: bench_train(model, args, batch, peak),
            lambda: hf_train(hf, args, batch),
        )
    if "score" in args.workloads:
        compare("score", lambda: bench_score(model, args, batch), lambda: hf_score(hf, args, batch))
    for workload, beams in (("greedy", 1), ("beam", args.num_beams)):
        if workload in args.workloads:
            compare(
                workload,
                lambda beams=beams: bench_decode(model, args, decode_inputs, beams),
                lambda beams=beams: hf_decode(hf, args, decode_inputs, beams),
            )
    if "pipeline" in args.workloads:
        record("pipeline", OURS, bench_pipeline(args))
    for extra in ratios(results) + derived(results):
        results.append(extra)
        emit(extra)
    return results


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    output = open(args.output, "a") if args.output else None  # noqa: SIM115

    def emit(result: dict) -> None:
        line = json.dumps(result, sort_keys=True)
        print(line, flush=True)
        if output:
            output.write(line + "\n")
            output.flush()

    try:
        emit(machine_info() | {"args": vars(args)})
        results = run_workloads(args, emit)
        emit({"workload": "machine_end", "load_average_1m": os.getloadavg()[0]})
    finally:
        if output:
            output.close()
    print(table(results), flush=True)
    return 0
