"""What `t5tpu bench` reports: the fields of each result, the machine it ran on, t5tpu/HF and
derived ratios, and the closing table."""

from __future__ import annotations

import os
import platform

import jax

from t5tpu.tools.bench import HF, OURS, WORKLOADS


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
