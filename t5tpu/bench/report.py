"""What `t5tpu bench` reports: the fields of each result, how far each is from the machine's
limit, the machine it ran on, t5tpu/HF and derived ratios, the one-line-per-workload summary of
--json, and the closing table."""

from __future__ import annotations

import os
import platform

import jax

from t5tpu.bench.workload_names import FLOAT32, HF, OURS, REFERENCES, WORKLOADS


def throughput(seconds: float, batch: int, tokens_per_example: int) -> dict:
    return {
        "seconds_per_step": seconds,
        "tokens_per_s": batch * tokens_per_example / seconds,
        "examples_per_s": batch / seconds,
    }


def decode_result(seconds: float, batch: int, args, num_beams: int) -> dict:
    new_tokens = batch * args.decode_length
    return {
        "num_beams": num_beams,
        "batch_size": batch,
        "new_tokens_per_example": args.decode_length,
        "seconds_per_batch": seconds,
        "new_tokens_per_s": new_tokens / seconds,
        "seconds_per_token": seconds / new_tokens,
    }


def peak_fraction(flops: float, seconds: float, peak) -> dict:
    """Train and scoring against the matmul peak (a bench_limits.Limit, one device's): achieved
    FLOP/s / peak, `flops` being one device's share of the step's."""
    achieved = flops / seconds
    return {
        "achieved_flops_per_s": achieved,
        "fraction_of_limit": achieved / peak.value,
        "limit": f"matmul peak {peak.value / 1e9:.1f} GFLOP/s ({peak.described})",
        "limit_probes": list(peak.probes),
    }


def memory_floor(step_seconds: float, floor_bytes: dict, bandwidth, step_flops, peak) -> dict:
    """A decoding step against its memory floor: the time to read `floor_bytes` (by part, see
    bench_limits.decode_step_bytes) once at the measured bandwidth, over the step's time. The
    compute floor (the step's matmul FLOPs at the matmul peak) is reported beside it: when it is
    the higher, the memory floor cannot be reached."""
    total = sum(floor_bytes.values())
    floor = total / bandwidth.value
    return {
        "step_ms": step_seconds * 1e3,
        "memory_floor_ms": floor * 1e3,
        "compute_floor_ms": step_flops / peak.value * 1e3,
        "floor_bytes_per_step": total,
        "floor_bytes": floor_bytes,
        "fraction_of_limit": floor / step_seconds,
        "limit": (
            f"memory floor {floor * 1e3:.3g} ms/step: {total / 1e6:.3g} MB per step at "
            f"{bandwidth.value / 1e9:.1f} GB/s ({bandwidth.name}: {bandwidth.described})"
        ),
        "limit_probes": list(bandwidth.probes),
    }


def dense_share(step_seconds: float, dense_flops: float, dense) -> dict:
    """The step's dense matmuls alone, as XLA runs them at the step's shapes (bench_kernels;
    `dense` is their measured Limit, in FLOP/s), and their share of the step: what is left,
    1 - dense_share, is everything else the step does (attention, norms, softmax, the
    optimizer, cache updates, dispatch)."""
    dense_seconds = dense_flops / dense.value
    return {
        "dense_matmul_ms": dense_seconds * 1e3,
        "dense_matmul_flops_per_s": dense.value,
        "dense_share": dense_seconds / step_seconds,
        "dense_matmul_probes": list(dense.probes),
    }


def xla_cost(cost: dict) -> dict:
    return {f"xla_{k.replace(' ', '_')}": v for k, v in cost.items()}


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
    """t5tpu's throughput over each reference's (HF's, the float32 model's) for every workload
    measured on both sides."""
    by_key = {(r["workload"], r.get("impl")): r for r in results}
    out = []
    for workload in WORKLOADS:
        ours = by_key.get((workload, OURS))
        for reference in REFERENCES:
            theirs = by_key.get((workload, reference))
            if ours and theirs:
                metric = "new_tokens_per_s" if "new_tokens_per_s" in ours else "tokens_per_s"
                out.append(
                    {
                        "workload": workload,
                        "impl": f"{OURS}/{reference}",
                        "metric": metric,
                        "ratio": ours[metric] / theirs[metric],
                    }
                )
    return out


def derived(results: list[dict]) -> list[dict]:
    """Beam vs greedy time per token; input pipeline vs train-step consumption."""
    by_key = {(r["workload"], r.get("impl")): r for r in results}
    out = []
    for impl in (OURS, *REFERENCES):
        greedy, beam = by_key.get(("greedy", impl)), by_key.get(("beam", impl))
        if greedy and beam:
            ratio = beam["seconds_per_token"] / greedy["seconds_per_token"]
            out.append({"workload": "beam/greedy", "impl": impl, "time_per_token_ratio": ratio})
    train, pipeline = by_key.get(("train", OURS)), by_key.get(("pipeline", OURS))
    if train and pipeline:
        ratio = pipeline["examples_per_s"] / train["examples_per_s"]
        out.append({"workload": "pipeline/train", "impl": OURS, "examples_per_s_ratio": ratio})
    return out


SUMMARY_EXTRAS = (
    "batch_size",
    "num_beams",
    "memory_floor_ms",
    "compute_floor_ms",
    "dense_matmul_ms",
    "dense_share",
)
PIPELINE_LIMIT = "none: the host input pipeline has no machine limit here; see pipeline/train"


def summary(results: list[dict]) -> list[dict]:
    """--json's lines: one per workload measured, t5tpu's figures with HF's and the float32
    model's beside them when compared. tokens_per_s counts new tokens for decoding (the encoder
    pass included in the time); step_ms is a train or scoring step, one decoding step (the
    encoder pass left out), or one pipeline batch."""
    by_key = {(r["workload"], r.get("impl")): r for r in results}
    lines = []
    for workload in WORKLOADS:
        ours = by_key.get((workload, OURS))
        if ours is None:
            continue
        line = {
            "workload": workload,
            "tokens_per_s": _tokens_per_s(ours),
            "step_ms": _step_ms(ours),
            "fraction_of_limit": ours.get("fraction_of_limit"),
            "limit": ours.get("limit", PIPELINE_LIMIT),
        }
        line |= {k: ours[k] for k in SUMMARY_EXTRAS if k in ours}
        for reference, prefix in ((HF, "hf"), (FLOAT32, "float32")):
            theirs = by_key.get((workload, reference))
            if theirs is not None:
                line[f"{prefix}_tokens_per_s"] = _tokens_per_s(theirs)
                if reference == FLOAT32:  # HF's decoding has no step time of its own
                    line[f"{prefix}_step_ms"] = _step_ms(theirs)
                line[f"{prefix}_ratio"] = line["tokens_per_s"] / line[f"{prefix}_tokens_per_s"]
        lines.append(line)
    return lines


def _step_ms(result: dict) -> float:
    return result["step_ms"] if "step_ms" in result else result["seconds_per_step"] * 1e3


def _tokens_per_s(result: dict) -> float:
    return result["new_tokens_per_s"] if "new_tokens_per_s" in result else result["tokens_per_s"]


def _note(r: dict) -> str:
    if "probes" in r:
        return f"probes {r['min'] / 1e9:.1f}-{r['max'] / 1e9:.1f}"
    dense = f"dense matmuls {r['dense_matmul_ms']:.3g} ms" if "dense_matmul_ms" in r else ""
    if "memory_floor_ms" in r:
        floors = f"floor {r['memory_floor_ms']:.3g} (compute {r['compute_floor_ms']:.3g})"
        return f"step {r['step_ms']:.3g} ms, {floors}, {dense}"
    if dense:
        return dense
    ratios = ("ratio", "time_per_token_ratio", "examples_per_s_ratio")
    return next((f"{k} {r[k]:.3g}" for k in ratios if k in r), "")


def table(results: list[dict]) -> str:
    rows = [("workload", "impl", "seconds", "throughput", "compile s", "of limit", "note")]
    for r in results:
        if "seconds_per_step" in r:
            seconds, rate = r["seconds_per_step"], f"{r['tokens_per_s']:.0f} tok/s"
        elif "seconds_per_batch" in r:
            seconds, rate = r["seconds_per_batch"], f"{r['new_tokens_per_s']:.1f} new tok/s"
        elif "examples_per_s" in r:
            seconds, rate = None, f"{r['examples_per_s']:.0f} ex/s"
        elif "probes" in r:  # a machine limit: its robust figure and the probes' range
            seconds, rate = None, f"{r['value'] / 1e9:.1f} G{r['unit']}"
        else:
            seconds, rate = None, ""
        note = _note(r)
        compile_s = f"{r['compile_seconds']:.1f}" if "compile_seconds" in r else ""
        fraction = f"{r['fraction_of_limit']:.2f}" if "fraction_of_limit" in r else ""
        rows.append(
            (
                r["workload"],
                r.get("impl", ""),
                "" if seconds is None else f"{seconds:.4f}",
                rate,
                compile_s,
                fraction,
                note,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows
    )
