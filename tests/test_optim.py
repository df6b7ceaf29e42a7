"""The learning rate training logs is the one the optimizer applies at that step."""

import jax
import jax.numpy as jnp
import numpy as np

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
