"""The t5tpu side of `t5tpu bench`: the gin-configured model with random weights and inputs,
its FLOPs, and each workload prepared for timing (compiled and checked); `run_workloads` measures
them all, beside their Hugging Face counterparts when asked."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from t5tpu.errors import UserError
from t5tpu.tools import bench_hf
from t5tpu.tools.bench import HF, OURS
from t5tpu.tools.bench_report import decode_result, derived, ratios, throughput, xla_cost
from t5tpu.tools.bench_timing import Workload, compile_seconds, measure, peak_matmul_flops


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
            **throughput(seconds, args.batch_size, sum(lengths)),
            "compile_seconds": compile_s,
            "flops_per_step": flops,
            "mfu": flops / seconds / peak,
            "optimizer": args.optimizer,
            **xla_cost(cost),
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
            **throughput(seconds, args.batch_size, sum(lengths)),
            "compile_seconds": compile_s,
            "flops_per_step": flops,
            **xla_cost(cost),
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
        return decode_result(seconds, len(inputs), args, num_beams) | {
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


def run_workloads(args, emit: Callable[[dict], None]) -> list[dict]:
    """Measures every workload of `args` (each beside HF's with --compare_hf, alternating, so
    load changes hit both alike), then the ratios; every result goes to `emit` as it comes."""
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
    hf = bench_hf.hf_model(model.config, model.config.dtype) if args.compare_hf else None

    if "train" in args.workloads:
        size = args.matmul_size or (2048 if jax.default_backend() == "cpu" else 8192)
        peak = peak_matmul_flops(model.config.activation_dtype, size)
        record("peak_matmul", OURS, {"size": size, "flops_per_s": peak})
        compare(
            "train",
            lambda: bench_train(model, args, batch, peak),
            lambda: bench_hf.hf_train(hf, args, batch),
        )
    if "score" in args.workloads:
        compare(
            "score",
            lambda: bench_score(model, args, batch),
            lambda: bench_hf.hf_score(hf, args, batch),
        )
    for workload, beams in (("greedy", 1), ("beam", args.num_beams)):
        if workload in args.workloads:
            compare(
                workload,
                lambda beams=beams: bench_decode(model, args, decode_inputs, beams),
                lambda beams=beams: bench_hf.hf_decode(hf, args, decode_inputs, beams),
            )
    if "pipeline" in args.workloads:
        record("pipeline", OURS, bench_pipeline(args))
    for extra in ratios(results) + derived(results):
        results.append(extra)
        emit(extra)
    return results
