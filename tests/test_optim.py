"""The learning rate training logs is the one the optimizer applies at that step."""

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
