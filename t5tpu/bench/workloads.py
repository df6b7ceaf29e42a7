"""The t5tpu side of `t5tpu bench`: the gin-configured model with random weights and inputs,
its FLOPs, and each workload prepared for timing (compiled and checked); `run_workloads` measures
them all, beside their Hugging Face counterparts when asked."""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Callable

import jax
import numpy as np

from t5tpu.bench import hf
from t5tpu.bench.kernels import decode_step_dense, dense_probe, forward_dense
from t5tpu.bench.limits import bandwidth, decode_step_bytes, make_probes, peak_name, probe_all
from t5tpu.bench.report import (
    decode_result,
    dense_share,
    derived,
    memory_floor,
    peak_fraction,
    ratios,
    throughput,
    xla_cost,
)
from t5tpu.bench.timing import Workload, compile_seconds, measure
from t5tpu.bench.workload_names import FLOAT32, HF, OURS
from t5tpu.errors import UserError
from t5tpu.model import param_shapes


@dataclasses.dataclass(frozen=True)
class IdsOnly:
    """The benchmark's vocabulary: ids only (no text is read or written), `vocab_size` of them.
    seqio's PassThroughVocabulary would do, but seqio loads TensorFlow, which an accelerator
    machine need not have (scripts/accelerator_check.sh runs the benchmark without it)."""

    vocab_size: int
    eos_id: int = 1


def build_model(args):
    """The gin-configured EncoderDecoderModel with a stand-in vocabulary (ids only, EOS 1). The
    model files' vocabulary (a gs:// file for T5 and mT5) is never read: the benchmark runs
    offline."""
    from t5tpu.config import gin_setup
    from t5tpu.model.encoder_decoder import EncoderDecoderModel
    from t5tpu.model.network import T5Config

    search_paths = [p for p in args.gin_search_paths.split(",") if p]
    # Model files leave DROPOUT_RATE to the run files; the benchmark sets dropout from its flag.
    bindings = [
        *args.gin_bindings,
        *(f"{c}.dropout_rate = {args.dropout_rate!r}" for c in ("T5Config", "T5GemmaConfig")),
    ]
    # gin logs every search path it tries as an error; only the outcome matters here.
    root_logger = logging.getLogger()
    level = root_logger.level
    root_logger.setLevel(logging.CRITICAL)
    try:
        gin_setup.parse(args.gin_file, bindings, search_paths)
    finally:
        root_logger.setLevel(level)
    try:
        # The model file's config (a T5Config, or T5Gemma's), else T5Config's bindings.
        config = gin_setup.bound_value("EncoderDecoderModel.config") or T5Config()
    except ValueError as e:
        raise UserError(f"bad gin config for the benchmark: {str(e).splitlines()[0]}") from None
    # Positionally: gin evaluates every bound keyword argument, the callers' too, and would
    # load the model file's vocabulary before this one replaced it.
    return EncoderDecoderModel(config, IdsOnly(config.vocab_size))


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


def decode_step_flops(config, rows: int, input_length: int, new_tokens: int) -> float:
    """Matmul FLOPs of one decoding step of `rows` hypotheses: one decoder token each, attending
    to the encoder output and to the positions decoded so far, at their average number over the
    decode, (new_tokens + 1) / 2."""
    d, ff, inner = config.emb_dim, config.mlp_dim, config.num_heads * config.head_dim
    mlp = len(config.mlp_activations) * d * ff + ff * d
    attention = 2 * input_length * inner + 2 * inner * (new_tokens + 1) / 2
    per_token = config.num_decoder_layers * (6 * d * inner + mlp + attention)
    return 2.0 * rows * (per_token + d * config.vocab_size)


def decode_flops(
    config, batch: int, input_length: int, new_tokens: int, num_beams: int = 1
) -> float:
    """The encoder and cross-attention keys/values once per example, then one decoder token per
    step and hypothesis."""
    once = forward_flops(config, batch, input_length, 0)  # encoder + cross-attention K/V
    step = decode_step_flops(config, batch * num_beams, input_length, new_tokens)
    return once + new_tokens * step


def bench_train(model, args, batch, probes: dict) -> Workload:
    from t5tpu.data import batches
    from t5tpu.partitioning import Partitioner
    from t5tpu.training import optim, trainer

    optimizer = optim.adamw(1e-4) if args.optimizer == "adamw" else optim.adafactor(1e-3)
    partitioner = Partitioner()
    partitioner.check_batch_size("--batch_size", args.batch_size)  # before any compile
    lengths = (args.input_length, args.target_length)
    _, shardings = trainer.state_shardings(model, optimizer, partitioner)
    state = jax.jit(
        lambda rng: trainer.initial_state(model, optimizer, rng, *lengths), out_shardings=shardings
    )(jax.random.PRNGKey(args.seed))
    step = trainer.compile_train_step(model, optimizer, shardings, partitioner)
    batch = batches.to_global(batch, partitioner.batch_sharding())
    seed = jax.random.PRNGKey(1)
    peak = peak_name(model.config.dtype)
    compiled, compile_s, cost = compile_seconds(step, state, batch, seed)
    flops = 3.0 * forward_flops(model.config, args.batch_size, *lengths)
    # The step runs on every device (data-parallel unless gin binds model partitions); the peak
    # and the dense matmuls are probed on one, so both are set against one device's share: its
    # FLOPs, and the matmuls of its rows of the batch.
    devices = partitioner.mesh.size
    dense = dense_probe(
        forward_dense(model.config, args.batch_size // partitioner.data_parallelism, *lengths),
        model.config.activation_dtype,
        backward=True,
    )

    def run():
        nonlocal state
        state, metrics = compiled(state, batch, seed)  # the old state is donated
        return state, metrics

    def report(seconds: float, limits: dict) -> dict:
        against_peak = peak_fraction(flops / devices, seconds, limits[peak])
        return {
            **throughput(seconds, args.batch_size, sum(lengths)),
            "compile_seconds": compile_s,
            "flops_per_step": flops,
            "devices": devices,
            **against_peak,
            "mfu": against_peak["fraction_of_limit"],  # the name earlier results used
            **dense_share(seconds, dense.work, limits["dense_matmuls"]),
            "optimizer": args.optimizer,
            **xla_cost(cost),
        }

    return Workload(run, report, probes=(probes[peak], dense))


def _engine(model, args, batch_size: int, target_length: int):
    """The engine `t5tpu infer` and serve decode and score with, over the model with random
    weights, for batches of `batch_size` rows of args.input_length ids."""
    from t5tpu.model import engine
    from t5tpu.partitioning import Partitioner

    partitioner = Partitioner()
    _, shardings = param_shapes.sharded_abstract_params(model.config, partitioner)
    return engine.Engine(
        model=model,
        params=_random_params(model, args),
        param_shardings=shardings,
        partitioner=partitioner,
        batch_size=batch_size,
        max_input_length=args.input_length,
        max_target_length=target_length,
    )


def _first_call(fn) -> tuple[float, object]:
    """(seconds, result) of `fn`'s first call: its programs compiled, not timed again."""
    start = time.perf_counter()
    out = jax.block_until_ready(fn())
    return time.perf_counter() - start, out


def bench_score(model, args, batch, probes: dict) -> Workload:
    """Engine.score on the batch's rows, as `t5tpu eval` and the Python API score."""
    scorer = _engine(model, args, args.batch_size, args.target_length)
    inputs = [row.tolist() for row in batch["encoder_input_tokens"]]
    targets = [row.tolist() for row in batch["decoder_target_tokens"]]
    run = lambda: scorer.score(inputs, targets)
    first, _ = _first_call(run)
    peak = peak_name(model.config.dtype)
    lengths = (args.input_length, args.target_length)
    flops = forward_flops(model.config, args.batch_size, *lengths)
    matmuls = forward_dense(model.config, args.batch_size, *lengths)
    dense = dense_probe(matmuls, model.config.activation_dtype)

    def report(seconds: float, limits: dict) -> dict:
        return {
            **throughput(seconds, args.batch_size, sum(lengths)),
            # The first call less a warm one: its programs' compiles.
            "compile_seconds": max(0.0, first - seconds),
            "flops_per_step": flops,
            **peak_fraction(flops, seconds, limits[peak]),
            **dense_share(seconds, dense.work, limits["dense_matmuls"]),
        }

    return Workload(run, report, probes=(probes[peak], dense))


def decode_settings(workload: str, args):
    """The decoding settings of a decoding workload."""
    from t5tpu.model.decoding_settings import DecodingSettings

    if workload == "beam":
        return DecodingSettings(num_beams=args.num_beams, beam_alpha=args.beam_alpha)
    if workload == "sampling":
        return DecodingSettings(temperature=args.temperature, top_k=args.top_k, seed=args.seed)
    return DecodingSettings()


def bench_decode(model, args, inputs: np.ndarray, settings, probes: dict) -> Workload:
    """Engine.generate on the rows, as `t5tpu infer`, the Python API and serve decode. The
    network's EOS id is one no token has (-1), so every row decodes exactly --decode_length
    tokens, as the FLOPs and bytes models count them. The prefill, timed alone, is a decode of
    one token (the encoder, the caches, one step): the loop's steps are the rest."""
    from t5tpu.model import engine
    from t5tpu.model.encoder_decoder import EncoderDecoderModel

    network = EncoderDecoderModel(model.config, IdsOnly(model.config.vocab_size, eos_id=-1))
    length, batch, num_beams = args.decode_length, len(inputs), settings.num_beams
    decoder = _engine(network, args, batch, length)
    rows = [row.tolist() for row in inputs]
    whole = lambda: decoder.generate(rows, engine.Request(settings, length))
    prefill = lambda: decoder.generate(rows, engine.Request(settings, 1))
    first, out = _first_call(whole)
    _first_call(prefill)
    if any(len(ids) != length or ids[-1] <= 0 for ids in out):
        raise RuntimeError(f"decoding did not produce {length} tokens per row")
    config = model.config
    flops = decode_flops(config, batch, args.input_length, length, num_beams)
    step_flops = decode_step_flops(config, batch * num_beams, args.input_length, length)
    floor_bytes = decode_step_bytes(config, batch, args.input_length, length, num_beams)
    # The step's own orientation: feature-major where the engine holds its weights.
    feature_major = decoder.step_weights is not None and num_beams == 1
    matmuls = decode_step_dense(config, batch * num_beams)
    dense = dense_probe(matmuls, config.activation_dtype, feature_major=feature_major)
    peak = peak_name(config.dtype)

    def report(seconds: float, prefill: float, limits: dict) -> dict:
        # The loop's steps are the whole decode less its prefill (medians of interleaved
        # repetitions); a tiny model's prefill can exceed that noise, hence the fallback.
        steps = max(1, length - 1)
        loop = seconds - prefill if seconds > prefill and length > 1 else seconds
        return decode_result(seconds, batch, args, num_beams) | {
            "compile_seconds": max(0.0, first - seconds),
            "flops_per_batch": flops,
            "prefill_seconds": prefill,
            **memory_floor(loop / steps, floor_bytes, bandwidth(limits), step_flops, limits[peak]),
            **dense_share(loop / steps, dense.work, limits["dense_matmuls"]),
        }

    return Workload(
        whole,
        report,
        parts={"prefill": prefill},
        # Both bandwidths, the peak for the compute floor, and the step's own dense matmuls.
        probes=(probes[peak], probes["stream_bandwidth"], probes["gemv_bandwidth"], dense),
    )


def bench_pipeline(args) -> dict:
    """Examples/s from a real task's seqio training stream, after its first batch."""
    from t5tpu.config import gin_setup
    from t5tpu.data import pipeline
    from t5tpu.tasks import registry

    if args.pipeline_vocabulary == "bundled":
        gin_setup.bind("default_vocabulary.sentencepiece_model_file", None)
    lengths = {"inputs": args.input_length, "targets": args.target_length}
    registry.get_task(args.pipeline_task)
    stream = pipeline.train_batches(args.pipeline_task, lengths, args.batch_size, args.seed, False)
    next(stream)
    start = time.perf_counter()
    for _ in range(args.pipeline_batches):
        next(stream)
    seconds = time.perf_counter() - start
    examples_per_s = args.pipeline_batches * args.batch_size / seconds
    return {
        "task": args.pipeline_task,
        "vocabulary": args.pipeline_vocabulary,
        "examples_per_s": examples_per_s,
        # Token positions of the padded batches, as the train step's tokens_per_s counts them.
        "tokens_per_s": examples_per_s * (args.input_length + args.target_length),
        "step_ms": seconds / args.pipeline_batches * 1e3,
    }


def _random_params(model, args):
    import flax.linen as nn

    return jax.jit(lambda rng: nn.unbox(model.init(rng, args.input_length, args.target_length)))(
        jax.random.PRNGKey(args.seed)
    )


def _inference_params(model, args):
    """Random parameters in the activation dtype, cast once as inference and scoring do."""
    from t5tpu.model import precision

    return precision.cast_params(_random_params(model, args), model.config.activation_dtype)


# Those measured against a limit; the decoding ones, with their settings (decode_settings).
MODEL_WORKLOADS = ("train", "score", "greedy", "sampling", "beam")
DECODING = ("greedy", "sampling", "beam")


def make_limit_probes(args) -> dict:
    """The probes of the machine's limits (bench_limits): the matmul peak of float32 and of
    bfloat16 with float32 accumulation (each workload is set against its dtype's), and the
    memory probes, which read float32. Sizes:
    matmul 2048 on CPU (the size that ran fastest there, docs/PERFORMANCE.md), 8192 on
    accelerators; memory probes of 256 MiB on CPU (far larger than a CPU's last-level cache),
    2 GiB on accelerators (they stay allocated through the run: --stream_mb makes them
    smaller)."""
    cpu = jax.default_backend() == "cpu"
    size = args.matmul_size or (2048 if cpu else 8192)
    stream_mb = args.stream_mb or (256 if cpu else 2048)
    return make_probes(size, stream_mb * 2**20)


def float32_twin(model):
    """The same model in float32: what --compare_float32 sets a bfloat16 model against."""
    from t5tpu.model.encoder_decoder import EncoderDecoderModel

    if model.config.dtype == "float32":
        raise UserError("--compare_float32 needs a bfloat16 model: bind T5Config.dtype='bfloat16'")
    config = dataclasses.replace(model.config, dtype="float32")
    return EncoderDecoderModel(config, model.vocabulary)


def run_workloads(args, emit: Callable[[dict], None], model) -> list[dict]:
    """Measures every workload of `args` (each beside HF's with --compare_hf and beside the
    float32 model's with --compare_float32, alternating, so load changes hit all alike), between
    probes of the machine's limits, then the ratios; every result goes to `emit` as it
    comes."""
    results = []

    def record(result: dict) -> None:
        results.append(result)
        emit(result)

    rng = np.random.default_rng(args.seed)
    vocab = model.config.vocab_size
    batch = random_batch(rng, args.batch_size, args.input_length, args.target_length, vocab)
    decode_inputs = rng.integers(2, vocab, (args.decode_batch_size, args.input_length), np.int32)
    reference = hf.hf_model(model.config, model.config.dtype) if args.compare_hf else None
    measured = set(args.workloads) & set(MODEL_WORKLOADS)
    probes = make_limit_probes(args) if measured else {}

    def probe_machine(when: str, suffix: str) -> None:
        for limit in probe_all(probes, args.limit_probes, args.limit_best, when).values():
            record(limit.record(suffix))

    # Each workload's implementations, each prepared only when its turn comes.
    models = {OURS: model}
    if args.compare_float32:
        models[FLOAT32] = float32_twin(model)
    sides = {
        "train": lambda m: bench_train(m, args, batch, probes),
        "score": lambda m: bench_score(m, args, batch, probes),
    }
    hf_sides = {
        "train": lambda: hf.hf_train(reference, args, batch),
        "score": lambda: hf.hf_score(reference, args, batch),
    }
    for name in DECODING:
        settings = decode_settings(name, args)
        sides[name] = functools.partial(
            bench_decode, args=args, inputs=decode_inputs, settings=settings, probes=probes
        )
        hf_sides[name] = functools.partial(hf.hf_decode, reference, args, decode_inputs, settings)
    repetitions = (args.warmup, args.steps, args.limit_best)
    if probes:
        probe_machine("probes before the workloads", "")
    for workload in (w for w in MODEL_WORKLOADS if w in measured):
        impls = {impl: functools.partial(sides[workload], m) for impl, m in models.items()}
        if reference is not None:
            impls[HF] = hf_sides[workload]
        reports = measure([prepare() for prepare in impls.values()], *repetitions)
        for impl, fields in zip(impls, reports, strict=True):
            record({"workload": workload, "impl": impl, **fields})
    if "pipeline" in args.workloads:
        record({"workload": "pipeline", "impl": OURS, **bench_pipeline(args)})
    if probes:  # before and after: how far the machine's state moved during the run
        probe_machine("probes after the workloads", "_end")
    for extra in ratios(results) + derived(results):
        record(extra)
    return results
