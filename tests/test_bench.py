"""`t5tpu bench` on the tiny model: every workload runs and reports, the HF comparison builds
the same geometry, and the analytic FLOPs agree with XLA's count. No timing is asserted: the
benchmark measures speed, the tests check that what it measures is the right thing."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from t5tpu.tools import bench, bench_hf, bench_timing, bench_workloads

TINY = "configs/models/t5_1_1/tiny.gin"
SHAPE = ["--batch_size=2", "--input_length=16", "--target_length=8", "--decode_length=6"]


def run_bench(capsys, *flags):
    assert bench.main([f"--gin_file={TINY}", *SHAPE, "--steps=1", "--warmup=0", *flags]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    return [json.loads(line) for line in lines]


def by_workload(results, impl=bench.OURS):
    return {r["workload"]: r for r in results if r.get("impl", impl) == impl}


def test_every_workload_reports_against_hf(capsys, tmp_path):
    output = tmp_path / "bench.jsonl"
    results = run_bench(capsys, "--compare_hf", "--pipeline_batches=3", f"--output={output}")
    assert [json.loads(line) for line in output.read_text().splitlines()] == results

    ours, hf = by_workload(results), by_workload(results, bench.HF)
    assert ours["machine"]["backend"] == jax.default_backend()
    for workload in ("train", "score"):
        for impl in (ours, hf):
            assert impl[workload]["tokens_per_s"] == pytest.approx(
                2 * 24 / impl[workload]["seconds_per_step"]
            )
    assert 0 < ours["train"]["mfu"] < 1
    assert ours["train"]["compile_seconds"] > 0
    for workload, beams in (("greedy", 1), ("beam", 4)):
        for impl in (ours, hf):
            assert impl[workload]["num_beams"] == beams
            assert impl[workload]["new_tokens_per_s"] == pytest.approx(
                12 / impl[workload]["seconds_per_batch"]
            )
    assert ours["pipeline"]["task"] == "qp_is_duplicate" and ours["pipeline"]["examples_per_s"] > 0

    ratios = {r["workload"]: r for r in results if r.get("impl") == f"{bench.OURS}/{bench.HF}"}
    assert set(ratios) == {"train", "score", "greedy", "beam"}
    assert ratios["greedy"]["ratio"] == pytest.approx(
        ours["greedy"]["new_tokens_per_s"] / hf["greedy"]["new_tokens_per_s"]
    )
    derived = [r["workload"] for r in results if "time_per_token_ratio" in r]
    assert derived == ["beam/greedy", "beam/greedy"]
    assert by_workload(results)["pipeline/train"]["examples_per_s_ratio"] > 0


def test_hf_reference_has_our_geometry():
    args = bench.parse_args([f"--gin_file={TINY}"])
    model = bench_workloads.build_model(args)
    ours = sum(np.size(p) for p in jax.tree.leaves(bench_workloads._random_params(model, args)))
    theirs = sum(p.numel() for p in bench_hf.hf_model(model.config, "float32").parameters())
    assert theirs == ours == 1_050_368


def test_forward_flops_match_xla_count():
    """The analytic count (matmuls only) against XLA's count of the compiled scoring pass
    (which adds the elementwise work: norms, softmax, GELU)."""
    args = bench.parse_args(
        [f"--gin_file={TINY}", "--batch_size=4", "--input_length=64", "--target_length=32"]
    )
    model = bench_workloads.build_model(args)
    batch = bench_workloads.random_batch(
        np.random.default_rng(0), 4, 64, 32, model.config.vocab_size
    )
    features = {k: jnp.asarray(v) for k, v in batch.items()}
    params = bench_workloads._random_params(model, args)
    _, _, cost = bench_timing.compile_seconds(jax.jit(model.score), params, features)
    analytic = bench_workloads.forward_flops(model.config, 4, 64, 32)
    assert analytic == pytest.approx(cost["flops"], rel=0.05)  # measured: 0.98


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--workloads=train,fly"], "unknown workload(s) fly"),
        (["--batch_size=0"], "must be positive"),
        (["--num_beams=0"], "--num_beams must be >= 1"),
        (["--steps=x"], "argument --steps: invalid int value: 'x'; see t5tpu bench --help"),
    ],
)
def test_bad_flags_are_user_errors(flags, message):
    with pytest.raises(bench.UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        bench.parse_args([f"--gin_file={TINY}", *flags])
