"""The learning rate training logs is the one the optimizer applies at that step."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from t5tpu.training import optim


def test_logged_rate_is_the_rate_adamw_applies_at_each_step():
    schedule = optim.linear_decay_schedule(1e-3, decay_steps=4)
    optimizer = optim.adamw(schedule, max_grad_norm=10.0)
    params = {"w": jnp.ones((4, 3))}
    state = optimizer.init(params)
    logged, applied = [], []
    for _ in range(5):
        logged.append(float(optimizer.learning_rate(state)))
        # A constant gradient: Adam's debiased update is exactly -rate in every element.
        updates, state = optimizer.update({"w": jnp.full((4, 3), 0.5)}, state, params)
        applied.append(-float(updates["w"][0, 0]))
    np.testing.assert_allclose(logged, [1e-3, 7.5e-4, 5e-4, 2.5e-4, 0.0], atol=1e-9)
    np.testing.assert_allclose(applied, logged, rtol=1e-5, atol=1e-9)


def test_adafactor_rate_counts_from_its_fresh_state():
    warmup = optim.adafactor(optim.rsqrt_schedule(peak_learning_rate=0.01, warmup_steps=4))
    constant = optim.adafactor(0.003)
    params = {"kernel": jnp.ones((256, 128)), "scale": jnp.ones((128,))}
    state, constant_state = warmup.init(params), constant.init(params)
    logged = []
    for _ in range(6):
        logged.append(float(warmup.learning_rate(state)))
        _, state = warmup.update(params, state, params)
        _, constant_state = constant.update(params, constant_state, params)
    np.testing.assert_allclose(
        logged, [0.0, 0.0025, 0.005, 0.0075, 0.01, 0.01 * np.sqrt(4 / 5)], rtol=1e-6
    )
    np.testing.assert_allclose(float(constant.learning_rate(constant_state)), 0.003, rtol=1e-6)


def _adapted_tree():
    """One adapted kernel as a LoRA run's state holds it: lora_a random, lora_b zero."""
    rng = np.random.default_rng(0)
    return {
        "query": {
            "kernel": jnp.asarray(rng.normal(size=(16, 8)), jnp.float32),
            "lora_a": jnp.asarray(rng.uniform(-0.1, 0.1, size=(16, 4)), jnp.float32),
            "lora_b": jnp.zeros((4, 8), jnp.float32),
        }
    }


def test_adafactor_steps_lora_adapters_unscaled_and_other_weights_by_their_rms():
    """lora_b starts at zero: scaled by its RMS its step would stay at the 1e-3 floor. Adapters
    take the plain step whatever multiply_by_parameter_scale says, so a LoRA run needs no
    binding; other weights keep T5's parameter-scaled step."""
    params = _adapted_tree()
    grads = jax.tree_util.tree_map(jnp.ones_like, params)
    steps = {}
    for scaled in (True, False):
        opt = optim.adafactor(learning_rate=0.01, multiply_by_parameter_scale=scaled)
        updates, _ = opt.update(grads, opt.init(params), params)
        steps[scaled] = jax.tree_util.tree_map(np.asarray, updates)
    for name in ("lora_a", "lora_b"):
        np.testing.assert_array_equal(steps[True]["query"][name], steps[False]["query"][name])
        np.testing.assert_allclose(np.abs(steps[True]["query"][name]), 0.01, rtol=1e-6)
    kernel = params["query"]["kernel"]
    rms = float(jnp.sqrt(jnp.mean(jnp.square(kernel))))
    np.testing.assert_allclose(
        steps[True]["query"]["kernel"], steps[False]["query"]["kernel"] * rms, rtol=1e-6
    )


def test_adafactor_factors_attention_kernels_as_t5x_matrices():
    """T5 1.1's attention kernels ([embed, heads, 64] and [heads, 64, embed]) step exactly as
    optax's Adafactor steps T5X's 2-D kernels, [embed, heads·64] and [heads·64, embed], with
    factored moments; join_heads=False keeps the full moments of runs saved before."""
    rng = np.random.default_rng(0)
    shapes = {"query": (512, 4, 64), "out": (4, 64, 512)}
    params = {
        n: {"kernel": jnp.asarray(rng.normal(size=s), jnp.float32)} for n, s in shapes.items()
    }
    as_t5x = {"query": (512, 256), "out": (256, 512)}
    grads = [
        jax.tree_util.tree_map(lambda p: jnp.asarray(rng.normal(size=p.shape)), params)
        for _ in range(2)
    ]
    ours, theirs = optim.adafactor(0.01), optax.adafactor(0.01, min_dim_size_to_factor=128)
    flat = {n: {"kernel": params[n]["kernel"].reshape(as_t5x[n])} for n in params}
    ours_state, theirs_state = ours.init(params), theirs.init(flat)
    for g in grads:
        updates, ours_state = ours.update(g, ours_state, params)
        flat_g = {n: {"kernel": g[n]["kernel"].reshape(as_t5x[n])} for n in g}
        expected, theirs_state = theirs.update(flat_g, theirs_state, flat)
        for n in params:
            np.testing.assert_allclose(
                updates[n]["kernel"].reshape(as_t5x[n]), expected[n]["kernel"], rtol=1e-6
            )
    # The same numbers as T5X's moments, kept in the kernel's own dims: heads x head_dim, embed.
    for n, moments in enumerate((ours_state[0], theirs_state[0])):
        shaped = (moments.v_row["query"]["kernel"], moments.v_col["query"]["kernel"])
        assert [m.shape for m in shaped] == [[(4, 64), (512,)], [(256,), (512,)]][n]
        assert moments.v["query"]["kernel"].shape == (1,)  # no full moment
    for name in ("v_row", "v_col"):
        np.testing.assert_allclose(
            getattr(ours_state[0], name)["out"]["kernel"].reshape(-1),
            getattr(theirs_state[0], name)["out"]["kernel"],
            rtol=1e-6,
        )
    before = optim.adafactor(0.01, join_heads=False).init(params)[0]
    assert before.v["query"]["kernel"].shape == shapes["query"]


def test_a_run_saved_with_full_attention_moments_is_told_how_to_resume():
    from t5tpu.storage import checkpoints

    params = {"attention": {"query": {"kernel": jnp.zeros((512, 4, 64))}}}
    shapes = {
        name: checkpoints.flat_shapes(jax.eval_shape(optimizer.init, params))
        for name, optimizer in {
            "joined": optim.adafactor(),
            "before": optim.adafactor(join_heads=False),
            "adamw": optim.adamw(),
        }.items()
    }
    assert checkpoints.full_attention_moments(shapes["before"], shapes["joined"])
    assert not checkpoints.full_attention_moments(shapes["adamw"], shapes["joined"])
    assert not checkpoints.full_attention_moments(shapes["joined"], shapes["joined"])


def test_factored_moments_are_optaxs_wherever_no_heads_are_joined():
    """Every other leaf steps, and keeps state, exactly as optax.scale_by_factored_rms does:
    2-D (sides of either order, equal sides), 3-D (the two largest dims), a scanned stack,
    vectors and small matrices (full moments)."""
    rng = np.random.default_rng(1)
    shapes = {
        "wi": (256, 512),
        "wo": (512, 256),
        "square": (128, 128),
        "lora_b": (8, 160, 130),
        "layers": {"wi": (3, 128, 384)},
        "scale": (256,),
        "rel_embedding": (32, 6),
    }
    params = jax.tree_util.tree_map(
        lambda s: jnp.asarray(rng.normal(size=s), jnp.float32),
        shapes,
        is_leaf=lambda x: isinstance(x, tuple),
    )
    ours = optim.scale_by_factored_rms(0.8)
    theirs = optax.scale_by_factored_rms(decay_rate=0.8, min_dim_size_to_factor=128)
    ours_state, theirs_state = ours.init(params), theirs.init(params)
    for _ in range(3):
        grads = jax.tree_util.tree_map(lambda p: jnp.asarray(rng.normal(size=p.shape)), params)
        ours_updates, ours_state = ours.update(grads, ours_state, params)
        theirs_updates, theirs_state = theirs.update(grads, theirs_state, params)
        for mine, optaxs in [(ours_updates, theirs_updates), (ours_state, theirs_state)]:
            jax.tree_util.tree_map(
                lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-6), mine, optaxs
            )


def test_adafactor_state_steps_donated_straight_from_init():
    """Training donates the state: each of its leaves must be a buffer of its own."""
    params = {"kernel": jnp.ones((256, 128)), "scale": jnp.ones((128,))}
    optimizer = optim.adafactor(0.01)
    step = jax.jit(lambda g, s, p: optimizer.update(g, s, p), donate_argnums=1)
    updates, state = step(params, optimizer.init(params), params)
    assert np.isfinite(updates["kernel"]).all() and int(state[0].count) == 1
