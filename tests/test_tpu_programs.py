"""The programs a TPU runs, checked without a TPU: the train step of T5 1.1 small's layers (two
a stack) and a decoding segment (decoding.run_segment, as the engine jits it) compiled by TPU's
compiler for libtpu's compile-only devices of a v2-8 and a v4-8.

- every dot reads bf16 operands (the matrix unit accumulates in float32) and returns bf16 or
  float32 as asked (float32: attention scores, the position bias, logits, parameters' gradients);
- none of XLA:CPU's shapes (model/precision.py) reach them: no unit contracted dim, no single
  row duplicated to two (the same programs lowered for CPU have both, so the check can fail);
- XLA's FLOP count of the train step is within 1.1x of the analytic count (3x the forward
  pass's matmuls, bench/workloads.py), and `t5tpu plan`'s roofline is built from it.

One subprocess (libtpu beside .venv, as tests/test_plan.py runs it) compiles the four programs
once; every test reads its JSON. A minute of TPU compiles: marked slow."""

from __future__ import annotations

import json
import re
import sys

import pytest
from fake_devices import ROOT
from test_plan import with_libtpu

SLICES = {"v2-8": "v2:2x2", "v4-8": "v4:2x2x1"}
# Shapes chosen with no dim of 2, so that a dim of 2 in a dot can only be a duplicated row.
TRAIN = {"batch": 32, "inputs": 32, "targets": 16}
SEGMENT = {"slots": 8, "inputs": 32, "max_length": 32}

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def programs():
    import subprocess

    env = with_libtpu() | {"JAX_PLATFORMS": "cpu"}
    run = subprocess.run(
        [sys.executable, __file__],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("slice_name", SLICES)
@pytest.mark.parametrize("program", ["train", "segment"])
def test_tpu_dots_are_plain_bf16(programs, slice_name, program):
    found = programs[slice_name][program]
    assert found["dots"] > 20
    assert found["operand_types"] == {"bf16,bf16": found["dots"]}
    assert set(found["accumulators"]) == {"f32", "bf16"}
    assert sum(found["accumulators"].values()) == found["dots"]
    assert found["unit_contracted"] == 0 and found["two_row"] == 0
    # TPU's optimized program: its dots and convolutions read no float32 (a 0/1 one-hot may stay
    # pred, which the MXU reads as bf16). A decoding step's small products may become other ops.
    assert found["compiled_dots"] == found["dots"] or program == "segment"
    assert set(found["compiled_operand_types"]) <= {"bf16,bf16", "bf16,pred", "pred,bf16"}


def test_the_same_programs_for_cpu_take_cpu_shapes(programs):
    """The check above can fail: lowered for CPU, the same programs have XLA:CPU's shapes
    (training's backward contracts leading dims; a decoding step's query is one row; each
    layer's position-bias gradient is summed over the batch by a float32 product with ones,
    precision.sum_rows)."""
    cpu = programs["cpu"]
    assert cpu["train"]["unit_contracted"] > 0 and cpu["segment"]["two_row"] > 0
    sums = 2 + 2  # one a layer: two encoder and two decoder layers
    matmuls = cpu["train"]["dots"] - sums
    assert cpu["train"]["operand_types"] == {"bf16,bf16": matmuls, "f32,f32": sums}


@pytest.mark.parametrize("slice_name", SLICES)
def test_train_step_flops_match_the_analytic_count(programs, slice_name):
    train = programs[slice_name]["train"]
    assert train["flops"] == pytest.approx(train["analytic_flops"], rel=0.1)
    assert train["bytes_accessed"] > 0


# ----- the worker: compiles for the slices' compile-only devices -------------------------------


def dot_report(stablehlo: str) -> dict:
    """Counts over the dot_generals of a lowered (StableHLO) program: operand and result element
    types, dots contracting a dim of size 1, dots with a dim of 2 in an operand."""
    pattern = (
        r"stablehlo\.dot_general .*?contracting_dims = \[([\d, ]*)\] x \[[\d, ]*\].*?"
        r": \(tensor<([^>]*)>, tensor<([^>]*)>\) -> tensor<([^>]*)>"
    )
    dots = re.findall(pattern, stablehlo)
    report = {"dots": len(dots), "operand_types": {}, "accumulators": {}}
    unit = two = 0
    for contracted, lhs, rhs, out in dots:
        lhs_dims, rhs_dims = lhs.split("x"), rhs.split("x")
        key = f"{lhs_dims[-1]},{rhs_dims[-1]}"
        report["operand_types"][key] = report["operand_types"].get(key, 0) + 1
        acc = out.split("x")[-1]
        report["accumulators"][acc] = report["accumulators"].get(acc, 0) + 1
        sizes = [int(lhs_dims[int(i)]) for i in contracted.replace(" ", "").split(",") if i]
        unit += 1 in sizes
        two += "2" in lhs_dims[:-1] or "2" in rhs_dims[:-1]
    return report | {"unit_contracted": unit, "two_row": two}


def compiled_report(hlo: str) -> dict:
    """Element types of the operands of every dot and convolution of compiled HLO text."""
    types = dict(re.findall(r"%([\w.\-]+) = (\w+)\[", hlo))
    ops = re.findall(r"= \w+\[[^\]]*\]\S* (?:dot|convolution)\(%([\w.\-]+), %([\w.\-]+)\)", hlo)
    counts = {}
    for lhs, rhs in ops:
        key = f"{types.get(lhs)},{types.get(rhs)}"
        counts[key] = counts.get(key, 0) + 1
    return {"compiled_dots": len(ops), "compiled_operand_types": counts}


def _model():
    import seqio

    from t5tpu.config import gin_setup
    from t5tpu.model.encoder_decoder import EncoderDecoderModel
    from t5tpu.model.network import T5Config

    # Two layers a stack: each layer's dots are the same, and TPU compiles take a quarter as long.
    layers = ["T5Config.num_encoder_layers = 2", "T5Config.num_decoder_layers = 2"]
    gin_setup.parse(["configs/models/t5_1_1/small.gin"], ["DROPOUT_RATE = 0.0", *layers], [])
    config = T5Config()
    return EncoderDecoderModel(config, seqio.PassThroughVocabulary(config.vocab_size, eos_id=1))


def _train_step(model, partitioner):
    """The lowered train step (AdamW, as `t5tpu bench` trains) and its analytic FLOPs."""
    import jax
    import jax.numpy as jnp

    from t5tpu.bench import workloads
    from t5tpu.training import optim, trainer

    batch, inputs, targets = TRAIN["batch"], TRAIN["inputs"], TRAIN["targets"]
    optimizer = optim.adamw(1e-4)
    state, shardings = trainer.state_shardings(model, optimizer, partitioner)
    step = trainer.compile_train_step(model, optimizer, shardings, partitioner)
    lengths = {"encoder_input_tokens": inputs, "decoder_input_tokens": targets}
    lengths |= {"decoder_target_tokens": targets, "decoder_loss_weights": targets}
    features = {k: jax.ShapeDtypeStruct((batch, n), jnp.int32) for k, n in lengths.items()}
    lowered = step.lower(state, features, jax.ShapeDtypeStruct((2,), jnp.uint32))
    analytic = 3 * workloads.forward_flops(model.config, batch, inputs, targets)
    return lowered, analytic / partitioner.mesh.size


def _segment(model, partitioner):
    """The lowered decoding segment: greedy, bf16 weights, as the engine runs it."""
    import jax
    import jax.numpy as jnp

    from t5tpu.model import decoding, param_shapes

    params, shardings = param_shapes.sharded_abstract_params(model.config, partitioner)
    dtype = jnp.dtype(model.config.activation_dtype)
    params = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, dtype if x.dtype == jnp.float32 else x.dtype),
        params,
    )
    module, picking = model.module, decoding.Picking(eos_id=1)
    slots, inputs, max_length = SEGMENT["slots"], SEGMENT["inputs"], SEGMENT["max_length"]
    state = decoding.slot_shapes(module, params, slots, inputs, max_length)

    def segment(params, state, free_wanted, max_steps):
        return decoding.run_segment(module, params, state, picking, free_wanted, max_steps)

    replicated = partitioner.replicated()
    jitted = partitioner.jit(segment, (shardings, replicated, replicated, replicated))
    scalar = jax.ShapeDtypeStruct((), jnp.int32)
    return jitted.lower(params, state, scalar, scalar)


def _programs(partitioner, compile: bool) -> dict:
    model = _model()
    train, analytic = _train_step(model, partitioner)
    segment = _segment(model, partitioner)
    found = {"train": dot_report(train.as_text()), "segment": dot_report(segment.as_text())}
    if not compile:
        return found
    compiled = train.compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    found["train"] |= compiled_report(compiled.as_text()) | {
        "flops": cost["flops"],
        "bytes_accessed": cost["bytes accessed"],
        "analytic_flops": analytic,
    }
    found["segment"] |= compiled_report(segment.compile().as_text())
    return found


def _worker() -> dict:
    from t5tpu.partitioning import Partitioner, Topology
    from t5tpu.planning import compiled_memory

    results = {"cpu": _programs(Partitioner(), compile=False)}
    for name, tpu_topology in SLICES.items():
        topology = Topology(name, tpu_topology=tpu_topology)
        with compiled_memory.libtpu_environment(topology):
            devices = compiled_memory.compile_only_devices(topology)
            results[name] = _programs(Partitioner(1, None, topology, devices), compile=True)
    return results


if __name__ == "__main__":
    print(json.dumps(_worker()))
