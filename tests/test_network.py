"""Numerical properties of the T5 network: names, axes, masking, packing, remat, dtypes; umT5's
position bias in every layer."""

from __future__ import annotations

import dataclasses
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util
from tiny import tiny_config

from t5tpu.errors import UserError
from t5tpu.model import layers
from t5tpu.model.network import T5Config, Transformer
from t5tpu.model.param_shapes import abstract_params

VARIANTS = {
    "t5_1_0": dict(mlp_activations=("relu",), logits_via_embedding=True),
    "t5_1_1": dict(mlp_activations=("gelu", "linear"), logits_via_embedding=False),
    # umT5: T5 1.1 with a relative position bias in every layer of both stacks.
    "umt5": dict(
        mlp_activations=("gelu", "linear"),
        logits_via_embedding=False,
        relative_bias_per_layer=True,
    ),
}


# Narrower than the tiny model (a 64-piece vocabulary), in float32.
SMALL = dict(vocab_size=64, emb_dim=32, num_heads=2, head_dim=16, mlp_dim=64, dtype="float32")


# The test networks are tiny, so XLA's CPU compile time dominates; its cheaper optimization
# level halves it and computes the same values.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True}


def jit(fn):
    return jax.jit(fn, compiler_options=FAST_COMPILE)


def small_config(variant: str, **overrides) -> T5Config:
    return tiny_config(**{**SMALL, **VARIANTS[variant], **overrides})


def random_tokens(seed: int, shape: tuple[int, ...], low: int = 1, high: int = 64) -> np.ndarray:
    return np.random.default_rng(seed).integers(low, high, size=shape).astype(np.int32)


def init_params(config: T5Config, seed: int = 0):
    tokens = jnp.ones((1, 8), jnp.int32)
    return Transformer(config).init(jax.random.key(seed), tokens, tokens)["params"]


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request):
    return request.param


@pytest.fixture(scope="module")
def setup(variant):
    """(config, unboxed params, jitted logits function) for a variant."""
    config = small_config(variant)
    params = nn.unbox(init_params(config))
    model = Transformer(config)

    @jit
    def logits_fn(params, enc, dec, enc_seg=None, dec_seg=None):
        return model.apply({"params": params}, enc, dec, enc_seg, dec_seg)

    return config, params, logits_fn


def _layer_names(prefix: str, blocks: dict[str, str], mlp: list[str]) -> set[str]:
    names = set()
    for norm, block in blocks.items():
        names.add(f"{prefix}/{norm}/scale")
        for proj in ("query", "key", "value", "out"):
            names.add(f"{prefix}/{block}/{proj}/kernel")
    names.add(f"{prefix}/pre_mlp_layer_norm/scale")
    names.update(f"{prefix}/mlp/{w}/kernel" for w in mlp + ["wo"])
    return names


def expected_param_names(variant: str) -> set[str]:
    mlp = ["wi"] if variant == "t5_1_0" else ["wi_0", "wi_1"]
    names = {"token_embedder/embedding", "encoder/encoder_norm/scale", "decoder/decoder_norm/scale"}
    for i in range(2):
        for stack in ("encoder", "decoder"):
            per_layer = variant == "umt5"
            names.add(f"{stack}/{f'layers_{i}/' if per_layer else ''}relpos_bias/rel_embedding")
        names |= _layer_names(f"encoder/layers_{i}", {"pre_attention_layer_norm": "attention"}, mlp)
        names |= _layer_names(
            f"decoder/layers_{i}",
            {
                "pre_self_attention_layer_norm": "self_attention",
                "pre_cross_attention_layer_norm": "encoder_decoder_attention",
            },
            mlp,
        )
    if variant != "t5_1_0":
        names.add("decoder/logits_dense/kernel")
    return names


def relpos_names(variant: str) -> list[str]:
    """The position-bias tables of a variant: one per stack, or one per layer (umT5)."""
    if variant != "umt5":
        return ["encoder/relpos_bias/rel_embedding", "decoder/relpos_bias/rel_embedding"]
    return [
        f"{s}/layers_{i}/relpos_bias/rel_embedding" for s in ("encoder", "decoder") for i in (0, 1)
    ]


def test_parameter_names_match_t5x(variant):
    params = nn.unbox(init_params(small_config(variant)))
    flat = traverse_util.flatten_dict(params, sep="/")
    assert set(flat) == expected_param_names(variant)
    assert all(v.dtype == jnp.float32 for v in flat.values())
    assert flat["encoder/layers_0/attention/query/kernel"].shape == (32, 2, 16)
    assert flat["encoder/layers_0/attention/out/kernel"].shape == (2, 16, 32)
    for name in relpos_names(variant):
        assert flat[name].shape == (2, 32), name


def test_logical_axes(variant):
    boxed = init_params(small_config(variant))
    specs = traverse_util.flatten_dict(nn.get_partition_spec(boxed), sep="/")
    shapes = traverse_util.flatten_dict(nn.unbox(boxed), sep="/")
    expected = {
        "token_embedder/embedding": ("vocab", "embed"),
        **dict.fromkeys(relpos_names(variant), ("heads", "relpos_buckets")),
        "encoder/layers_0/attention/query/kernel": ("embed", "heads", "kv"),
        "encoder/layers_1/attention/key/kernel": ("embed", "heads", "kv"),
        "decoder/layers_1/encoder_decoder_attention/value/kernel": ("embed", "heads", "kv"),
        "decoder/layers_0/self_attention/out/kernel": ("heads", "kv", "embed"),
        "encoder/encoder_norm/scale": ("embed",),
        "decoder/layers_0/mlp/wo/kernel": ("mlp", "embed"),
    }
    if variant == "t5_1_0":
        expected["encoder/layers_0/mlp/wi/kernel"] = ("embed", "mlp")
    else:
        expected["encoder/layers_0/mlp/wi_0/kernel"] = ("embed", "mlp")
        expected["decoder/layers_1/mlp/wi_1/kernel"] = ("embed", "mlp")
        expected["decoder/logits_dense/kernel"] = ("embed", "vocab")
    for name, axes in expected.items():
        assert tuple(specs[name]) == axes, name
    # Every parameter is annotated, with one name per dimension.
    assert set(specs) == expected_param_names(variant)
    for name, spec in specs.items():
        assert len(spec) == shapes[name].ndim and None not in tuple(spec), name


# All logits below use two shapes per variant (plus one packed trace), so each test file compiles
# the network only a handful of times: encoder (2, 5) or (2, 12), decoder (2, 4).
def test_encoder_padding_does_not_change_logits(setup):
    config, params, logits_fn = setup
    enc = random_tokens(1, (2, 5))
    dec = random_tokens(2, (2, 4), low=0)
    padded = np.concatenate([enc, np.zeros((2, 7), np.int32)], axis=1)
    expected = logits_fn(params, enc, dec)
    assert expected.shape == (2, 4, config.vocab_size)
    np.testing.assert_allclose(logits_fn(params, padded, dec), expected, atol=1e-5, rtol=1e-5)


def test_packed_examples_match_unpacked(setup):
    config, params, logits_fn = setup
    enc_alone = random_tokens(3, (2, 5))
    # Decoder inputs start with the start token (id 0) in every segment.
    dec_alone = random_tokens(4, (2, 4), low=0)
    dec_alone[:, 0] = 0
    alone = logits_fn(params, enc_alone, dec_alone)

    # Both examples in one row, then padding; the second row holds them in the other order.
    pad = np.zeros((2,), np.int32)
    enc = np.stack(
        [
            np.concatenate([enc_alone[0], enc_alone[1], pad]),
            np.concatenate([enc_alone[1], enc_alone[0], pad]),
        ]
    )
    dec = np.stack(
        [
            np.concatenate([dec_alone[0], dec_alone[1], pad]),
            np.concatenate([dec_alone[1], dec_alone[0], pad]),
        ]
    )
    enc_seg = np.array([[1] * 5 + [2] * 5 + [0] * 2] * 2, np.int32)
    dec_seg = np.array([[1] * 4 + [2] * 4 + [0] * 2] * 2, np.int32)
    packed = logits_fn(params, enc, dec, enc_seg, dec_seg)
    for row, (first, second) in enumerate([(0, 1), (1, 0)]):
        np.testing.assert_allclose(packed[row, :4], alone[first], atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(packed[row, 4:8], alone[second], atol=1e-5, rtol=1e-5)
    # With one segment for everything the second example sees the first: the check has teeth.
    one_segment = logits_fn(
        params, enc, dec, (enc_seg > 0).astype(np.int32), (dec_seg > 0).astype(np.int32)
    )
    assert not np.allclose(one_segment[0, 4:8], alone[1], atol=1e-3)


def test_decoder_is_causal(setup):
    config, params, logits_fn = setup
    enc = random_tokens(7, (2, 5))
    dec = random_tokens(8, (2, 4), low=0)
    changed = dec.copy()
    changed[:, 2] = (changed[:, 2] + 1) % config.vocab_size
    before, after = logits_fn(params, enc, dec), logits_fn(params, enc, changed)
    np.testing.assert_allclose(after[:, :2], before[:, :2], atol=1e-6, rtol=1e-6)
    assert not np.allclose(after[:, 2:], before[:, 2:], atol=1e-3)


# (key position - query position, expected bucket) with num_buckets 32, max_distance 128.
BIDIRECTIONAL_BUCKETS = [
    (0, 0),
    (-1, 1),  # key one before the query
    (-7, 7),
    (1, 17),  # key one after the query: the other half of the buckets
    (7, 23),
    (-8, 8),  # first logarithmic bucket
    (8, 24),
    (-12, 9),  # 8 + int(8 * log(12 / 8) / log(128 / 8))
    (-127, 15),
    (-128, 15),
    (-5000, 15),  # far away clamps to the last bucket of its half
    (5000, 31),
]
CAUSAL_BUCKETS = [
    (0, 0),
    (-1, 1),
    (-15, 15),
    (-16, 16),  # first logarithmic bucket
    (-20, 17),  # 16 + int(16 * log(20 / 16) / log(128 / 16))
    (-64, 26),  # 16 + int(16 * 2 / 3)
    (-127, 31),
    (-5000, 31),
    (1, 0),  # the future is never attended; it shares bucket 0
    (300, 0),
]


@pytest.mark.parametrize(
    "bidirectional, table", [(True, BIDIRECTIONAL_BUCKETS), (False, CAUSAL_BUCKETS)]
)
def test_relative_position_bucket_values(bidirectional, table):
    relative, expected = (np.array(column) for column in zip(*table, strict=True))
    got = layers.relative_position_bucket(jnp.asarray(relative), bidirectional, 32, 128)
    np.testing.assert_array_equal(np.asarray(got), expected)


def test_relative_position_bucket_structure():
    distance = jnp.arange(0, 400)
    before = np.asarray(layers.relative_position_bucket(-distance, True, 32, 128))
    after = np.asarray(layers.relative_position_bucket(distance[1:], True, 32, 128))
    assert before.min() == 0 and before.max() == 15
    assert after.min() == 17 and after.max() == 31
    assert np.all(np.diff(before) >= 0) and np.all(np.diff(after) >= 0)
    causal = np.asarray(layers.relative_position_bucket(-distance, False, 32, 128))
    assert np.all(np.diff(causal) >= 0) and causal.max() == 31
    np.testing.assert_array_equal(causal[:16], np.arange(16))


def _loss_and_grads(config: T5Config, params, enc, dec, targets, dropout_seed=None):
    model = Transformer(config)
    deterministic = dropout_seed is None
    rngs = None if deterministic else {"dropout": jax.random.key(dropout_seed)}

    def loss_fn(params):
        logits = model.apply({"params": params}, enc, dec, deterministic=deterministic, rngs=rngs)
        log_probs = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(log_probs, targets[..., None], axis=-1))

    return jit(jax.value_and_grad(loss_fn))(params)


# Deterministic for one variant, with dropout (same rng, so the same masks) for the other.
@pytest.mark.parametrize("variant, dropout", [("t5_1_0", 0.0), ("t5_1_1", 0.1), ("umt5", 0.0)])
def test_remat_policies_match_no_remat(variant, dropout):
    enc = random_tokens(9, (2, 5))
    dec = random_tokens(10, (2, 4), low=0)
    targets = jnp.asarray(random_tokens(11, (2, 4)))
    seed = None if dropout == 0.0 else 42
    base = small_config(variant, dropout_rate=dropout)
    params = nn.unbox(init_params(base))
    loss, grads = _loss_and_grads(base, params, enc, dec, targets, seed)
    for policy in ("full", "dots"):
        config = dataclasses.replace(base, remat_policy=policy)
        assert jax.tree.structure(abstract_params(config)) == jax.tree.structure(params)
        remat_loss, remat_grads = _loss_and_grads(config, params, enc, dec, targets, seed)
        np.testing.assert_allclose(remat_loss, loss, atol=1e-6, rtol=1e-6)
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-6),
            remat_grads,
            grads,
        )


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("remat_policy", "everything", "remat_policy = 'everything' is not one of 'none'"),
        ("dtype", "bf16", "dtype = 'bf16' is not one of 'float32', 'bfloat16'"),
        ("mlp_activations", ("gelu", "linaer"), "entry = 'linaer' is not one of 'relu'"),
        ("mlp_activations", "gelu", "mlp_activations = 'gelu' must be a tuple"),
    ],
)
def test_bad_config_values_are_rejected_with_the_choices(field, value, message):
    with pytest.raises(UserError, match=re.escape(message)):
        small_config("t5_1_1", **{field: value})


def test_bfloat16_activations_close_to_float32(setup, variant):
    config, params, logits_fn = setup
    bf16 = dataclasses.replace(config, dtype="bfloat16")
    bf16_params = jax.tree.leaves(abstract_params(bf16))
    assert all(v.dtype == jnp.float32 for v in bf16_params)

    enc = random_tokens(12, (2, 5))
    dec = random_tokens(13, (2, 4), low=0)
    expected = logits_fn(params, enc, dec)
    got = jit(Transformer(bf16).apply)({"params": params}, enc, dec)
    assert got.dtype == jnp.float32  # logits come back in float32 for the loss
    assert not np.allclose(got, expected, atol=1e-6)  # bfloat16 really was used
    scale = float(jnp.std(expected))
    np.testing.assert_allclose(got, expected, atol=0.1 * scale, rtol=0.05)
    assert float(jnp.mean(jnp.argmax(got, -1) == jnp.argmax(expected, -1))) > 0.8


@pytest.mark.parametrize("batch", [1, 2, 3, 5, 8])
def test_layer_bias_gradient_is_the_batch_sum(batch):
    from t5tpu.model import network

    rng = np.random.default_rng(batch)
    position = jnp.asarray(rng.standard_normal((1, 2, 3, 4)), jnp.float32)
    mask = jnp.asarray(rng.standard_normal((batch, 1, 3, 4)), jnp.float32)
    weights = jnp.asarray(rng.standard_normal((batch, 2, 3, 4)), jnp.float32)
    got = jax.grad(lambda p: jnp.sum(network._layer_bias(p, mask) * weights))(position)
    np.testing.assert_allclose(got, weights.sum(0, keepdims=True), rtol=1e-6, atol=1e-6)


def test_per_layer_position_biases_are_each_layers_own():
    """umT5 with every layer's table a copy of its stack's one table computes what T5 1.1
    computes; a table changed in one layer changes the logits, so each layer reads its own."""
    shared_config = small_config("t5_1_1")
    shared = nn.unbox(init_params(shared_config))
    per_layer = {**shared, "encoder": dict(shared["encoder"]), "decoder": dict(shared["decoder"])}
    for stack in ("encoder", "decoder"):
        table = per_layer[stack].pop("relpos_bias")
        for i in range(2):
            per_layer[stack][f"layers_{i}"] = {**shared[stack][f"layers_{i}"], "relpos_bias": table}
    config = small_config("umt5")
    enc, dec = random_tokens(14, (2, 5)), random_tokens(15, (2, 4), low=0)
    expected = jit(Transformer(shared_config).apply)({"params": shared}, enc, dec)
    logits = jit(Transformer(config).apply)
    np.testing.assert_allclose(logits({"params": per_layer}, enc, dec), expected, atol=1e-6)
    for stack in ("encoder", "decoder"):
        changed = jax.tree.map(lambda x: x, per_layer)
        bias = changed[stack]["layers_1"]["relpos_bias"]
        bias["rel_embedding"] = bias["rel_embedding"] + 1.0 * np.arange(32)
        assert not np.allclose(logits({"params": changed}, enc, dec), expected, atol=1e-3), stack
