"""Timing for `t5tpu bench`: repetitions of prepared workloads, interleaved, and compile time.
The machine's limits the workloads are measured against are bench_limits'."""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

import jax

from t5tpu.bench.limits import Probe, limit_of

INTERLEAVED = "probes, one after each repetition of the workload"


@dataclasses.dataclass
class Workload:
    """One prepared (compiled, warmed) workload: `run` does one repetition and returns what to
    wait for; `report(seconds, **part_seconds[, limits=...])` turns the median seconds of a
    repetition, and those of each of its `parts` (pieces of it timed on their own, such as
    decoding's encoder pass), into result fields. `probes` (bench_limits.Probe) run between its
    repetitions; their robust figures, by name, come to `report` as `limits`."""

    run: Callable[[], object]
    report: Callable[..., dict]
    parts: dict[str, Callable[[], object]] = dataclasses.field(default_factory=dict)
    probes: tuple[Probe, ...] = ()


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    jax.block_until_ready(fn())
    return time.perf_counter() - start


def interleaved_seconds(fns: list[Callable[[], object]], warmup: int, steps: int) -> list[list]:
    """Seconds of each of `steps` calls of each function. Calls alternate between the functions,
    so a change in machine load (other users of a shared CPU) hits every one alike."""
    for fn in fns:
        for _ in range(warmup):
            _timed(fn)
    times = [[] for _ in fns]
    for _ in range(steps):
        for fn, seconds in zip(fns, times, strict=True):
            seconds.append(_timed(fn))
    return times


def measure(workloads: list[Workload], warmup: int, steps: int, best_k: int = 3) -> list[dict]:
    """Each workload's report. Every repetition of every workload, part and probe is interleaved
    with the others' (t5tpu, its parts, its probes, HF, t5tpu, ...), so load from other processes
    hits all alike: ratios of their medians, and fractions of the limits probed between them,
    are steadier than any one median."""
    fns = [fn for w in workloads for fn in (w.run, *w.parts.values(), *(p.fn for p in w.probes))]
    times = iter(interleaved_seconds(fns, warmup, steps))
    reports = []
    for w in workloads:
        median = statistics.median(next(times))
        kwargs = {name: statistics.median(next(times)) for name in w.parts}
        if w.probes:
            kwargs["limits"] = {
                p.name: limit_of(p, [p.work / s for s in next(times)], best_k, INTERLEAVED)
                for p in w.probes
            }
        reports.append(w.report(median, **kwargs))
    return reports


def compile_seconds(jitted, *example_args):
    """(compiled executable, seconds to lower and compile it, XLA's cost estimate)."""
    start = time.perf_counter()
    compiled = jitted.lower(*example_args).compile()
    seconds = time.perf_counter() - start
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else (cost or {})
    return compiled, seconds, {k: float(cost[k]) for k in ("flops", "bytes accessed") if k in cost}
