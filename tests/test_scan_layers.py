"""T5Config.scan_layers: the scanned network computes what the unrolled one computes, from the
same parameters stacked; training, decoding and checkpoints agree; checkpoints stay layers_N.

The train-step checks run in one subprocess with 8 fake CPU devices (this file run as a script,
as in test_partitioning.py): an unscanned and a scanned step on one device, and a scanned step
on a 2 x 4 mesh.
"""

from __future__ import annotations

import dataclasses
import json
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import reference_decoding
from fake_devices import padded_batch, run_script_on_eight_devices
from jax.sharding import PartitionSpec as P
from tiny import tiny_config

from t5tpu import partitioning
from t5tpu.data import vocab
from t5tpu.model import decoding, layer_stacking
from t5tpu.model.network import T5Config, Transformer
from t5tpu.storage import checkpoints
from t5tpu.training import optim

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Narrower than the tiny T5 1.1, with different encoder and decoder depths, so a mix-up of the
# stacks shows.
TINY = tiny_config(
    vocab_size=64, emb_dim=32, num_heads=2, head_dim=16, mlp_dim=64, num_encoder_layers=3
)
# For the train steps: the tiny model's kernels of 128 x 256 that Adafactor factors, with 8 heads,
# so that heads/mlp/vocab divide a 4-way 'model' axis (as in test_partitioning.py).
TRAIN_CONFIG = tiny_config(num_heads=8, head_dim=16)
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def scanned(config: T5Config, **overrides) -> T5Config:
    return dataclasses.replace(config, scan_layers=True, **overrides)


def boxed_params(config: T5Config):
    """Parameter shapes with their logical axes."""
    tokens = jnp.ones((1, 8), jnp.int32)
    init = Transformer(config).init
    return jax.eval_shape(init, jax.random.PRNGKey(0), tokens, tokens)["params"]


def random_params(config: T5Config, seed: int = 0):
    """float32 numpy parameters of order 0.3 (faster than compiling the initializer)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda x: rng.normal(scale=0.3, size=x.shape).astype(np.float32),
        nn.unbox(boxed_params(config)),
    )


def tokens(seed: int, shape, low: int = 1) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).integers(low, 64, size=shape), jnp.int32)


def assert_trees_equal(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    jax.tree.map(np.testing.assert_array_equal, a, b)


@pytest.fixture(scope="module")
def params():
    """Unrolled parameters of TINY and the same parameters stacked."""
    unrolled = random_params(TINY)
    return unrolled, layer_stacking.stack_layers(unrolled)


# ----- the layout functions --------------------------------------------------------------------


def test_stack_and_unstack_are_inverse_on_params_and_optimizer_state():
    rng = np.random.default_rng(0)
    layer = lambda: {"mlp": {"wo": rng.normal(size=(4, 3))}, "norm": rng.normal(size=(3,))}  # noqa: E731
    unrolled = {"encoder": {f"layers_{i}": layer() for i in range(3)}, "embedding": np.ones(2)}
    stacked = layer_stacking.stack_layers(unrolled)
    assert sorted(stacked["encoder"]) == ["layers"]
    wo = stacked["encoder"]["layers"]["mlp"]["wo"]
    assert isinstance(wo, np.ndarray) and wo.shape == (3, 4, 3)
    np.testing.assert_array_equal(wo[2], unrolled["encoder"]["layers_2"]["mlp"]["wo"])
    assert_trees_equal(layer_stacking.unstack_layers(stacked), unrolled)
    # Inside optax states (tuples of NamedTuples holding parameter trees) too.
    state = (optax.ScaleByAdamState(count=np.int32(3), mu=unrolled, nu=unrolled),)
    stacked_state = layer_stacking.stack_layers(state)
    assert stacked_state[0].mu["encoder"]["layers"]["norm"].shape == (3, 3)
    assert stacked_state[0].count == 3
    assert_trees_equal(layer_stacking.unstack_layers(stacked_state), state)
    # A tree in the other layout already passes through unchanged.
    assert_trees_equal(layer_stacking.unstack_layers(unrolled), unrolled)
    assert_trees_equal(layer_stacking.stack_layers(stacked), stacked)
    assert layer_stacking.is_stacked(stacked_state) and not layer_stacking.is_stacked(state)


def test_optax_placeholders_are_shared_by_the_layers_of_a_stack():
    # Adafactor's state of an unrolled 2-layer stack: a factored kernel (row and column
    # moments, a (1,) placeholder for the full one) and an unfactored scale (placeholders for
    # row and column).
    kernel, scale = np.ones((2, 256, 128), np.float32), np.ones((2, 8), np.float32)
    params = {"encoder": {"layers": {"kernel": kernel, "scale": scale}}}
    state = optax.adafactor(1e-3).init(params)[0]
    assert state.v["encoder"]["layers"]["kernel"].shape == (1,)
    assert state.v_row["encoder"]["layers"]["scale"].shape == (1,)
    unrolled_params, unrolled_state = layer_stacking.unstack_layers((params, state))
    assert unrolled_state.v_row["encoder"]["layers_1"]["kernel"].shape == (128,)
    assert unrolled_state.v_row["encoder"]["layers_1"]["scale"].shape == (1,)
    expected = optax.adafactor(1e-3).init(unrolled_params)[0]
    assert jax.tree.map(np.shape, unrolled_state) == jax.tree.map(np.shape, expected)
    assert jax.tree.map(np.shape, layer_stacking.stack_layers(unrolled_state)) == jax.tree.map(
        np.shape, state
    )
    # Without its parameters, a stack whose moments are all placeholders has no known depth.
    with pytest.raises(ValueError, match="depth"):
        layer_stacking.unstack_layers({"v_row": {"encoder": {"layers": {"scale": np.ones(1)}}}})


def test_layers_numbered_with_a_gap_are_refused():
    with pytest.raises(ValueError, match="numbered"):
        layer_stacking.stack_layers({"layers_0": np.ones(1), "layers_2": np.ones(1)})


def test_scanned_parameters_are_the_unrolled_ones_stacked_on_a_replicated_layers_axis(params):
    unrolled, stacked = params
    boxed = boxed_params(scanned(TINY))
    assert jax.tree.structure(nn.unbox(boxed)) == jax.tree.structure(stacked)
    jax.tree.map(lambda a, b: np.testing.assert_equal(a.shape, b.shape), nn.unbox(boxed), stacked)
    query = boxed["encoder"]["layers"]["attention"]["query"]["kernel"]
    assert query.names == ("layers", "embed", "heads", "kv")
    assert query.value.shape == (3, 32, 2, 16)
    assert boxed["decoder"]["layers"]["mlp"]["wo"]["kernel"].value.shape == (2, 64, 32)
    # Unstacking the boxes gives the unrolled model's names and logical axes.
    unrolled_boxes = layer_stacking.unstack_layers(boxed)
    expected = nn.get_partition_spec(boxed_params(TINY))
    assert nn.get_partition_spec(unrolled_boxes) == expected
    # Every standard rule set keeps the layer axis whole.
    for params_2d in ("1d", "2d"):
        for activations_2d in ("1d", "2d"):
            rules = partitioning.standard_logical_axis_rules(params_2d, activations_2d)
            assert nn.logical_to_mesh_axes(("layers",), rules) == P(None)


@pytest.mark.parametrize("settings", [{}, {"momentum": 0.9, "weight_decay_rate": 1e-3}])
def test_adafactor_equals_optax_adafactor_on_unrolled_layers(settings):
    # t5tpu's Adafactor composes optax's transformations itself (for per-layer blocks in a
    # stack): on unrolled layers it is optax.adafactor, state structure and values.
    rng = np.random.default_rng(0)
    params = {"layers_0": {"kernel": rng.normal(size=(256, 130)), "scale": rng.normal(size=(7,))}}
    params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
    grads = jax.tree.map(lambda x: 0.3 * x + 0.1, params)
    ours, theirs = optim.adafactor(0.01, **settings), optax.adafactor(0.01, **settings)
    ours_state, theirs_state = ours.init(params), theirs.init(params)
    for _ in range(2):
        ours_updates, ours_state = ours.update(grads, ours_state, params)
        theirs_updates, theirs_state = theirs.update(grads, theirs_state, params)
    assert_trees_equal((ours_updates, ours_state), (theirs_updates, theirs_state))
    assert float(jnp.abs(ours_updates["layers_0"]["kernel"]).max()) > 1e-3


# ----- the network -----------------------------------------------------------------------------


def test_scanned_logits_equal_unrolled_logits(params):
    unrolled, stacked = params
    enc, dec = tokens(1, (2, 7)), tokens(2, (2, 5), low=0)

    def logits(config, p):
        fn = jax.jit(Transformer(config).apply, compiler_options=FAST_COMPILE)
        return fn({"params": p}, enc, dec)

    expected = logits(TINY, unrolled)
    got = logits(scanned(TINY), stacked)
    assert float(jnp.std(expected)) > 0.1  # not a degenerate output
    np.testing.assert_allclose(got, expected, atol=2e-5, rtol=2e-5)


def test_scanned_greedy_and_beam_decoding_give_the_same_tokens(params):
    unrolled, stacked = params
    enc = tokens(3, (3, 6))
    enc = enc.at[2, 4:].set(0)  # a padded row

    def decode(config, p):
        def both(p):
            greedy = reference_decoding.decode(Transformer(config), p, enc, 7, eos_id=1)
            beams = decoding.beam_search(Transformer(config), p, enc, 7, eos_id=1, num_beams=3)
            return greedy, beams

        return jax.jit(both, compiler_options=FAST_COMPILE)(p)

    greedy, (beam_tokens, beam_scores) = decode(TINY, unrolled)
    scan_greedy, (scan_beam_tokens, scan_beam_scores) = decode(scanned(TINY), stacked)
    assert np.count_nonzero(greedy) > 6  # tokens were produced
    np.testing.assert_array_equal(scan_greedy, greedy)
    np.testing.assert_array_equal(scan_beam_tokens, beam_tokens)
    np.testing.assert_allclose(scan_beam_scores, beam_scores, rtol=1e-5)


# ----- checkpoints -----------------------------------------------------------------------------


def _single_device(tree):
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda _: device, tree)


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def _filled_state(stacked_params):
    """(unrolled, stacked) pairs of parameters and Adafactor state (distinct values in every
    moment; TINY's moments are unfactored, so the row and column moments are placeholders)."""
    state = optim.adafactor(1e-3).init(stacked_params)
    leaves, treedef = jax.tree.flatten(state)
    rng = np.random.default_rng(5)
    state = jax.tree.unflatten(treedef, [rng.normal(size=x.shape).astype(x.dtype) for x in leaves])
    stacked = (stacked_params, state)
    return layer_stacking.unstack_layers(stacked), stacked


def _restore(model_dir, params, opt_state):
    mngr = checkpoints.manager(model_dir, read_only=True)
    abstract_params, abstract_opt = _abstract(params), _abstract(opt_state)
    return checkpoints.restore_state(
        mngr,
        5,
        abstract_params,
        abstract_opt,
        _single_device(abstract_params),
        _single_device(abstract_opt),
    )


def test_checkpoints_of_scanned_and_unrolled_runs_are_interchangeable(tmp_path, params):
    unrolled, stacked = _filled_state(params[1])
    assert_trees_equal(unrolled[0], params[0])
    # (saved by, its state, the other run's state that restore must give)
    for saver, saved, expected in (("scanned", stacked, unrolled), ("unrolled", unrolled, stacked)):
        model_dir = str(tmp_path / saver)
        checkpoints.save(checkpoints.manager(model_dir), 5, *saved)
        metadata = checkpoints.manager(model_dir, read_only=True).item_metadata(5)
        on_disk = checkpoints.flat_shapes(metadata["params"])
        assert on_disk == checkpoints.flat_shapes(unrolled[0]), saver
        assert "encoder/layers_2/mlp/wo/kernel" in on_disk
        opt_names = checkpoints.flat_shapes(metadata["opt_state"])
        assert any(name.endswith("v/encoder/layers_2/mlp/wo/kernel") for name in opt_names)
        assert not any("/layers/" in name for name in [*on_disk, *opt_names])
        got = _restore(model_dir, *expected)
        assert_trees_equal(jax.device_get(got), expected)


def test_initial_checkpoints_load_into_a_scanned_model(tmp_path, params):
    from t5tpu.formats import (
        conversion,
        hf_format,  # imports tensorflow: kept out of the 8-device worker
        loader,
    )
    from t5tpu.formats.vocabulary_source import VocabularySource

    unrolled, stacked = params
    abstract = _abstract(stacked)
    # A t5tpu checkpoint_N directory, as INITIAL_CHECKPOINT_PATH.
    step_dir = conversion.save_params(str(tmp_path / "t5tpu"), 0, unrolled)
    loaded = loader.open_checkpoint(step_dir).load(abstract, _single_device(abstract))
    assert_trees_equal(jax.device_get(loaded), stacked)
    # A Hugging Face directory, read by its importer (layers_N) and then stacked.
    hf_dir = str(tmp_path / "hf")
    config = dataclasses.replace(TINY, vocab_size=1024)
    hf_params = random_params(config, seed=1)
    bundled = VocabularySource("sentencepiece", vocab.bundled_vocabulary_file(), 0)
    hf_format.export(hf_params, config, hf_dir, bundled)
    expected = layer_stacking.stack_layers(hf_params)
    loaded = loader.open_checkpoint(hf_dir).load(_abstract(expected))
    assert_trees_equal(loaded, expected)


# ----- train steps (8 fake devices, in a subprocess) -------------------------------------------


@pytest.fixture(scope="module")
def train_steps():
    return run_script_on_eight_devices(__file__)


def test_scanned_train_step_on_a_2x4_mesh_equals_the_unrolled_step(train_steps):
    reference, result = train_steps["unrolled, 1 device"], train_steps["scanned, 2x4"]
    for loss, ref_loss in zip(result["losses"], reference["losses"], strict=True):
        assert loss == pytest.approx(ref_loss, rel=1e-5)
    # Largest differences after two Adafactor steps, vs parameters of order 0.1 (Adafactor's
    # update clipping and parameter scale are per layer in a stack, as in the unrolled model).
    assert result["max_param_diff"] < 2e-5
    assert result["max_opt_state_diff"] < 1e-4 * reference["max_opt_state"]
    # The steps did change the parameters (otherwise equality would prove nothing).
    assert reference["max_param_change"] > 1e-3
    assert reference["losses"][1] < reference["losses"][0]


def test_scanned_state_is_placed_by_the_rules(train_steps):
    placed = train_steps["scanned, 2x4"]["placed"]
    # Stacked kernels: the layer axis whole, mlp over 'model'; their factored moments keep the
    # sharding of the dimensions they keep.
    assert placed["params/encoder/layers/mlp/wi_0/kernel"] == [None, None, "model"]
    assert placed["opt_state/v_col/encoder/layers/mlp/wi_0/kernel"] == [None, "model"]


def _worker() -> dict:
    from t5tpu.model.encoder_decoder import EncoderDecoderModel
    from t5tpu.training import trainer

    assert jax.device_count() == 8
    vocabulary = vocab.default_vocabulary(vocab.bundled_vocabulary_file())
    optimizer = optim.adafactor(learning_rate=0.01)
    batch = padded_batch(np.random.default_rng(0), 16, 16, 8)
    config = TRAIN_CONFIG
    unrolled_model = EncoderDecoderModel(config, vocabulary)
    params = jax.tree.map(lambda x: x / 3, random_params(config))  # order 0.1, as T5's init
    initial = jax.device_get(trainer.TrainState(np.int32(0), params, optimizer.init(params)))

    def train(model, partitioner):
        _, shardings = trainer.state_shardings(model, optimizer, partitioner)
        start = initial
        if model.config.scan_layers:
            start = layer_stacking.stack_layers(initial)  # parameters and moments
        state = jax.device_put(start, shardings)
        step = trainer.compile_train_step(model, optimizer, shardings, partitioner)
        placed = {k: jax.device_put(v, partitioner.batch_sharding()) for k, v in batch.items()}
        losses = []
        for _ in range(2):
            state, metrics = step(state, placed, jax.random.PRNGKey(1))
            losses.append(float(metrics["loss"]))
        return state, losses

    def max_diff(a, b):
        return max(jax.tree.leaves(jax.tree.map(lambda x, y: float(np.abs(x - y).max()), a, b)))

    one = partitioning.Partitioner(devices=jax.devices()[:1])
    ref_state, ref_losses = train(unrolled_model, one)
    ref_state = jax.device_get(ref_state)
    results = {
        "unrolled, 1 device": {
            "losses": ref_losses,
            "max_param_change": max_diff(ref_state.params, initial.params),
            "max_opt_state": max(
                float(np.abs(x).max())
                for x in jax.tree.leaves(ref_state.opt_state)
                if np.issubdtype(x.dtype, np.floating)
            ),
        }
    }
    # With remat inside the scan, as big models run it.
    scanned_model = EncoderDecoderModel(scanned(config, remat_policy="full"), vocabulary)
    state, losses = train(scanned_model, partitioning.Partitioner(num_partitions=4))
    host = jax.device_get(state)
    results["scanned, 2x4"] = {
        "losses": losses,
        "max_param_diff": max_diff(layer_stacking.unstack_layers(host.params), ref_state.params),
        "max_opt_state_diff": max_diff(
            layer_stacking.unstack_layers((host.params, host.opt_state))[1], ref_state.opt_state
        ),
    }

    def spec(array):
        axes = list(array.sharding.spec)
        return axes + [None] * (array.ndim - len(axes))

    results["scanned, 2x4"]["placed"] = {
        "params/encoder/layers/mlp/wi_0/kernel": spec(
            state.params["encoder"]["layers"]["mlp"]["wi_0"]["kernel"]
        ),
        "opt_state/v_col/encoder/layers/mlp/wi_0/kernel": spec(
            state.opt_state[0].v_col["encoder"]["layers"]["mlp"]["wi_0"]["kernel"]
        ),
    }
    return results


if __name__ == "__main__":
    print(json.dumps(_worker()))


def test_scanned_per_layer_position_biases_decode_as_unrolled():
    """umT5's tables (one a layer) stack on the "layers" axis like every layer parameter, and
    the scanned network computes and decodes what the unrolled one does."""
    config = dataclasses.replace(TINY, relative_bias_per_layer=True)
    unrolled = random_params(config, seed=1)
    stacked = layer_stacking.stack_layers(unrolled)
    boxed = boxed_params(scanned(config))
    table = boxed["encoder"]["layers"]["relpos_bias"]["rel_embedding"]
    assert table.names == ("layers", "heads", "relpos_buckets")
    assert table.value.shape == (3, 2, 32)
    assert "relpos_bias" not in boxed["encoder"] and "relpos_bias" not in boxed["decoder"]
    enc, dec = tokens(4, (2, 7)), tokens(5, (2, 5), low=0)
    enc = enc.at[1, 5:].set(0)

    def run(config, p):
        def both(p):
            logits = Transformer(config).apply({"params": p}, enc, dec)
            return logits, reference_decoding.decode(Transformer(config), p, enc, 6, eos_id=1)

        return jax.jit(both, compiler_options=FAST_COMPILE)(p)

    logits, greedy = run(config, unrolled)
    scan_logits, scan_greedy = run(scanned(config), stacked)
    np.testing.assert_allclose(scan_logits, logits, atol=2e-5, rtol=2e-5)
    np.testing.assert_array_equal(scan_greedy, greedy)
    assert np.count_nonzero(greedy) > 6
