"""Partitioning: the logical axis rules, the shardings they give parameters and optimizer state,
and train steps on 8 fake CPU devices that equal the one-device step on every mesh.

The 8-device checks run in one subprocess (this file run as a script), because XLA's device
count is fixed when jax is first imported and pytest imports every test module in one process.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
from fake_devices import padded_batch, run_script_on_eight_devices
from jax.sharding import PartitionSpec as P
from tiny import tiny_config

from t5tpu import partitioning
from t5tpu.model import param_shapes
from t5tpu.planning.placements import boxed_params
from t5tpu.training import optim

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The tiny T5 1.1 with 1+1 layers and 8 heads: heads, mlp and vocab divide every mesh up to 8-way
# model parallelism, and its 128 x 256 kernels Adafactor factors.
CONFIG = tiny_config(num_heads=8, head_dim=32, num_encoder_layers=1, num_decoder_layers=1)
MESHES = {"8x1": 1, "4x2": 2, "2x4": 4, "1x8": 8}


def _specs(rules, mesh, config=None):
    boxed = boxed_params(config or CONFIG)
    specs = partitioning.param_specs(boxed, rules, mesh)
    flat = {}
    import jax

    for path, spec in jax.tree_util.tree_flatten_with_path(
        specs, is_leaf=lambda x: isinstance(x, P)
    )[0]:
        flat["/".join(k.key for k in path)] = spec
    return flat


# Every parameter role of a T5 1.1 layer stack, with its sharding on a 4 x 2 mesh.
EXPECTED_1D = {
    "token_embedder/embedding": P("model", None),
    "encoder/relpos_bias/rel_embedding": P("model", None),
    "encoder/layers_0/pre_attention_layer_norm/scale": P(None),
    "encoder/layers_0/attention/query/kernel": P(None, "model", None),
    "encoder/layers_0/attention/key/kernel": P(None, "model", None),
    "encoder/layers_0/attention/value/kernel": P(None, "model", None),
    "encoder/layers_0/attention/out/kernel": P("model", None, None),
    "encoder/layers_0/pre_mlp_layer_norm/scale": P(None),
    "encoder/layers_0/mlp/wi_0/kernel": P(None, "model"),
    "encoder/layers_0/mlp/wi_1/kernel": P(None, "model"),
    "encoder/layers_0/mlp/wo/kernel": P("model", None),
    "encoder/encoder_norm/scale": P(None),
    "decoder/relpos_bias/rel_embedding": P("model", None),
    "decoder/layers_0/pre_self_attention_layer_norm/scale": P(None),
    "decoder/layers_0/self_attention/query/kernel": P(None, "model", None),
    "decoder/layers_0/self_attention/key/kernel": P(None, "model", None),
    "decoder/layers_0/self_attention/value/kernel": P(None, "model", None),
    "decoder/layers_0/self_attention/out/kernel": P("model", None, None),
    "decoder/layers_0/pre_cross_attention_layer_norm/scale": P(None),
    "decoder/layers_0/encoder_decoder_attention/query/kernel": P(None, "model", None),
    "decoder/layers_0/encoder_decoder_attention/key/kernel": P(None, "model", None),
    "decoder/layers_0/encoder_decoder_attention/value/kernel": P(None, "model", None),
    "decoder/layers_0/encoder_decoder_attention/out/kernel": P("model", None, None),
    "decoder/layers_0/pre_mlp_layer_norm/scale": P(None),
    "decoder/layers_0/mlp/wi_0/kernel": P(None, "model"),
    "decoder/layers_0/mlp/wi_1/kernel": P(None, "model"),
    "decoder/layers_0/mlp/wo/kernel": P("model", None),
    "decoder/decoder_norm/scale": P(None),
    "decoder/logits_dense/kernel": P(None, "model"),
}
MESH_4X2 = {"data": 4, "model": 2}


def test_every_parameter_is_sharded_by_the_1d_rules():
    assert _specs(partitioning.standard_logical_axis_rules(), MESH_4X2) == EXPECTED_1D


def test_2d_parameter_partitioning_shards_embed_over_data():
    specs = _specs(partitioning.standard_logical_axis_rules("2d", "1d"), MESH_4X2)
    # Every 'embed' dimension now goes to 'data'; 'model' dimensions are unchanged.
    assert specs["encoder/layers_0/mlp/wi_0/kernel"] == P("data", "model")
    assert specs["encoder/layers_0/mlp/wo/kernel"] == P("model", "data")
    assert specs["encoder/layers_0/attention/query/kernel"] == P("data", "model", None)
    assert specs["encoder/layers_0/attention/out/kernel"] == P("model", None, "data")
    assert specs["token_embedder/embedding"] == P("model", "data")
    assert specs["decoder/logits_dense/kernel"] == P("data", "model")
    assert specs["encoder/encoder_norm/scale"] == P("data")


def test_2d_activation_rules_come_before_the_parameter_rule_for_embed():
    """With both 2-D variants, 'embed' takes 'model' where that is free (activations, norm
    scales) and 'data' where a kernel's other dimension already took 'model'."""
    rules = partitioning.standard_logical_axis_rules("2d", "2d")
    import flax.linen as nn

    assert nn.logical_to_mesh_axes(("batch", "length", "embed"), rules) == P("data", None, "model")
    assert nn.logical_to_mesh_axes(("embed", "mlp"), rules) == P("data", "model")
    assert nn.logical_to_mesh_axes(("vocab", "embed"), rules) == P("model", "data")
    assert nn.logical_to_mesh_axes(("embed",), rules) == P("model")
    # 2-D activations with 1-D parameters: kernels keep embed unsharded.
    rules = partitioning.standard_logical_axis_rules("1d", "2d")
    assert nn.logical_to_mesh_axes(("batch", "length", "embed"), rules) == P("data", None, "model")
    assert nn.logical_to_mesh_axes(("embed", "heads", "kv"), rules) == P(None, "model", None)


def test_a_dimension_the_mesh_does_not_divide_stays_replicated():
    twelve_heads = dataclasses.replace(CONFIG, num_heads=12)
    specs = _specs(
        partitioning.standard_logical_axis_rules(), {"data": 1, "model": 8}, twelve_heads
    )
    assert specs["encoder/layers_0/attention/query/kernel"] == P(None, None, None)
    assert specs["encoder/layers_0/mlp/wi_0/kernel"] == P(None, "model")


def _opt_specs(optimizer, config=CONFIG):
    import flax.linen as nn
    import jax

    boxed = boxed_params(config)
    params = nn.unbox(boxed)
    rules = partitioning.standard_logical_axis_rules()
    specs = partitioning.param_specs(boxed, rules, MESH_4X2)
    state = jax.eval_shape(optimizer.init, params)
    return state, partitioning.opt_state_specs(state, params, specs)


def test_adafactor_factored_moments_keep_the_sharding_of_their_dimensions():
    _, specs = _opt_specs(optim.adafactor())
    factored = specs[0]
    # wi_0 (embed 128, mlp 256): v_row drops the largest dimension (mlp), v_col the other.
    assert factored.v_row["encoder"]["layers_0"]["mlp"]["wi_0"]["kernel"] == P(None)
    assert factored.v_col["encoder"]["layers_0"]["mlp"]["wi_0"]["kernel"] == P("model")
    # embedding (vocab 1024, embed 128): v_row drops vocab, v_col keeps it (sharded).
    assert factored.v_row["token_embedder"]["embedding"] == P(None)
    assert factored.v_col["token_embedder"]["embedding"] == P("model")
    assert factored.count == P()


def test_attention_moments_are_factored_as_t5x_matrices_and_keep_the_heads_sharding():
    # Kernels [embed 128, heads 8, head_dim 32] and [8, 32, 128], heads over 'model': their
    # moments factor over embed and heads x head_dim, which keeps the heads' sharding.
    state, specs = _opt_specs(optim.adafactor())
    attention = (specs[0].v_row, specs[0].v_col, state[0].v_row, state[0].v_col)
    attention = [moments["encoder"]["layers_0"]["attention"] for moments in attention]
    for name in ("query", "out"):
        row, col, row_shape, col_shape = (a[name]["kernel"] for a in attention)
        assert {row_shape.shape: row, col_shape.shape: col} == {
            (128,): P(None),
            (8, 32): P("model", None),
        }


def test_adamw_moments_are_sharded_like_their_parameters():
    state, specs = _opt_specs(optim.adamw())
    adam = specs[0]
    for moments in (adam.mu, adam.nu):
        assert moments["encoder"]["layers_0"]["mlp"]["wo"]["kernel"] == P("model", None)
        assert moments["decoder"]["logits_dense"]["kernel"] == P(None, "model")
    assert adam.count == P()


@pytest.fixture(scope="module")
def eight_devices():
    """Results of the 8-device worker (this file run as a script)."""
    return run_script_on_eight_devices(__file__)


def test_every_mesh_trains_like_one_device(eight_devices):
    reference = eight_devices["1 device"]
    for mesh in MESHES:
        result = eight_devices[mesh]
        assert result["mesh"] == mesh
        for step_loss, ref_loss in zip(result["losses"], reference["losses"], strict=True):
            assert step_loss == pytest.approx(ref_loss, rel=1e-5)
        # Largest parameter difference after two Adafactor steps, vs parameters of order 0.1-1.
        assert result["max_param_diff"] < 2e-5, mesh
    # The steps did change the parameters (otherwise equality would prove nothing).
    assert reference["max_param_change"] > 1e-3
    assert reference["losses"][1] < reference["losses"][0]


def test_microbatched_step_equals_the_full_batch_step(eight_devices):
    full, micro = eight_devices["4x2"], eight_devices["4x2, 4 microbatches"]
    for a, b in zip(full["losses"], micro["losses"], strict=True):
        assert a == pytest.approx(b, rel=1e-5)
    assert micro["max_param_diff_to_4x2"] < 2e-5


def test_state_lands_on_the_mesh_as_the_rules_say(eight_devices):
    placed = eight_devices["4x2"]["placed"]
    assert placed["params/encoder/layers_0/mlp/wi_0/kernel"] == [None, "model"]
    assert placed["params/token_embedder/embedding"] == ["model", None]
    assert placed["opt_state/v_col/encoder/layers_0/mlp/wi_0/kernel"] == ["model"]
    assert placed["opt_state/v_col/encoder/layers_0/attention/query/kernel"] == ["model", None]
    assert placed["batch"] == ["data", None]


def test_decoding_caches_are_sharded_by_the_rules(eight_devices):
    # Self- and cross-attention key caches (16 rows, 8 heads; the heads dimension is the only
    # one of size 8): rows over 'data', heads over 'model', nothing else sharded.
    for kind, cache in eight_devices["caches"].items():
        heads = cache["shape"].index(CONFIG.num_heads)
        expected = [None] * 4
        expected[0], expected[heads] = "data", "model"
        assert cache["spec"] == expected, kind


# ----- the 8-device worker -------------------------------------------------------------------


def _worker() -> dict:
    import jax
    import numpy as np

    from t5tpu.data import vocab
    from t5tpu.model.encoder_decoder import EncoderDecoderModel
    from t5tpu.training import trainer

    assert jax.device_count() == 8
    vocabulary = vocab.default_vocabulary(vocab.bundled_vocabulary_file())
    model = EncoderDecoderModel(CONFIG, vocabulary)
    optimizer = optim.adafactor(learning_rate=0.01)
    batch = padded_batch(np.random.default_rng(0), 16, 16, 8)
    results = {}
    # One initial state for every run, placed on each mesh by its shardings.
    initial = jax.device_get(
        jax.jit(lambda rng: trainer.initial_state(model, optimizer, rng, 16, 8))(
            jax.random.PRNGKey(0)
        )
    )

    def train(partitioner, num_microbatches=1):
        abstract, shardings = trainer.state_shardings(model, optimizer, partitioner)
        state = jax.device_put(initial, shardings)
        first = initial.params
        step = trainer.compile_train_step(
            model, optimizer, shardings, partitioner, num_microbatches
        )
        placed = {k: jax.device_put(v, partitioner.batch_sharding()) for k, v in batch.items()}
        losses = []
        for _ in range(2):
            state, metrics = step(state, placed, jax.random.PRNGKey(1))
            losses.append(float(metrics["loss"]))
        return state, losses, first, placed

    def flat(tree):
        return {
            "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path): leaf
            for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
        }

    one = partitioning.Partitioner(devices=jax.devices()[:1])
    ref_state, ref_losses, first, _ = train(one)
    ref_params = flat(jax.device_get(ref_state.params))
    change = max(float(np.abs(ref_params[k] - v).max()) for k, v in flat(first).items())
    results["1 device"] = {"losses": ref_losses, "max_param_change": change}

    for name, parts in MESHES.items():
        partitioner = partitioning.Partitioner(num_partitions=parts)
        state, losses, _, placed = train(partitioner)
        params = flat(jax.device_get(state.params))
        diff = max(float(np.abs(ref_params[k] - v).max()) for k, v in params.items())
        shape = partitioner.mesh.shape
        results[name] = {
            "mesh": f"{shape['data']}x{shape['model']}",
            "losses": losses,
            "max_param_diff": diff,
        }
        if name == "4x2":
            mesh_params, mesh_state, mesh_batch = params, state, placed

    partitioner = partitioning.Partitioner(num_partitions=2)
    state, losses, _, _ = train(partitioner, num_microbatches=4)
    params = flat(jax.device_get(state.params))
    results["4x2, 4 microbatches"] = {
        "losses": losses,
        "max_param_diff_to_4x2": max(
            float(np.abs(mesh_params[k] - v).max()) for k, v in params.items()
        ),
    }

    def spec(array):
        axes = list(array.sharding.spec)
        return axes + [None] * (array.ndim - len(axes))

    adafactor_state = mesh_state.opt_state[0]
    results["4x2"]["placed"] = {
        "params/encoder/layers_0/mlp/wi_0/kernel": spec(
            mesh_state.params["encoder"]["layers_0"]["mlp"]["wi_0"]["kernel"]
        ),
        "params/token_embedder/embedding": spec(mesh_state.params["token_embedder"]["embedding"]),
        "opt_state/v_col/encoder/layers_0/mlp/wi_0/kernel": spec(
            adafactor_state.v_col["encoder"]["layers_0"]["mlp"]["wi_0"]["kernel"]
        ),
        "opt_state/v_col/encoder/layers_0/attention/query/kernel": spec(
            adafactor_state.v_col["encoder"]["layers_0"]["attention"]["query"]["kernel"]
        ),
        "batch": spec(mesh_batch["encoder_input_tokens"]),
    }

    # Decoding: the key/value caches after one decoding step, as placed by the compiled program.
    _, param_shardings = param_shapes.sharded_abstract_params(model.config, partitioner)

    def cache_after_one_step(params, tokens):
        encoded = model.module.apply({"params": params}, tokens, method="encode")
        _, fresh = model.module.apply(
            {"params": params},
            encoded,
            tokens,
            jax.numpy.zeros((16, 4), "int32"),
            decode=True,
            mutable=["cache"],
            method="decode",
        )
        _, updated = model.module.apply(
            {"params": params, "cache": fresh["cache"]},
            encoded,
            tokens,
            jax.numpy.ones((16, 1), "int32"),
            decode=True,
            decode_position=jax.numpy.int32(0),
            mutable=["cache"],
            method="decode",
        )
        return updated["cache"]

    cache = partitioner.jit(
        cache_after_one_step, in_shardings=(param_shardings, partitioner.batch_sharding())
    )(mesh_state.params, mesh_batch["encoder_input_tokens"])
    results["caches"] = {
        kind: {"shape": list(key.shape), "spec": spec(key)}
        for kind in ("self_attention", "encoder_decoder_attention")
        for key in [cache["decoder"]["layers_0"][kind]["cached_key"]]
    }
    return results


if __name__ == "__main__":
    print(json.dumps(_worker()))
