"""The machine's own limits for `t5tpu bench`, measured in the same run as the workloads: the
peak FLOP/s of a large matmul and the memory bandwidth (a streaming reduction and, separately, a
1-row GEMV), each probed several times and summarized robustly; and the bytes one decoding step
must read, which with the bandwidth gives the memory floor of a step.

The probes run before the workloads, after every repetition of each workload (the figures its
fraction_of_limit uses: on a machine shared with other processes the limits move within a run
(docs/PERFORMANCE.md), and probes taken beside the workload's own repetitions see the load it
saw), and after the workloads."""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

GEMV_INNER = 1024  # the GEMV's input width: [1, 1024] x [1024, n], n filling the probe's bytes


@dataclasses.dataclass(frozen=True)
class Limit:
    """One measured limit: `value` is the robust figure of `probes` (rates, higher is better)."""

    name: str
    unit: str
    value: float
    probes: tuple[float, ...]
    best_k: int
    shape: str
    when: str

    @property
    def described(self) -> str:
        return f"{self.shape}, median of the best {self.best_k} of {len(self.probes)} {self.when}"

    def record(self, suffix: str = "") -> dict:
        return {
            "workload": f"limit_{self.name}{suffix}",
            "value": self.value,
            "unit": self.unit,
            "shape": self.shape,
            "when": self.when,
            "best_k": self.best_k,
            "probes": list(self.probes),
            "min": min(self.probes),
            "max": max(self.probes),
        }


def robust(rates: list[float], best_k: int) -> float:
    """The median of the best (highest) `best_k` rates. Other processes on a shared machine can
    only slow a probe down, so the fastest probes are the truest; the median of several of them
    rather than the single fastest keeps one lucky probe from setting the limit."""
    if not rates:
        raise ValueError("no probes")
    best = sorted(rates, reverse=True)[: max(1, min(best_k, len(rates)))]
    return statistics.median(best)


@dataclasses.dataclass(frozen=True)
class Probe:
    """One kind of probe: `fn` does `work` (FLOPs or bytes) per call."""

    name: str
    unit: str
    shape: str
    fn: Callable[[], object]
    work: float


def _rate(probe: Probe) -> float:
    start = time.perf_counter()
    jax.block_until_ready(probe.fn())
    return probe.work / (time.perf_counter() - start)


def probe_rates(kinds: list[Probe], probes: int, warmup: int = 2) -> dict[str, list[float]]:
    """`probes` rates of each kind, after `warmup` calls of each. One call per probe (not an
    average over many), and the kinds taken in turn (matmul, stream, GEMV, matmul, ...), so a
    burst of load from other processes spoils a probe of each rather than every probe of one."""
    for kind in kinds:
        for _ in range(warmup):
            jax.block_until_ready(kind.fn())
    rates = {kind.name: [] for kind in kinds}
    for _ in range(probes):
        for kind in kinds:
            rates[kind.name].append(_rate(kind))
    return rates


PEAK_DTYPES = ("float32", "bfloat16")


def peak_name(dtype) -> str:
    """The name of the matmul peak of `dtype` (a T5Config.dtype): what its workloads reach for."""
    return f"matmul_peak_{jnp.dtype(dtype).name}"


def matmul_probe(dtype, size: int) -> Probe:
    """A size^3 matmul as the model runs it in `dtype`: float32, or bfloat16 inputs with float32
    accumulation (model/precision.py). The FLOP/s train and scoring can reach."""
    keys = jax.random.split(jax.random.PRNGKey(0))
    a, b = (jax.random.normal(k, (size, size), dtype) for k in keys)
    matmul = jax.jit(functools.partial(jnp.matmul, preferred_element_type=jnp.float32))
    name = jnp.dtype(dtype).name
    shape = f"{size}^3 {name} matmul" + (", float32 accumulation" if name != "float32" else "")
    return Probe(peak_name(dtype), "FLOP/s", shape, lambda: matmul(a, b), 2.0 * size**3)


def stream_probe(nbytes: int) -> Probe:
    """The sum of a float32 vector of `nbytes` (far larger than the caches): a pure read of
    memory. A reduction, not a copy: a copy's output is allocated afresh each call, and its page
    faults, not the memory, could set the rate."""
    x = jnp.ones((nbytes // 4,), jnp.float32)
    total = jax.jit(jnp.sum)
    shape = f"sum of {x.nbytes / 1e6:.0f} MB float32"
    return Probe("stream_bandwidth", "B/s", shape, lambda: total(x), x.nbytes)


def gemv_probe(nbytes: int) -> Probe:
    """A 1-row float32 GEMV over a matrix of `nbytes`: the kernel shape through which a batch-1
    decoding step reads its weights. Reported beside the streaming figure, not in its place:
    XLA's few-row GEMVs can stream well below the memory's rate (an 8-row one was once taken
    for the bandwidth: docs/PERFORMANCE.md)."""
    n = max(1, nbytes // (4 * GEMV_INNER))
    w = jnp.ones((GEMV_INNER, n), jnp.float32)
    v = jnp.ones((1, GEMV_INNER), jnp.float32)
    gemv = jax.jit(jnp.matmul)
    shape = f"[1, {GEMV_INNER}] x [{GEMV_INNER}, {n}] float32 GEMV"
    return Probe("gemv_bandwidth", "B/s", shape, lambda: gemv(v, w), w.nbytes)


def make_probes(matmul_size: int, memory_bytes: int) -> dict[str, Probe]:
    """Every kind of probe, by name (the matmul peak of each of PEAK_DTYPES); their arrays stay
    allocated while the probes are kept."""
    peaks = [matmul_probe(dtype, matmul_size) for dtype in PEAK_DTYPES]
    kinds = [*peaks, stream_probe(memory_bytes), gemv_probe(memory_bytes)]
    return {kind.name: kind for kind in kinds}


def limit_of(kind: Probe, rates: list[float], best_k: int, when: str) -> Limit:
    return Limit(
        kind.name, kind.unit, robust(rates, best_k), tuple(rates), best_k, kind.shape, when
    )


def probe_all(kinds: dict[str, Probe], probes: int, best_k: int, when: str) -> dict:
    """Every limit, by name: `probes` probes of each, the robust figure of the best `best_k`."""
    rates = probe_rates(list(kinds.values()), probes)
    return {name: limit_of(kind, rates[name], best_k, when) for name, kind in kinds.items()}


def bandwidth(limits: dict) -> Limit:
    """The memory bandwidth a decoding floor is set by: the higher of the two measured ways of
    reading memory, since a floor must not be beatable by a kernel the machine already runs."""
    return max(limits["stream_bandwidth"], limits["gemv_bandwidth"], key=lambda x: x.value)


def decode_step_bytes(config, batch: int, input_length: int, new_tokens: int, beams: int = 1):
    """The bytes one decoding step must read at least, by part (each read once per step):

    - decoder weights, in the activation dtype (decoding casts them once): per layer the
      self-attention query/key/value/output kernels, the cross-attention query and output
      kernels (its key/value kernels project the encoder output once, into the cache, and are
      not read again), the feed-forward kernels and three norm scales; then the final norm and
      the relative-position bias table;
    - the output layer, likewise: logits_dense [emb, vocab], or the embedding when tied (T5 1.0);
    - embedding rows: one [emb] row per hypothesis for the token fed in (when the embedding is
      also the output layer, the whole table is counted there instead);
    - self-attention keys and values: per layer, hypothesis and head, one row per position
      decoded so far; the step at position t reads t + 1 of them, so the average over the
      decode, (new_tokens + 1) / 2, is used;
    - cross-attention keys and values: per layer, example (its beams share them) and head, one
      row per input position.

    Left out: activations (hidden states, the [rows, vocab] logits), which the step produces
    rather than reads from memory, and the one new cache row it writes.
    """
    d, inner, layers = config.emb_dim, config.num_heads * config.head_dim, config.num_decoder_layers
    mlp = (len(config.mlp_activations) + 1) * d * config.mlp_dim
    layer = 4 * d * inner + 2 * d * inner + mlp + 3 * d
    relpos = config.relative_attention_num_buckets * config.num_heads
    if config.relative_bias_per_layer:  # umT5: a table in every layer
        relpos *= layers
    rows = batch * beams
    item = jnp.dtype(config.activation_dtype).itemsize  # weights and caches alike
    tied = config.logits_via_embedding
    return {
        "decoder_weights": item * (layers * layer + d + relpos),
        "output_layer": item * d * config.vocab_size,
        "embedding_rows": 0 if tied else item * rows * d,
        "self_attention_cache": item * 2 * layers * rows * inner * (new_tokens + 1) / 2,
        "cross_attention_cache": item * 2 * layers * batch * inner * input_length,
    }
