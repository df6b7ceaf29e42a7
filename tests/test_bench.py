"""`t5tpu bench` on the tiny model: every workload runs and reports against the machine's
limits, --json prints one line per workload, the HF comparison builds the same geometry, and the
analytic FLOPs and decoding bytes agree with XLA's count and a hand count. No timing is asserted:
the benchmark measures speed, the tests check that what it measures is the right thing."""

import dataclasses
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cli_runs import succeeded, t5tpu

from t5tpu import package_files
from t5tpu.bench import hf, kernels, limits, timing, workload_names, workloads
from t5tpu.cli import bench

TINY = "configs/models/t5_1_1/tiny.gin"
SHAPE = ["--batch_size=2", "--input_length=16", "--target_length=8", "--decode_length=6"]
# Small limit probes: the tests check what they report, not the machine.
QUICK = ["--steps=1", "--warmup=0", "--matmul_size=128", "--stream_mb=4", "--limit_probes=3"]


def run_bench(capfd, *flags):
    """(stdout's lines, parsed). capfd: the file descriptor, so C++ logs there would count."""
    assert bench.main([f"--gin_file={TINY}", *SHAPE, *QUICK, *flags]) == 0
    return capfd.readouterr().out.splitlines()


def by_workload(results, impl=workload_names.OURS):
    return {r["workload"]: r for r in results if r.get("impl", impl) == impl}


def engine_calls(monkeypatch) -> list:
    """Where Engine.generate and Engine.score calls are recorded: (kind, request, rows, lengths
    of what came back (generate) or of the targets (score))."""
    from t5tpu.model import engine

    calls = []
    generate, score = engine.Engine.generate, engine.Engine.score

    def counted_generate(self, rows, request, **kwargs):
        out = generate(self, rows, request, **kwargs)
        calls.append(("generate", request, len(rows), {len(ids) for ids in out}))
        return out

    def counted_score(self, inputs, targets):
        calls.append(("score", None, len(inputs), {len(t) for t in targets}))
        return score(self, inputs, targets)

    monkeypatch.setattr(engine.Engine, "generate", counted_generate)
    monkeypatch.setattr(engine.Engine, "score", counted_score)
    return calls


def check_engine_calls(calls: list) -> None:
    """score, greedy, sampling and beam ran Engine.score and Engine.generate (what infer, eval,
    the Python API and serve run) with the workloads' settings on the bench's 2 rows: the decode
    of --decode_length tokens (every row that long: no id ends it) and its prefill, a decode of
    one token; each first called once (its compiles), then once per timed repetition."""
    from t5tpu.model.decoding_settings import DecodingSettings

    greedy = DecodingSettings()
    sampling = dataclasses.replace(greedy, temperature=1.0)
    beam = dataclasses.replace(greedy, num_beams=4)
    requests = [(c[1].settings, c[1].max_length) for c in calls if c[0] == "generate"]
    assert sorted(map(str, requests)) == sorted(
        str((s, n)) for s in (greedy, sampling, beam) for n in (6, 6, 1, 1)
    )
    for kind, request, rows, lengths in calls:
        assert rows == 2
        assert lengths == ({8} if kind == "score" else {request.max_length})
    assert [c[0] for c in calls].count("score") == 2


@pytest.mark.slow
@pytest.mark.parity
def test_every_workload_reports_against_hf(capfd, tmp_path, monkeypatch):
    output = tmp_path / "bench.jsonl"
    flags = ["--json", "--compare_hf", "--pipeline_batches=3", f"--output={output}"]
    calls = engine_calls(monkeypatch)
    summary = [json.loads(line) for line in run_bench(capfd, *flags)]
    results = [json.loads(line) for line in output.read_text().splitlines()]
    check_engine_calls(calls)

    ours, hf = by_workload(results), by_workload(results, workload_names.HF)
    assert ours["machine"]["backend"] == jax.default_backend()
    for workload in ("train", "score"):
        for impl in (ours, hf):
            assert impl[workload]["tokens_per_s"] == pytest.approx(
                2 * 24 / impl[workload]["seconds_per_step"]
            )
    peaks = ("matmul_peak_float32", "matmul_peak_bfloat16")
    for name in (*peaks, "stream_bandwidth", "gemv_bandwidth"):
        for suffix in ("", "_end"):
            limit = ours[f"limit_{name}{suffix}"]
            assert len(limit["probes"]) == 3 and 0 < limit["min"] <= limit["value"] <= limit["max"]
    assert ours["train"]["mfu"] == ours["train"]["fraction_of_limit"]
    assert ours["train"]["compile_seconds"] > 0
    for workload, beams in (("greedy", 1), ("sampling", 1), ("beam", 4)):
        for impl in (ours, hf):
            assert impl[workload]["num_beams"] == beams
            assert impl[workload]["new_tokens_per_s"] == pytest.approx(
                12 / impl[workload]["seconds_per_batch"]
            )
        assert ours[workload]["prefill_seconds"] > 0
    assert ours["pipeline"]["task"] == "qp_is_duplicate" and ours["pipeline"]["examples_per_s"] > 0

    both = f"{workload_names.OURS}/{workload_names.HF}"
    ratios = {r["workload"]: r for r in results if r.get("impl") == both}
    assert set(ratios) == {"train", "score", "greedy", "sampling", "beam"}
    assert ratios["greedy"]["ratio"] == pytest.approx(
        ours["greedy"]["new_tokens_per_s"] / hf["greedy"]["new_tokens_per_s"]
    )
    derived = [r["workload"] for r in results if "time_per_token_ratio" in r]
    assert derived == ["beam/greedy", "beam/greedy"]
    assert by_workload(results)["pipeline/train"]["examples_per_s_ratio"] > 0
    check_summary(summary, ours)


def check_summary(summary, ours):
    """--json's stdout: one line per workload, t5tpu's figures with HF's beside them."""
    assert [line["workload"] for line in summary] == list(workload_names.WORKLOADS)
    for line in summary:
        assert line["tokens_per_s"] > 0 and line["step_ms"] > 0 and line["limit"]
    lines = {line["workload"]: line for line in summary}
    for workload in ("train", "score", "greedy", "sampling", "beam"):
        line = lines[workload]
        assert line["fraction_of_limit"] == ours[workload]["fraction_of_limit"] > 0
        assert len(ours[workload]["limit_probes"]) == 1  # one after each of its 1 repetitions
        assert line["hf_ratio"] == pytest.approx(line["tokens_per_s"] / line["hf_tokens_per_s"])
        assert line["dense_share"] == pytest.approx(line["dense_matmul_ms"] / line["step_ms"])
        assert len(ours[workload]["dense_matmul_probes"]) == 1 and line["dense_share"] > 0
    assert lines["train"]["step_ms"] == pytest.approx(ours["train"]["seconds_per_step"] * 1e3)
    assert lines["score"]["limit"].startswith("matmul peak")
    assert "float32 matmul" in lines["score"]["limit"]  # the tiny model's dtype
    beam = lines["beam"]
    assert beam["limit"].startswith("memory floor") and beam["num_beams"] == 4
    # A decoding step: the decode less its prefill (a decode of one token; when the prefill is
    # shorter: not always on a tiny model, one repetition), over the other 5 steps.
    assert 0 < beam["step_ms"] * 5 <= ours["beam"]["seconds_per_batch"] * 1e3
    assert beam["fraction_of_limit"] == pytest.approx(beam["memory_floor_ms"] / beam["step_ms"])
    assert lines["pipeline"]["fraction_of_limit"] is None and "hf_ratio" not in lines["pipeline"]


def test_without_json_every_result_and_a_table(capfd, tmp_path):
    output = tmp_path / "bench.jsonl"
    lines = run_bench(capfd, "--workloads=score", f"--output={output}")
    results = [json.loads(line) for line in lines if line.startswith("{")]
    assert [json.loads(line) for line in output.read_text().splitlines()] == results
    assert "of limit" in lines[len(results)] and lines[-1].startswith("limit_gemv_bandwidth_end")


def test_train_on_two_devices_is_set_against_one_devices_share(tmp_path):
    """The step runs data-parallel on 2 (fake CPU) devices while the peak and the dense matmuls
    are probed on one: the fraction counts half the FLOPs, the dense chain half the rows."""
    output = tmp_path / "bench.jsonl"
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    flags = [f"--gin_file={TINY}", *SHAPE, *QUICK, "--workloads=train", f"--output={output}"]
    succeeded(t5tpu("bench", *flags, env=env))
    train = by_workload([json.loads(line) for line in output.read_text().splitlines()])["train"]
    assert train["devices"] == 2
    per_device = train["flops_per_step"] / 2 / train["seconds_per_step"]
    assert train["fraction_of_limit"] == pytest.approx(per_device / train["limit_probes"][0])
    config = workloads.build_model(bench.parse_args([f"--gin_file={TINY}"])).config
    one_row = sum(m.flops for m in kernels.forward_dense(config, 1, 16, 8))
    dense_flops = train["dense_matmul_flops_per_s"] * train["dense_matmul_ms"] / 1e3
    assert dense_flops == pytest.approx(3 * one_row)  # 1 of the batch's 2 rows, with gradients
    odd = t5tpu("bench", *flags, "--batch_size=3", env=env)
    assert odd.returncode == 2
    wanted = "--batch_size = 3 must be a positive multiple of the 2 data-parallel devices"
    assert wanted in odd.stderr


def test_a_missing_gin_file_fails_before_anything_is_written(capfd, tmp_path):
    output = tmp_path / "bench.jsonl"
    with pytest.raises(bench.UserError, match="gin file not found: nope.gin"):
        bench.main(["--gin_file=nope.gin", f"--output={output}"])
    assert not output.exists() and capfd.readouterr().out == ""


BF16 = "--gin.T5Config.dtype='bfloat16'"


@pytest.mark.slow
def test_bf16_against_float32_in_the_same_run(capfd, tmp_path):
    """--compare_float32: each workload in bfloat16 (weights cast once for scoring and decoding)
    and in float32, alternating; each set against its own dtype's matmul peak, and their
    ratios."""
    output = tmp_path / "bench.jsonl"
    flags = [BF16, "--compare_float32", "--json", "--workloads=train,score,greedy"]
    summary = [json.loads(line) for line in run_bench(capfd, *flags, f"--output={output}")]
    results = [json.loads(line) for line in output.read_text().splitlines()]
    ours, float32 = by_workload(results), by_workload(results, workload_names.FLOAT32)
    assert ours["machine"]["dtype"] == "bfloat16"
    for workload in ("train", "score"):
        assert "bfloat16 matmul, float32 accumulation" in ours[workload]["limit"]
        assert "float32 matmul" in float32[workload]["limit"]
        assert "bfloat16" not in float32[workload]["limit"]
    ratios = {
        r["workload"]: r
        for r in results
        if r.get("impl") == f"{workload_names.OURS}/{workload_names.FLOAT32}"
    }
    assert set(ratios) == {"train", "score", "greedy"}
    lines = {line["workload"]: line for line in summary}
    for workload in ("train", "score", "greedy"):
        line = lines[workload]
        assert line["float32_ratio"] == pytest.approx(ratios[workload]["ratio"])
        assert line["float32_step_ms"] > 0 and "hf_ratio" not in line
    assert lines["greedy"]["float32_step_ms"] == pytest.approx(float32["greedy"]["step_ms"])
    with pytest.raises(bench.UserError, match="--compare_float32 needs a bfloat16 model"):
        bench.main([f"--gin_file={TINY}", "--compare_float32"])


MODELS = package_files.configs_dir("models")
MODEL_FILES = sorted(
    f"{family}/{name[:-4]}"
    for family in os.listdir(MODELS)
    if os.path.isdir(os.path.join(MODELS, family))
    for name in os.listdir(os.path.join(MODELS, family))
    if name.endswith(".gin") and not name.startswith("_")
)


@pytest.mark.parametrize("name", MODEL_FILES)
def test_every_model_file_builds_offline(name):
    """No vocabulary is read: a default_vocabulary that cannot be built (an unknown kind)
    would fail the moment anything evaluated it, as a gs:// file fails offline."""
    unbuildable = "--gin_bindings=default_vocabulary.kind = 'unbuildable'"
    args = bench.parse_args([f"--gin_file=configs/models/{name}.gin", unbuildable])
    model = workloads.build_model(args)
    assert model.vocabulary.vocab_size == model.config.vocab_size
    assert model.config.dtype == ("float32" if name.endswith("/tiny") else "bfloat16")


def test_bf16_decoding_reads_two_byte_weights_and_caches():
    args = bench.parse_args([f"--gin_file={TINY}", BF16])
    config = workloads.build_model(args).config
    float32 = limits.decode_step_bytes(dataclasses.replace(config, dtype="float32"), 2, 16, 6, 4)
    assert limits.decode_step_bytes(config, 2, 16, 6, beams=4) == {
        part: nbytes / 2 for part, nbytes in float32.items()
    }
    params = workloads._inference_params(workloads.build_model(args), args)
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}


def test_bf16_dense_chain_keeps_bf16_dots_and_its_flops():
    """The bfloat16 dense chain (precision.contract's forms, backward too) compiles to bf16
    dots only, with XLA counting the FLOPs the probe claims."""
    config = workloads.build_model(bench.parse_args([f"--gin_file={TINY}", BF16])).config
    matmuls = kernels.forward_dense(config, 2, 16, 8)
    probe = kernels.dense_probe(matmuls, jnp.bfloat16, backward=True)
    operands = kernels.dense_operands(matmuls, jnp.bfloat16, True)
    compiled = kernels.dense_chain(matmuls, True).lower(*operands).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    assert cost["flops"] == pytest.approx(probe.work, rel=0.01)
    hlo = compiled.as_text()
    types = dict(re.findall(r"%([\w.\-]+) = (\w+)\[", hlo))
    dots = re.findall(r" dot\(%([\w.\-]+), %([\w.\-]+)\)", hlo)
    assert len(dots) == 3 * len(matmuls)
    assert {(types[a], types[b]) for a, b in dots} == {("bf16", "bf16")}


@pytest.mark.parametrize("rows", [1, 4])
def test_feature_major_decode_chain_keeps_bf16_dots_and_its_flops(rows):
    """A decoding step's chain as CPU's bf16 step runs it (weights [out, in] on the left): bf16
    dots only, one per matmul, XLA counting the FLOPs the probe claims (a single row is fed
    twice, as the step does)."""
    config = workloads.build_model(bench.parse_args([f"--gin_file={TINY}", BF16])).config
    matmuls = kernels.decode_step_dense(config, rows)
    probe = kernels.dense_probe(matmuls, jnp.bfloat16, feature_major=True)
    operands = kernels.dense_operands(matmuls, jnp.bfloat16, False, feature_major=True)
    compiled = kernels.dense_chain(matmuls, False, feature_major=True).lower(*operands).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    assert cost["flops"] == pytest.approx(probe.work * (2 if rows == 1 else 1), rel=0.01)
    hlo = compiled.as_text()
    types = dict(re.findall(r"%([\w.\-]+) = (\w+)\[", hlo))
    dots = re.findall(r" dot\(%([\w.\-]+), %([\w.\-]+)\)", hlo)
    assert len(dots) == len(matmuls)
    assert {(types[a], types[b]) for a, b in dots} == {("bf16", "bf16")}


def test_limit_probes_are_positive_and_robust():
    kinds = limits.make_probes(matmul_size=64, memory_bytes=2**20)
    found = limits.probe_all(kinds, probes=5, best_k=3, when="probes in a test")
    peaks = {"matmul_peak_float32", "matmul_peak_bfloat16"}
    assert set(found) == peaks | {"stream_bandwidth", "gemv_bandwidth"}
    assert found["matmul_peak_bfloat16"].shape == "64^3 bfloat16 matmul, float32 accumulation"
    for limit in found.values():
        assert len(limit.probes) == 5 and min(limit.probes) > 0
        assert min(limit.probes) <= limit.value <= max(limit.probes)
        assert limit.value == sorted(limit.probes)[-2]  # the median of the best 3 of 5
    assert limits.robust([1.0, 5.0, 3.0, 9.0, 7.0, 2.0], best_k=4) == 5.0 + 1.0
    assert limits.robust([4.0], best_k=3) == 4.0


# umT5's decoder reads a position-bias table in each of its 2 layers, the others one.
@pytest.mark.parametrize("model, tables", [(TINY, 1), ("configs/models/umt5/tiny.gin", 2)])
def test_decode_floor_bytes_by_hand(model, tables):
    """Tiny geometry: emb 128, 4 heads x 32 (inner 128), gated mlp 256, 2 decoder layers, vocab
    1024, 32 relative-position buckets; batch 2, 4 beams, 16 input and 6 new tokens."""
    args = bench.parse_args([f"--gin_file={model}"])
    model = workloads.build_model(args)
    parts = limits.decode_step_bytes(model.config, 2, 16, 6, beams=4)
    # Self-attention q/k/v/out, cross-attention q/out, wi_0/wi_1/wo, three norm scales.
    layer = 4 * 128 * 128 + 2 * 128 * 128 + 3 * 128 * 256 + 3 * 128
    assert parts == {
        "decoder_weights": 4 * (2 * layer + 128 + tables * 32 * 4),  # + final norm, position bias
        "output_layer": 4 * 128 * 1024,
        "embedding_rows": 4 * 8 * 128,  # 2 examples x 4 beams
        "self_attention_cache": 4 * 2 * 2 * 8 * 128 * 3.5,  # k/v, layers, rows, (6 + 1) / 2
        "cross_attention_cache": 4 * 2 * 2 * 2 * 128 * 16,  # shared by each example's beams
    }

    def read_each_step(path) -> bool:
        name = jax.tree_util.keystr(path)
        cross_kv = "encoder_decoder_attention" in name and ("'key'" in name or "'value'" in name)
        return not cross_kv and "logits_dense" not in name

    decoder = workloads._random_params(model, args)["decoder"]
    leaves = jax.tree_util.tree_leaves_with_path(decoder)
    assert 4 * sum(np.size(x) for p, x in leaves if read_each_step(p)) == parts["decoder_weights"]


def test_dense_matmuls_are_the_weight_matmuls():
    """The dense-matmul chains count every weight matmul (the analytic FLOPs less attention's
    own matmuls) and XLA compiles all of them (its FLOP count of the chain, which adds only the
    carried scalar's adds)."""
    args = bench.parse_args([f"--gin_file={TINY}"])
    config = workloads.build_model(args).config
    inner, batch, inputs, targets, layers = 128, 2, 16, 8, 2
    attention = (
        2
        * batch
        * layers
        * (inputs * 2 * inputs * inner + targets * (2 * targets * inner + 2 * inputs * inner))
    )
    forward = kernels.forward_dense(config, batch, inputs, targets)
    assert sum(m.flops for m in forward) == pytest.approx(
        workloads.forward_flops(config, batch, inputs, targets) - attention
    )
    step = kernels.decode_step_dense(config, rows=8)
    step_attention = 2 * 8 * layers * (2 * inputs * inner + 2 * inner * (6 + 1) / 2)
    assert sum(m.flops for m in step) == pytest.approx(
        workloads.decode_step_flops(config, 8, inputs, 6) - step_attention
    )
    for matmuls, backward in ((forward, True), (step, False)):
        probe = kernels.dense_probe(matmuls, jnp.float32, backward)
        operands = kernels.dense_operands(matmuls, jnp.float32, backward)
        compiled = kernels.dense_chain(matmuls, backward).lower(*operands).compile()
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list) else cost
        assert cost["flops"] == pytest.approx(probe.work, rel=0.01)
        assert np.isfinite(float(probe.fn()))


@pytest.mark.parity
def test_hf_reference_has_our_geometry():
    args = bench.parse_args([f"--gin_file={TINY}"])
    model = workloads.build_model(args)
    ours = sum(np.size(p) for p in jax.tree.leaves(workloads._random_params(model, args)))
    theirs = sum(p.numel() for p in hf.hf_model(model.config, "float32").parameters())
    assert theirs == ours == 1_050_368


def test_forward_flops_match_xla_count():
    """The analytic count (matmuls only) against XLA's count of the compiled scoring pass
    (which adds the elementwise work: norms, softmax, GELU)."""
    args = bench.parse_args(
        [f"--gin_file={TINY}", "--batch_size=4", "--input_length=64", "--target_length=32"]
    )
    model = workloads.build_model(args)
    batch = workloads.random_batch(np.random.default_rng(0), 4, 64, 32, model.config.vocab_size)
    features = {k: jnp.asarray(v) for k, v in batch.items()}
    params = workloads._random_params(model, args)
    _, _, cost = timing.compile_seconds(jax.jit(model.score), params, features)
    analytic = workloads.forward_flops(model.config, 4, 64, 32)
    assert analytic == pytest.approx(cost["flops"], rel=0.05)  # measured: 0.98


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--workloads=train,fly"], "unknown workload(s) fly"),
        (["--batch_size=0"], "--batch_size, --decode_batch_size, --input_length, --target"),
        (["--decode_batch_size=0"], "--decode_length must be >= 1"),
        (["--num_beams=0"], "--num_beams must be >= 1"),
        (["--limit_best=0"], "--limit_probes, --limit_best, --stream_mb and --matmul_size must"),
        (["--steps=x"], "argument --steps: invalid int value: 'x'; see t5tpu bench --help"),
    ],
)
def test_bad_flags_are_user_errors(flags, message):
    with pytest.raises(bench.UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        bench.parse_args([f"--gin_file={TINY}", *flags])
