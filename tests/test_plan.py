"""`t5tpu plan`: exact parameter and optimizer bytes, a peak estimate within 15% of XLA's compiled
memory analysis of the real train step (tiny and small, 8 fake CPU devices: data and model
parallelism, microbatches), what the compiler changes, the verdict and the knobs, the committed
table in docs/memory_plan.md, and scripts/tpu_vm.sh --dry-run. Run as a script, this file
compiles the step for its rows (on CPU, or with --tpu for a TPU slice's compile-only devices)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
import sys

import pytest
from cli_runs import t5tpu
from fake_devices import run_script_on_eight_devices
from jax.sharding import PartitionSpec
from tiny import tiny_config

from t5tpu import package_files, partitioning
from t5tpu.bench import workloads as bench_workloads
from t5tpu.cli import bench
from t5tpu.errors import UserError
from t5tpu.model.t5gemma_network import T5GemmaConfig, T5GemmaStack
from t5tpu.planning import knobs, lora_plan, memory_plan, placements, roofline
from t5tpu.runners import plan as plan_runner
from t5tpu.training import optim

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
T5_10_SMALL = "configs/models/t5_1_0/small.gin"  # qp_is_duplicate_small_v2-8's model
# Two layers a stack for TPU's compiles: every layer's program is the same, and the compile
# takes a third as long as the model file's six.
TWO_LAYERS = ("--gin.T5Config.num_encoder_layers=2", "--gin.T5Config.num_decoder_layers=2")


@dataclasses.dataclass(frozen=True)
class XlaCase:
    """One row of the "Checked against XLA" table in docs/memory_plan.md: a model gin (T5 1.1's
    or, `family`, T5Gemma's) and the train step it runs on 8 devices ('model' ways of model
    parallelism)."""

    size: str
    batch: int
    input_length: int
    target_length: int
    model_parallelism: int = 1
    remat: str = "none"
    microbatches: int = 1
    encoder_layers: int | None = None  # None: the model file's
    scan_layers: bool = False
    family: str = "t5_1_1"  # the directory under configs/models/
    bindings: tuple[str, ...] = ()  # more gin bindings

    @property
    def config_name(self) -> str:
        return "T5GemmaConfig" if self.family == "t5gemma" else "T5Config"

    def gin_bindings(self, dtype: str) -> list[str]:
        """The case's settings as gin bindings of its family's config."""
        c = self.config_name
        layers = []
        if self.encoder_layers is not None:
            stack = "encoder/T5GemmaStack.num_layers" if self.family == "t5gemma" else None
            layers = [f"{stack or 'T5Config.num_encoder_layers'} = {self.encoder_layers}"]
        return [
            f"{c}.remat_policy = '{self.remat}'",
            f"{c}.scan_layers = {self.scan_layers}",
            f"{c}.dtype = '{dtype}'",
            *layers,
            *self.bindings,
        ]


# A decoder half the encoder's width, with 2 query heads on 1 key/value head.
GEMMA_NARROW_DECODER = (
    "T5GemmaConfig.decoder = @decoder/T5GemmaStack()",
    "decoder/T5GemmaStack.emb_dim = 64",
    "decoder/T5GemmaStack.num_heads = 2",
    "decoder/T5GemmaStack.num_kv_heads = 1",
    "decoder/T5GemmaStack.head_dim = 32",
    "decoder/T5GemmaStack.mlp_dim = 192",
    "decoder/T5GemmaStack.num_layers = 2",
    "decoder/T5GemmaStack.query_pre_attn_scalar = 32.0",
    "decoder/T5GemmaStack.sliding_window = 16",
)


# Every row of the docs table, by name. tiny's peak is at the start of the backward pass
# (activations), small's at the optimizer update (parameters).
XLA_CASES = {
    "small": XlaCase("small", 32, 128, 16),
    "small_batch64": XlaCase("small", 64, 128, 16),
    "tiny": XlaCase("tiny", 64, 128, 16),
    "tiny_short": XlaCase("tiny", 32, 96, 8),
    "tiny_4x2": XlaCase("tiny", 32, 96, 8, model_parallelism=2),
    "tiny_microbatches": XlaCase("tiny", 64, 128, 16, microbatches=2),
    "tiny_2x4": XlaCase("tiny", 64, 128, 16, model_parallelism=4),
    "tiny_dots": XlaCase("tiny", 64, 128, 16, remat="dots"),
    "tiny_full": XlaCase("tiny", 64, 128, 16, remat="full"),
    "tiny_scanned": XlaCase("tiny", 64, 128, 16, scan_layers=True),
    "tiny_scanned_4x2": XlaCase("tiny", 32, 96, 8, model_parallelism=2, scan_layers=True),
    "tiny_scanned_full": XlaCase("tiny", 64, 128, 16, remat="full", scan_layers=True),
    "tiny_scanned_dots": XlaCase("tiny", 64, 128, 16, remat="dots", scan_layers=True),
    # T5Gemma tiny (2+2 layers of width 128, 4 query heads on 2 key/value heads), and an
    # unbalanced one as 9B-2B is: a narrower decoder reading the encoder's wider output.
    "t5gemma_tiny": XlaCase("tiny", 64, 128, 16, family="t5gemma"),
    "t5gemma_tiny_4x2": XlaCase("tiny", 32, 96, 8, model_parallelism=2, family="t5gemma"),
    "t5gemma_tiny_unbalanced": XlaCase(
        "tiny", 64, 128, 16, family="t5gemma", bindings=GEMMA_NARROW_DECODER
    ),
}
# For TPU's compiler only (--tpu v2:2x2 --cases ...): the SQuAD experiments' 512-token inputs,
# scaled down to tiny with 12 encoder layers (the docs' second table).
LONG_INPUT_CASES = {
    f"tiny12_512_{remat}": XlaCase("tiny", 128, 512, 32, 2, remat, encoder_layers=12)
    for remat in ("none", "full")
} | {
    # T5Gemma 2B-2B at two layers a stack on a v5e-8 (--tpu v5e:2x4; minutes to compile).
    "t5gemma_2b_2b_two_layers": XlaCase(
        "2b_2b", 8, 512, 128, 8, family="t5gemma", encoder_layers=2
    ),
}
# The rows every test run compiles on CPU: each mechanism the plan models on its own (data
# and model parallelism, microbatches, both kinds of peak, the norms YNNPACK takes at 4096
# tokens a device in the 2x4 row, scanned layers with jax's residuals or with remat). XLA's
# CPU scheduler runs an unrolled layer's recomputation early, so the unrolled remat rows are
# in the docs' table (with TPU's compiler's numbers) but not asserted.
CHECKED_CASES = (
    "small",
    "tiny",
    "tiny_4x2",
    "tiny_microbatches",
    "tiny_2x4",
    "tiny_scanned",
    "tiny_scanned_full",
    # T5Gemma's layers: data and model parallel, and unbalanced stacks.
    "t5gemma_tiny",
    "t5gemma_tiny_4x2",
    "t5gemma_tiny_unbalanced",
)


def _plan(config, work, num_partitions=1, devices=1, hbm_gib=None, rules=None):
    topology = partitioning.Topology("test", devices, 1, hbm_gib)
    partitioner = partitioning.Partitioner(num_partitions, rules, topology)
    return memory_plan.plan_training(config, optim.adafactor(), partitioner, work, devices)


def test_parameter_and_optimizer_bytes_are_exact():
    import flax.linen as nn
    import jax
    import numpy as np

    config = tiny_config()
    plan = _plan(config, memory_plan.Workload(8, 32, 8))
    assert plan.params == 1_050_368 * 4  # the tiny model's parameter count, float32
    params = nn.unbox(placements.boxed_params(config))
    opt_state = jax.eval_shape(optim.adafactor().init, params)
    assert plan.opt_state == sum(
        np.prod(x.shape) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(opt_state)
    )
    # With 4-way model parallelism every parameter but the norm scales takes 1/4 per device.
    sharded = _plan(config, memory_plan.Workload(8, 32, 8), num_partitions=4, devices=4)
    mesh = sharded.mesh
    whole = sum(
        p.bytes_per_device
        for p in sharded.placements
        if partitioning.shard_count(p.spec, mesh) == 1
    )
    assert whole == 128 * 4 * (2 * 2 + 3 * 2 + 2)  # 12 RMSNorm scales of 128 floats
    assert sharded.params == (plan.params - whole) // 4 + whole


# configs/models/t5gemma/tiny.gin's model: 953,088 parameters.
GEMMA_TINY = dict(
    vocab_size=1024,
    encoder=T5GemmaStack(
        emb_dim=128,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        mlp_dim=256,
        num_layers=2,
        query_pre_attn_scalar=32.0,
        sliding_window=16,
    ),
)


def test_t5gemma_parameter_gradient_and_optimizer_bytes_are_exact():
    """T5Gemma's own parameters (an embedding per stack, the output layer tied to the
    decoder's, norms before and after each block), its key/value heads sharded over 'model'
    only where they divide it, and a LoRA run's frozen bfloat16 base and float32 adapters."""
    import flax.linen as nn
    import jax
    import numpy as np

    from t5tpu.model import lora, param_shapes

    config = T5GemmaConfig(**GEMMA_TINY)
    work = memory_plan.Workload(8, 32, 8)
    plan = _plan(config, work)
    assert plan.params == plan.gradients == 953_088 * 4
    opt_state = jax.eval_shape(optim.adafactor().init, param_shapes.abstract_params(config))
    assert plan.opt_state == sum(
        np.prod(x.shape) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(opt_state)
    )
    key = "encoder/layers_1/attention/key/kernel"

    def spec(plan, name):
        return next(p.spec for p in plan.placements if p.name == name)

    two, four = (_plan(config, work, num_partitions=n, devices=n) for n in (2, 4))
    assert spec(two, key) == PartitionSpec(None, "model", None)  # 2 key/value heads
    assert spec(four, key) == PartitionSpec(None, None, None)
    assert spec(four, "encoder/layers_1/attention/query/kernel")[1] == "model"
    settings = lora.LoraSettings(targets=("q", "v", "wi"))
    adapted = lora_plan.plan_lora_training(
        config, settings, optim.adafactor(), partitioning.Partitioner(1), work, 1
    )
    _, adapters = lora.split(
        nn.unbox(param_shapes.boxed_abstract_params(dataclasses.replace(config, lora=settings)))
    )
    adapter_bytes = sum(np.prod(x.shape) * 4 for x in jax.tree_util.tree_leaves(adapters))
    assert adapted.gradients == adapter_bytes > 0
    assert adapted.params == 953_088 * 2 + adapter_bytes
    # TPU's activation counts are not calibrated for T5Gemma: the report says so.
    assert "unverified for T5Gemma on TPU" in plan_runner.report(plan)


@pytest.mark.parametrize(
    "overrides",
    [{}, {"scan_layers": True}, {"lora": "settings"}, {"lora": "settings", "scan_layers": True}],
    ids=["unrolled", "scanned", "lora", "lora_scanned"],
)
def test_parameter_shapes_traced_from_one_layer_are_the_whole_networks(overrides):
    """placements.boxed_params traces one layer a stack and repeats it: the same parameter
    names, shapes, dtypes and logical axes as the whole network traced, for stacks of unequal
    depth, unrolled or scanned, with LoRA adapters or without."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    from t5tpu.model import lora
    from t5tpu.model.network import Transformer

    if overrides.get("lora"):
        overrides = overrides | {"lora": lora.LoraSettings(targets=("q", "v", "wo"))}
    config = tiny_config(num_encoder_layers=3, num_decoder_layers=2, **overrides)
    tokens = jnp.ones((1, 1), jnp.int32)
    whole = jax.eval_shape(lambda: Transformer(config).init(jax.random.PRNGKey(0), tokens, tokens))[
        "params"
    ]
    from_one = placements.boxed_params(config)

    def described(boxed):
        shapes = jax.tree_util.tree_flatten_with_path(nn.unbox(boxed))[0]
        return [(path, leaf.shape, leaf.dtype) for path, leaf in shapes], nn.get_partition_spec(
            boxed
        )

    assert described(from_one) == described(whole)
    assert len(described(whole)[0]) > 20


def test_plan_says_what_to_turn_when_activations_do_not_fit():
    config = tiny_config()
    work = memory_plan.Workload(256, 512, 64)
    plan = _plan(config, work, devices=8, hbm_gib=0.25)
    assert plan.fits is False and plan.peak_phase == "start of the backward pass"
    found = knobs.ranked(plan, optim.adafactor(), partitioning.Partitioner(1))
    settings = [k.setting for k in found]
    assert "T5Config.remat_policy = 'full'" in settings
    assert any(s.startswith("NUM_MICROBATCHES = ") for s in settings)
    assert all(k.plan.peak < plan.peak for k in found)
    assert found[0].fits and found[0].plan.fits
    # remat and microbatches shrink only the activations; parameters stay.
    remat = found[settings.index("T5Config.remat_policy = 'full'")].plan
    # With two layers per stack, remat keeps one recomputed layer (both score tensors live)
    # instead of both layers' kept tensors (one score tensor each on TPU): 0.73 of them here.
    assert remat.activations < 0.75 * plan.activations and remat.params == plan.params


def test_2d_parameter_partitioning_divides_parameters_over_data():
    config = tiny_config()
    work = memory_plan.Workload(64, 64, 8)
    one_d = _plan(config, work, num_partitions=2, devices=8)
    two_d = _plan(
        config,
        work,
        num_partitions=2,
        devices=8,
        rules=partitioning.standard_logical_axis_rules("2d", "1d"),
    )
    assert two_d.params < one_d.params / 3  # 4-way 'data' on top of 2-way 'model'
    assert two_d.activations == one_d.activations
    # What the plan leaves out with 2-D (docs/memory_plan.md) is said where it prints.
    assert not one_d.parameters_over_data and two_d.parameters_over_data
    caveat = "low for 2-D parameter partitioning with unrolled layers"
    assert caveat in plan_runner.report(two_d) and caveat not in plan_runner.report(one_d)
    # Scanned layers gather one layer at a time: within 15% of TPU's compiler, no caveat.
    scanned = _plan(
        tiny_config(scan_layers=True, remat_policy="full"),
        work,
        num_partitions=2,
        devices=8,
        rules=partitioning.standard_logical_axis_rules("2d", "1d"),
    )
    assert caveat not in plan_runner.report(scanned)


def test_2d_parameters_with_unrolled_remat_layers_are_told_to_scan():
    """Unrolled, TPU's compiler gathered every layer's attention weights at once (11B on a
    v4-128: 12.45 GiB, scanned 4.10; docs/memory_plan.md): the plan suggests scanning."""
    work = memory_plan.Workload(64, 64, 8)
    rules = partitioning.standard_logical_axis_rules("2d", "1d")
    hint = "T5Config.scan_layers = True gathers one layer's at a time"  # after "with remat, "

    def report(**config):
        plan = _plan(tiny_config(**config), work, num_partitions=2, devices=8, rules=rules)
        return plan_runner.report(plan)

    assert hint in report(remat_policy="full")
    assert hint not in report(remat_policy="full", scan_layers=True)
    assert hint not in report(remat_policy="none")  # scanning without remat costs memory


def test_scanned_layers_without_remat_count_what_jax_saves():
    """Scanned without remat, jax (not XLA) decides what each layer saves, and saves more than
    TPU's compiler keeps of unrolled layers (float32 norm inputs, dropout masks): 3B on a
    v5e-64 peaked at 2.62 GiB scanned, 1.64 unrolled (docs/memory_plan.md). The plan counts
    jax's residuals, so it needs no caveat; the TPU compile below checks the numbers."""
    work = memory_plan.Workload(64, 128, 16)

    def plan(**config):
        config = tiny_config(dtype="bfloat16", dropout_rate=0.1, **config)
        return _plan(config, work, num_partitions=2, devices=8)

    unrolled, scanned = plan(), plan(scan_layers=True)
    assert scanned.activations > 1.5 * unrolled.activations
    assert "low for" not in plan_runner.report(scanned)
    # Dropout's masks are among the residuals: without dropout the layers save less.
    no_dropout = _plan(
        tiny_config(dtype="bfloat16", scan_layers=True), work, num_partitions=2, devices=8
    )
    assert no_dropout.activations < scanned.activations


def test_scanned_layers_keep_a_copy_of_their_stacked_weights():
    """Scanned layers keep their stacked weights at the activation dtype through the backward
    pass (docs/memory_plan.md): TPU's compiler casts them to bfloat16 once, before the forward
    loop (half their float32 bytes); in float32 the forward loop stacks them again as
    residuals (all of them). At both backward-pass peaks, not at the update."""
    work = memory_plan.Workload(64, 128, 16)
    unrolled = _plan(tiny_config(dtype="bfloat16"), work, devices=8)
    scanned = _plan(tiny_config(dtype="bfloat16", scan_layers=True), work, devices=8)
    layers = sum(p.bytes_per_device for p in scanned.placements if "/layers/" in p.name)
    assert scanned.params == unrolled.params and scanned.weight_copy == layers // 2 > 0
    assert unrolled.weight_copy == 0
    remat = dict(remat_policy="full")  # the same activations scanned and unrolled
    unrolled = _plan(tiny_config(dtype="bfloat16", **remat), work, devices=8)
    scanned = _plan(tiny_config(dtype="bfloat16", scan_layers=True, **remat), work, devices=8)
    # (Adafactor's state differs by a few bytes: one set of factored moments per stack.)
    extra = {name: scanned.phases[name] - unrolled.phases[name] for name in scanned.phases}
    opt_state = scanned.opt_state - unrolled.opt_state
    assert extra == {
        "start of the backward pass": layers // 2 + opt_state,
        "end of the decoder's backward pass": layers // 2 + opt_state,
        "optimizer update": opt_state,
    }
    float32 = _plan(tiny_config(scan_layers=True), work, devices=8)
    assert float32.weight_copy == layers


def test_the_compiled_peak_decides_the_verdict():
    """When the step was compiled, XLA's peak judges the fit, even where the estimate fits."""
    from t5tpu.planning.compiled_memory import CompiledMemory

    work = memory_plan.Workload(64, 128, 16)
    estimate = _plan(tiny_config(), work, devices=8)
    hbm_gib = 1.2 * estimate.peak / partitioning.GiB
    plan = _plan(tiny_config(), work, devices=8, hbm_gib=hbm_gib)
    state = plan.params + plan.opt_state
    compiled = CompiledMemory("TPU v3", state, int(1.5 * plan.peak) - state, state, state)
    assert plan.fits and compiled.peak == int(1.5 * plan.peak)
    # The knobs are estimates: judged against the HBM scaled by estimate / compiled (0.8 of
    # the estimate here), not against the HBM the estimate already fits.
    budget = plan_runner.knob_budget(plan, compiled)
    assert budget == pytest.approx(0.8 * plan.peak, rel=1e-6)
    options = knobs.ranked(plan, optim.adafactor(), partitioning.Partitioner(1), budget)
    assert any(not k.fits for k in options) and any(k.fits for k in options)
    assert all(k.fits == (k.plan.peak <= budget) for k in options)
    text = plan_runner.report(plan, options, compiled)
    assert "the estimate is 0.67 of it" in text
    assert f"DOES NOT FIT: peak {compiled.peak / partitioning.GiB:.2f} GiB" in text
    assert "(XLA's, compiled)" in text
    assert (
        "to make it fit (estimated peaks, lowest first; the compiler needed 1.50x the "
        f"estimate, so each must stay under {budget / 2**20:.2f} MiB; compile to check):"
    ) in text


def test_cpu_and_tpu_compilers_differ_in_the_update_and_in_remat():
    """XLA's CPU compiler materializes two parameter-sized update temporaries and runs remat's
    recomputation during the forward pass; TPU's does neither (docs/memory_plan.md)."""
    config = tiny_config(remat_policy="full")
    work = memory_plan.Workload(64, 128, 16)
    cpu_topology = partitioning.Partitioner(1, None, partitioning.Topology("cpu", 8))
    cpu = memory_plan.plan_training(config, optim.adafactor(), cpu_topology, work, 8)
    tpu = _plan(config, work, devices=8)
    assert (cpu.compiler, tpu.compiler) == ("cpu", "tpu")
    update = "optimizer update"
    assert cpu.phases[update] - tpu.phases[update] == 2 * cpu.gradients == 2 * cpu.params
    no_remat = dataclasses.replace(config, remat_policy="none")
    cpu_no_remat = memory_plan.plan_training(no_remat, optim.adafactor(), cpu_topology, work, 8)
    assert cpu.activations == cpu_no_remat.activations
    assert tpu.activations < 0.7 * _plan(no_remat, work, devices=8).activations


@pytest.fixture(scope="module")
def xla_analysis():
    """XLA's memory analysis of the compiled train step on 8 fake devices (this file as a
    script; the backend optimization level changes code generation, not buffer assignment)."""
    return run_script_on_eight_devices(__file__, "--cases", ",".join(CHECKED_CASES))


@pytest.mark.slow
@pytest.mark.parametrize("name", CHECKED_CASES)
def test_plan_is_within_15_percent_of_xla(xla_analysis, name):
    case = xla_analysis[name]
    assert case["plan_peak"] == pytest.approx(case["xla_peak"], rel=0.15), case
    # The exactly counted part matches XLA's arguments (state and batch) to the byte or so.
    assert case["plan_state"] == pytest.approx(case["xla_arguments"], rel=0.01), case


# scripts/test.sh installs libtpu (TPU's compiler) here rather than into .venv: installed, it
# makes every jax start on a machine without TPUs print libtpu's complaints.
LIBTPU = os.path.join(ROOT, ".libtpu")


def with_libtpu() -> dict:
    assert os.path.isdir(os.path.join(LIBTPU, "libtpu")), "no .libtpu: run scripts/test.sh"
    return dict(os.environ, PYTHONPATH=LIBTPU)


def _mib(name: str, text: str) -> float:
    """A row of the per-device table, e.g. '  parameters   230.81'."""
    return float(re.search(rf"^  {name} +([\d.]+)", text, re.MULTILINE).group(1))


@pytest.mark.slow
def test_plan_compiles_the_step_for_a_tpu_slice_without_one():
    """With plan.compile, TPU's compiler (libtpu's compile-only devices of a v2-8) builds the
    real step (of two layers a stack); the verdict is XLA's, the estimate is within 15% of it,
    and XLA's arguments are the exactly counted state."""
    run = t5tpu(
        "plan",
        "--gin_file=configs/experiments/qp_is_duplicate_small_v2-8.gin",
        "--gin.plan.compile=True",
        *TWO_LAYERS,
        env=with_libtpu(),
    )
    assert run.returncode == 0, run.stderr[-2000:]
    out = run.stdout
    assert run.stderr == "", run.stderr  # libtpu's complaints off a TPU VM are kept quiet
    assert "compiling the train step for v2:2x2" in out
    estimate, compiled = _mib("peak \\(estimate\\)", out), _mib("peak \\(XLA, compiled\\)", out)
    assert estimate == pytest.approx(compiled, rel=0.15)
    assert f"the estimate is {estimate / compiled:.2f} of it" in out
    arguments = float(re.search(r"TPU's heap peak, with the arguments ([\d.]+)", out).group(1))
    state = sum(_mib(part, out) for part in ("parameters", "optimizer state", "batch"))
    assert arguments == pytest.approx(state, rel=0.01)
    assert f"fits: peak {compiled / 1024:.2f} GiB of 8 GiB HBM per device (XLA's, compiled)" in out
    # The roofline of that compiled step on a v2's cores (22.5 TFLOP/s, 350 GB/s each): XLA's
    # FLOPs near the analytic count (3 forward passes, a core's 32 of the 256 rows).
    found = re.search(
        r"roofline \(an ESTIMATE from XLA's cost analysis of the compiled step, not measured\): "
        r"([\d.]+) TFLOP and ([\d.]+) GB per device a step\n    at v2's 22.5 TFLOP/s bf16 peak "
        r"and 350 GB/s HBM per device: at least ([\d.]+) ms a step \((compute|memory)-bound\), "
        r"at most ([\d,]+) examples/s",
        out,
    )
    assert found, out
    tflop, gb, ms = (float(found.group(i)) for i in (1, 2, 3))
    assert ms == pytest.approx(max(tflop / 22.5, gb / 350) * 1e3, abs=0.06)
    assert float(found.group(5).replace(",", "")) == pytest.approx(256 / ms * 1e3, rel=0.01)
    flags = [f"--gin_file={T5_10_SMALL}", *TWO_LAYERS]
    config = bench_workloads.build_model(bench.parse_args(flags)).config
    analytic = 3 * bench_workloads.forward_flops(config, 256, 128, 4) / 8
    assert tflop * 1e12 == pytest.approx(analytic, rel=0.1)


def test_roofline_is_the_longer_floor_on_the_chips_table():
    """Per device: a v2 core has half a chip's 45 TFLOP/s and 700 GB/s, a v4 device (megacore)
    the chip's; a step takes at least the longer of its compute and memory times. A scanned or
    microbatched step (XLA counts a loop's body once) is scaled up to the analytic FLOPs."""
    v2, v4 = roofline.chip_of("v2:2x2"), roofline.chip_of("v4:2x2x1")
    assert (v2.device_flops, v2.device_bandwidth) == (22.5e12, 350e9)
    assert (v4.device_flops, v4.device_bandwidth) == (275e12, 1200e9)
    assert roofline.chip_of("cpu") is None and roofline.chip_of(None) is None
    step = roofline.Roofline(flops=2.25e12, bytes_accessed=7e9, chip=v2, batch_size=64)
    assert (step.compute_seconds, step.memory_seconds) == (0.1, 0.02)
    assert step.bound == "compute" and step.examples_per_s == pytest.approx(640)
    memory = roofline.Roofline(flops=2.75e12, bytes_accessed=24e9, chip=v4, batch_size=8)
    assert memory.bound == "memory" and memory.step_seconds == pytest.approx(0.02)
    scanned = roofline.of_train_step(
        flops=1e12, bytes_accessed=1e9, analytic_flops=4e12, loops=True, chip=v4, batch_size=8
    )
    assert (scanned.flops, scanned.bytes_accessed, scanned.scaled) == (4e12, 4e9, 4.0)
    unrolled = roofline.of_train_step(
        flops=1e12, bytes_accessed=1e9, analytic_flops=4e12, loops=False, chip=v4, batch_size=8
    )
    assert unrolled.scaled == 1.0
    lines = roofline.describe(scanned, "v4")
    assert "ESTIMATE" in lines[0] and "scaled 4.00x to the analytic FLOPs" in lines[0]
    assert lines[1] == (
        "    at v4's 275 TFLOP/s bf16 peak and 1200 GB/s HBM per device: at least 14.5 ms a "
        "step (compute-bound), at most 550 examples/s"
    )


@pytest.mark.slow
def test_scanned_layers_without_remat_are_within_15_percent_of_tpu():
    """TPU's compiler (libtpu's compile-only devices of a v2-8) on tiny with scanned layers and
    no remat, data and model parallel."""
    cases = "tiny_scanned,tiny_scanned_4x2"
    env = with_libtpu() | {"JAX_PLATFORMS": "cpu"}
    analysis = run_script_on_eight_devices(__file__, "--tpu", "v2:2x2", "--cases", cases, env=env)
    for name, case in analysis.items():
        assert case["plan_peak"] == pytest.approx(case["xla_peak"], rel=0.15), (name, case)


@pytest.mark.slow
def test_a_step_tpu_cannot_place_does_not_fit():
    """TPU's compiler refuses a step that does not fit its HBM (here told the chip has 4 MiB);
    the plan reports the compiler's reason and the knobs."""
    run = t5tpu(
        "plan",
        "--gin_file=configs/experiments/qp_is_duplicate_tiny_cpu.gin",
        "--gin_file=configs/topologies/v2-8.gin",
        "--gin.plan.compile=True",
        env=with_libtpu() | {"LIBTPU_INIT_ARGS": "--xla_tpu_max_hbm_size_mib=4"},
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert re.search(
        r"compiled for TPU v2: Ran out of memory on HBM, .* \(([\d.]+)M\) exceeds available "
        r"HBM \(4.00M\)",
        run.stdout,
    )
    assert "DOES NOT FIT: TPU's compiler could not place the step in the chip's HBM" in run.stdout
    # Knobs are judged against the 4 MiB the compiler had, scaled by how far it needed more
    # than the estimate, and the slice to ask for comes from the compiler's figures.
    needed = float(re.search(r"\(([\d.]+)M\) exceeds", run.stdout).group(1))
    estimate = _mib("peak \\(estimate\\)", run.stdout)
    ratio, budget = map(
        float,
        re.search(
            r"the compiler needed ([\d.]+)x the estimate, so each must stay under ([\d.]+) "
            r"MiB; compile to check\):",
            run.stdout,
        ).groups(),
    )
    assert ratio == pytest.approx(needed / estimate, abs=0.01)
    assert budget == pytest.approx(4 * estimate / needed, abs=0.01)
    knob_peaks = re.findall(r"^  .*: peak ([\d.]+) MiB \((fits|still too big)\)$", run.stdout, re.M)
    assert knob_peaks and all((float(p) <= budget) == (v == "fits") for p, v in knob_peaks)
    assert (
        f"use a slice with at least {math.ceil(needed / 4 * 10) / 10:.1f}x the memory" in run.stdout
    )


def test_plan_compile_without_libtpu_says_what_to_install():
    run = t5tpu(
        "plan",
        "--gin_file=configs/experiments/qp_is_duplicate_small_v2-8.gin",
        "--gin.plan.compile=True",
    )
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        "t5tpu: error: compiling for v2-8 needs libtpu: install the TPU compiler that matches "
        "this jax (pip install -c constraints.txt libtpu, or pip install -e '.[tpu]'); no TPU "
        "is needed"
    ]


def test_plan_refuses_a_batch_that_train_would_refuse():
    run = t5tpu(
        "plan", "--gin_file=configs/experiments/qp_all_small_v2-8.gin", "--gin.BATCH_SIZE=100"
    )
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        "t5tpu: error: BATCH_SIZE = 100 must be a positive multiple of the 8 data-parallel devices"
    ]


@pytest.mark.slow
def test_every_tpu_topology_names_a_slice_libtpu_knows():
    """Each topology file's Topology.tpu_topology describes its device count (checked by
    compile_only_devices, which raises otherwise)."""
    names = sorted(
        name[:-4]
        for name in os.listdir(package_files.configs_dir("topologies"))
        if name != "cpu.gin"
    )
    code = (
        "import gin, sys\n"
        "from t5tpu import partitioning\n"
        "from t5tpu.config import gin_setup\n"
        "from t5tpu.planning import compiled_memory\n"
        "for name in sys.argv[1:]:\n"
        "    gin.clear_config()\n"
        "    gin_setup.parse([f'configs/topologies/{name}.gin'], [], [])\n"
        "    topology = partitioning.Topology()\n"
        "    with compiled_memory.libtpu_environment(topology):\n"
        "        devices = compiled_memory.compile_only_devices(topology)\n"
        "    print(name, topology.tpu_topology, len(devices), devices[0].device_kind)\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code, *names],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=with_libtpu(),
    )
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [line.split(" ", 3) for line in run.stdout.splitlines()]
    assert [row[0] for row in rows] == names
    assert tuple(rows[names.index("v5e-64")][:3]) == ("v5e-64", "v5e:8x8", "64")
    assert tuple(rows[names.index("v3-128")][:3]) == ("v3-128", "v3:8x8", "128")


def test_plan_command_on_a_v2_8_experiment():
    """squad_v1_large_v2-8 without its remat setting: the plan says it does not fit, and which
    knob fixes it; the table lists every parameter role with its logical and mesh axes."""
    run = t5tpu(
        "plan",
        "--gin_file=configs/experiments/squad_v1_large_v2-8.gin",
        "--gin.T5Config.remat_policy='none'",
    )
    assert run.returncode == 0, run.stderr[-2000:]
    out = run.stdout
    assert "topology v2-8: 8 devices on 1 host(s), 8 GiB HBM per device; mesh data=1 x model=8" in (
        out
    )
    assert "remat none" in out and "DOES NOT FIT: peak" in out
    knobs = out.split("to make it fit (lowest peak first):")[1].splitlines()
    assert knobs[1].strip().startswith("T5Config.remat_policy = 'full': peak")
    assert knobs[1].strip().endswith("(fits)")
    assert re.search(
        r"encoder/layers_\*/mlp/wi/kernel +x24 +\(1024, 4096\) +\(embed, mlp\) +-> \(-, model\)",
        out,
    )
    assert re.search(r"token_embedder/embedding +x1 +\(32128, 1024\) .*-> \(model, -\)", out)
    assert len(re.findall(r" x(24|1) +\(", out)) == 26  # every parameter role of T5 1.0 large


@pytest.mark.parametrize(
    "model, count",
    [
        ("mt5/small", "300,176,768"),
        ("umt5/small", "306,601,984"),
        ("byt5/small", "299,637,760"),
        ("t5gemma/2b_2b", "5,596,853,760"),
    ],
)
def test_plan_of_a_model_gin_alone(model, count):
    """configs/runs/plan.gin, read first, supplies what a model file leaves out (DROPOUT_RATE,
    finetune.gin's optimizer and batch, lengths, the CPU topology)."""
    run = t5tpu("plan", f"--gin_file=configs/models/{model}.gin")
    assert run.returncode == 0, run.stderr[-2000:]
    assert f"model: {count} parameters (float32)" in run.stdout
    assert "step: batch 128, inputs 512, targets 128" in run.stdout


def test_tpu_vm_dry_run_prints_the_gcloud_commands():
    script = os.path.join(ROOT, "scripts", "tpu_vm.sh")

    def dry(*args):
        run = subprocess.run(
            ["bash", script, "--dry-run", "--name=t5", "--zone=europe-west4-a", *args],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert run.returncode == 0, run.stderr
        return run.stdout.strip()

    assert dry("create", "--accelerator=v3-32") == (
        "gcloud compute tpus tpu-vm create t5 --accelerator-type=v3-32 "
        "--version=tpu-ubuntu2204-base --zone=europe-west4-a"
    )
    assert "--accelerator-type=v5litepod-8 --version=v2-alpha-tpuv5-lite" in dry(
        "create", "--accelerator=v5e-8"
    )
    build, copy, install = dry("install").splitlines()
    assert build.startswith("python3 -m pip wheel --no-deps --wheel-dir=")
    wheel = "t5tpu-0.1.0-py3-none-any.whl"
    assert copy.startswith("gcloud compute tpus tpu-vm scp ")
    assert f" t5:{wheel} --worker=all" in copy
    assert install.startswith("gcloud compute tpus tpu-vm ssh t5 --worker=all '--command=")
    assert f"pip install '\\''./{wheel}[tpu]'\\''" in install
    launch = dry(
        "launch",
        "--",
        "t5tpu",
        "train",
        "--gin_file=configs/experiments/squad_v1_large_v3-32.gin",
        "--gin.MODEL_DIR='gs://b/run'",
    )
    assert "--worker=all" in launch and "> ~/t5tpu.log 2>&1 &" in launch
    # What the workers' shell receives runs the command with its arguments intact.
    remote = subprocess.run(
        ["bash", "-c", f"gcloud() {{ printf '%s\\n' \"${{@: -2:1}}\"; }}; {launch}"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    args = subprocess.run(
        ["bash", "-c", remote.removeprefix("--command=").split(" > ")[0] + " | cat"],
        capture_output=True,
        text=True,
        env=dict(os.environ, PATH=_echo_path()),
    ).stdout.splitlines()
    assert args == [
        "train",
        "--gin_file=configs/experiments/squad_v1_large_v3-32.gin",
        "--gin.MODEL_DIR='gs://b/run'",
    ]
    assert dry("logs") == (
        "gcloud compute tpus tpu-vm ssh t5 --worker=0 '--command=tail -n 100 -f ~/t5tpu.log' "
        "--zone=europe-west4-a"
    )
    assert dry("delete") == ("gcloud compute tpus tpu-vm delete t5 --quiet --zone=europe-west4-a")
    missing = subprocess.run(
        ["bash", script, "--dry-run", "delete"], capture_output=True, text=True
    )
    assert missing.returncode == 2 and "--name=NAME" in missing.stderr


def _echo_path() -> str:
    """A PATH whose `nohup` and `t5tpu` print their arguments one per line."""
    import tempfile

    directory = tempfile.mkdtemp()
    for name, body in (("nohup", 'exec "$@"'), ("t5tpu", "printf '%s\\n' \"$@\"")):
        path = os.path.join(directory, name)
        with open(path, "w") as f:
            f.write(f"#!/bin/bash\n{body}\n")
        os.chmod(path, 0o755)
    return f"{directory}:{os.environ['PATH']}"


# ----- the 8-device worker: XLA's view of the compiled train step ------------------------------


def _xla_memory(model, optimizer, partitioner, work: memory_plan.Workload) -> dict:
    """XLA's compiled memory analysis of the real train step: its peak and argument bytes."""
    from t5tpu.planning import compiled_memory

    memory = compiled_memory.train_step_memory(model, optimizer, partitioner, work)
    return {"xla_peak": memory.peak, "xla_arguments": memory.arguments}


def _xla_worker(names: list[str], tpu_topology: str | None = None) -> dict:
    """{case name: XLA's peak and arguments, the plan's peak and state} for the named cases,
    compiled for the 8 (fake) CPU devices, or with `tpu_topology` (e.g. 'v3:2x2') for that
    TPU slice's compile-only devices (needs libtpu, no TPU)."""
    from t5tpu.config import gin_setup
    from t5tpu.model.encoder_decoder import EncoderDecoderModel
    from t5tpu.planning import compiled_memory

    devices, topology = None, partitioning.Topology()  # the 'cpu' topology: CPU's compiler
    if tpu_topology:
        topology = partitioning.Topology(tpu_topology, tpu_topology=tpu_topology)
        with compiled_memory.libtpu_environment(topology):
            devices = compiled_memory.compile_only_devices(topology)
    cases = XLA_CASES | LONG_INPUT_CASES
    if unknown := [name for name in names if name not in cases]:
        raise UserError(f"unknown case(s) {', '.join(unknown)}; known: {', '.join(cases)}")
    results = {}
    for name in names:
        case = cases[name]
        gin_setup.parse(
            [f"configs/models/{case.family}/{case.size}.gin"],
            [
                "DROPOUT_RATE = 0.0",
                "default_vocabulary.sentencepiece_model_file = @bundled_vocabulary_file()",
                "default_vocabulary.extra_ids = 0",
                # as the TPU topologies run it; CPU's compiler converts bfloat16 to float32
                *case.gin_bindings("bfloat16" if tpu_topology else "float32"),
            ],
            [],
        )
        model, optimizer = EncoderDecoderModel(), optim.adafactor()
        partitioner = partitioning.Partitioner(case.model_parallelism, None, topology, devices)
        work = memory_plan.Workload(
            case.batch, case.input_length, case.target_length, case.microbatches
        )
        plan = memory_plan.plan_training(model.config, optimizer, partitioner, work, 8)
        results[name] = _xla_memory(model, optimizer, partitioner, work) | {
            "plan_peak": plan.peak,
            "plan_state": plan.params + plan.opt_state + plan.batch,
        }
    return results


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="XLA's memory analysis against the plan")
    parser.add_argument("--cases", default=",".join(XLA_CASES), help="comma-separated names")
    parser.add_argument("--tpu", help="a TPU topology to compile for, e.g. v3:2x2 (libtpu)")
    args = parser.parse_args()
    try:
        print(json.dumps(_xla_worker(args.cases.split(","), args.tpu)))
    except UserError as e:  # an unknown case, a slice libtpu does not know
        print(f"test_plan.py: error: {e}", file=sys.stderr)
        sys.exit(2)
