"""Timing for `t5tpu bench`: repetitions of prepared workloads, compile time, and the peak
FLOP/s of a large matmul that model FLOPs utilization is measured against."""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp


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
