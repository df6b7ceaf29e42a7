"""Where a decoding step's time goes: the engine's segment program, timed and profiled.

    .venv/bin/python scripts/bench/step_profile.py --slots 32 1 --dtype=bfloat16

Fills N slots with Quora questions (inputs padded to 32 tokens) on T5 1.1 small's geometry
(scripts/bench/bench_uneven.py's export, its EOS row zeroed so no row ends early; or --model, any
`t5tpu.load` source), times a segment of --steps steps (best of five), then traces one with
jax.profiler and sums XLA's per-op events by what each op computes, read from its HLO metadata.
An op that runs on both CPU threads appears on both, so a part's share is of the summed op time,
and its ms are that share of the timed step. Prints one JSON object per slot count.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_uneven  # noqa: E402

BUCKET = 32
# (part, pattern on the op's name in the traced program), first match wins.
PARTS = (
    ("output layer", r"logits_dense|attend"),
    ("embedding", r"token_embedder"),
    ("layer norms", r"layer_norm|decoder_norm"),
    ("mlp", r"/mlp/"),
    ("attention projections", r"attention[^/]*/.*(query|key|value|out)/"),
    ("attention over the cache", r"attention"),
    ("decoder, other", r"Transformer\.decode"),
)


def _parse(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="", help="default: bench_uneven's export, EOS zeroed")
    parser.add_argument("--slots", type=int, nargs="+", default=[32, 8, 1])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--work_dir", default="/tmp/t5tpu_bench_infer")
    return parser.parse_args(argv)


def _segment(model, slots: int, steps: int):
    """A function that runs one timed segment of `slots` questions, and the segment's HLO."""
    import jax

    from t5tpu.model import slot_batch
    from t5tpu.model.engine import Row

    engine, request = model.engine, bench_uneven._request(steps)
    rows = [Row(tuple(engine.encode(text, BUCKET).ids)) for text in bench_uneven._questions(slots)]
    shape = slot_batch.Shape(slots, BUCKET, steps)
    batch = slot_batch.SlotBatch(engine=engine, request=request, shape=shape)

    def run() -> float:
        batch.insert(rows)
        jax.block_until_ready(batch._state)
        start = time.perf_counter()
        batch.run(free_wanted=slots, max_steps=steps)
        return time.perf_counter() - start

    params = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), engine.params
    )
    state = engine.states.abstract(engine.params, shape)
    scalar = jax.ShapeDtypeStruct((), np.int32, sharding=engine.partitioner.replicated())
    segment = engine.programs_of(request, shape).segment
    lowered = lambda: segment.lower(params, engine.step_weights, state, scalar, scalar)
    return run, lambda: lowered().compile().as_text()


def _op_names(hlo: str) -> dict[str, str]:
    """Each instruction's name -> the jax op it came from (HLO metadata op_name)."""
    names = {}
    for match in re.finditer(r"\n\s*(?:ROOT )?%?([\w.\-]+) = [^\n]*?op_name=\"([^\"]*)\"", hlo):
        names[match.group(1)] = match.group(2)
    return names


def _op_times(trace_dir: str):
    """Summed event time (s) and event count per op name on XLA:CPU's worker threads."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    path = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)[0]
    space = xplane_pb2.XSpace()
    with open(path, "rb") as f:
        space.ParseFromString(f.read())
    times: collections.Counter = collections.Counter()
    counts: collections.Counter = collections.Counter()
    for plane in space.planes:
        for line in plane.lines:
            if "XLAEigen" not in line.name:
                continue
            for event in line.events:
                name = plane.event_metadata[event.metadata_id].name
                if "::" not in name:  # the executor's own spans hold the ops
                    times[name] += event.duration_ps * 1e-12
                    counts[name] += 1
    return times, counts


def _part(op_name: str) -> str:
    for part, pattern in PARTS:
        if re.search(pattern, op_name):
            return part
    return "picking and slot updates"


def profile(model, slots: int, steps: int) -> dict:
    import jax

    run, hlo = _segment(model, slots, steps)
    run()  # compiles
    step_ms = 1000 * min(run() for _ in range(5)) / steps
    with tempfile.TemporaryDirectory() as trace_dir:
        with jax.profiler.trace(trace_dir):
            run()
        times, counts = _op_times(trace_dir)
    names = _op_names(hlo())
    parts: collections.Counter = collections.Counter()
    for op, seconds in times.items():
        parts[_part(names.get(op, ""))] += seconds
    total = sum(parts.values())
    shares = {part: round(seconds / total, 3) for part, seconds in parts.most_common()}
    return {
        "slots": slots,
        "dtype": model.engine.model.config.dtype,
        "step_ms": round(step_ms, 2),
        "op_events_per_step": round(sum(counts.values()) / steps),
        "share": shares,
        "ms": {part: round(share * step_ms, 2) for part, share in shares.items()},
    }


def main(argv=None) -> None:
    import t5tpu

    args = _parse(argv)
    folder = args.model or bench_uneven._uneven_hf_dir(
        bench_uneven._parse([f"--work_dir={args.work_dir}", "--eos_scale=0"])
    )
    for slots in args.slots:
        model = t5tpu.load(folder, batch_size=slots, max_target_length=args.steps, dtype=args.dtype)
        print(json.dumps(profile(model, slots, args.steps)), flush=True)


if __name__ == "__main__":
    main()
