"""How fast XLA:CPU reads a decoding step's weights, by the orientation of its bf16 dots.

    .venv/bin/python scripts/bench/dot_orientation.py --rows 1 8 32

One program per (orientation, rows) runs the matmuls of a T5 1.1 small decoding step (8 layers:
self-attention's query/key/value/out, cross-attention's query/out, gated MLP, then the output
layer over 32,128 ids; 77 MB of bfloat16 weights, each a separate array, far beyond the caches)
with residual adds between them, and no attention over a cache:
- `rows-major`: the network's orientation, [rows, in] x [in, out] (one row fed twice, as
  model/precision.py does);
- `feature-major`: weights held [out, in] on the left, activations [in, rows] on the right
  (two columns for one row);
- `feature-major, transposed in`: the same, its input given [rows, in] and transposed once at
  the start, as a decoding step's embedded tokens would be.
Prints one JSON object per program: median ms of 30 calls and the weights' GB/s.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

LAYERS, EMBED, HEADS_KV, MLP, VOCAB = 8, 512, 384, 1024, 32128
# (name, in, out) of each layer's kernels a decoding step reads.
KERNELS = (
    ("query", EMBED, HEADS_KV),
    ("key", EMBED, HEADS_KV),
    ("value", EMBED, HEADS_KV),
    ("out", HEADS_KV, EMBED),
    ("cross_query", EMBED, HEADS_KV),
    ("cross_out", HEADS_KV, EMBED),
    ("wi_0", EMBED, MLP),
    ("wi_1", EMBED, MLP),
    ("wo", MLP, EMBED),
)
ORIENTATIONS = ("rows-major", "feature-major", "feature-major, transposed in")


def _weights(feature_major: bool, seed: int = 0):
    rng = np.random.default_rng(seed)

    def kernel(fan_in, fan_out):
        w = rng.standard_normal((fan_in, fan_out), np.float32) * 0.02
        return jnp.asarray(w.T.copy() if feature_major else w, jnp.bfloat16)

    layers = [{name: kernel(i, o) for name, i, o in KERNELS} for _ in range(LAYERS)]
    return layers, kernel(EMBED, VOCAB)


def _step(orientation: str, rows: int):
    """The step's function of (layers, output, x): the largest logit of each row."""
    feature_major = orientation != "rows-major"

    def dense(x, w):
        if not feature_major:
            if x.shape[0] == 1:
                two = jnp.broadcast_to(x, (2, x.shape[1]))
                return jnp.dot(two, w, preferred_element_type=jnp.float32)[:1]
            return jnp.dot(x, w, preferred_element_type=jnp.float32)
        if x.shape[1] == 1:
            two = jnp.broadcast_to(x, (x.shape[0], 2))
            return jnp.einsum("nk,km->nm", w, two, preferred_element_type=jnp.float32)[:, :1]
        return jnp.einsum("nk,km->nm", w, x, preferred_element_type=jnp.float32)

    def bf16(x):
        return x.astype(jnp.bfloat16)

    def step(layers, output, x):
        if orientation == "feature-major, transposed in":
            x = x.T
        for w in layers:
            attention = bf16(dense(x, w["query"]) + dense(x, w["key"]) + dense(x, w["value"]))
            x = x + bf16(dense(attention, w["out"]))
            x = x + bf16(dense(bf16(dense(x, w["cross_query"])), w["cross_out"]))
            hidden = jax.nn.gelu(dense(x, w["wi_0"]), approximate=True) * dense(x, w["wi_1"])
            x = x + bf16(dense(bf16(hidden), w["wo"]))
        return jnp.max(dense(x, output), axis=0 if feature_major else 1)

    return jax.jit(step)


def measure(orientation: str, rows: int, calls: int = 30) -> dict:
    layers, output = _weights(feature_major=orientation != "rows-major")
    shape = (EMBED, rows) if orientation == "feature-major" else (rows, EMBED)
    x = jnp.asarray(np.random.default_rng(1).standard_normal(shape), jnp.bfloat16)
    step = _step(orientation, rows)
    for _ in range(3):
        step(layers, output, x).block_until_ready()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        step(layers, output, x).block_until_ready()
        times.append(time.perf_counter() - start)
    nbytes = output.nbytes + sum(w.nbytes for layer in layers for w in layer.values())
    median = float(np.median(times))
    return {
        "orientation": orientation,
        "rows": rows,
        "ms": round(median * 1e3, 2),
        "weights_GB_per_s": round(nbytes / median / 1e9, 1),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    args = parser.parse_args(argv)
    for rows in args.rows:
        for orientation in ORIENTATIONS:
            print(json.dumps(measure(orientation, rows)), flush=True)


if __name__ == "__main__":
    main()
