"""The base as a LoRA run trained its adapters on it (model/lora.py's base_as_trained), the one
rounding that training, loading and serving share: the same bits eagerly, inside a jitted
program (as serve's engine calls it) and as training's bfloat16 copy."""

import jax
import jax.numpy as jnp
import numpy as np

from t5tpu.model import lora


def _joined():
    """A joined tree (base and adapters), base values that bfloat16 cannot hold exactly."""
    rng = np.random.default_rng(0)
    normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
    return {
        "encoder": {
            "attention": {
                "query": {
                    "kernel": normal(64, 32),
                    "lora_a": normal(64, 4),
                    "lora_b": normal(4, 32),
                },
            },
            "norm": {"scale": normal(64) * 1e-30},  # tiny values: subnormal in bfloat16
        },
        "step": jnp.arange(3, dtype=jnp.int32),
    }


def _bits(tree):
    return jax.tree_util.tree_map(lambda x: np.asarray(x).view(np.uint8), tree)


def _assert_bitwise(a, b):
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    leaves = zip(*(jax.tree_util.tree_leaves(_bits(t)) for t in (a, b)), strict=True)
    for x, y in leaves:
        np.testing.assert_array_equal(x, y)


def test_base_as_trained_is_served_as_loaded_and_as_trained_bitwise():
    params = _joined()
    loaded = lora.base_as_trained(params, "bfloat16")  # loading: before the merge
    served = jax.jit(lambda p: lora.base_as_trained(p, "bfloat16"))(params)  # serve's programs
    _assert_bitwise(loaded, served)
    # Training holds the base in bfloat16: the same values, exactly.
    base, adapters = lora.split(params)
    trained = jax.jit(lambda p: lora.cast(lora.base_as_trained(p, "bfloat16"), "bfloat16"))(base)
    _assert_bitwise(lora.split(loaded)[0], lora.cast(trained, "float32"))
    _assert_bitwise(lora.split(loaded)[0], lora.cast(lora.cast(base, "bfloat16"), "float32"))
    # Rounded, not kept: the base changed, in float32 still; the adapters and ints untouched.
    kernel = loaded["encoder"]["attention"]["query"]["kernel"]
    assert kernel.dtype == jnp.float32
    assert not np.array_equal(kernel, params["encoder"]["attention"]["query"]["kernel"])
    _assert_bitwise(lora.split(loaded)[1], adapters)
    _assert_bitwise(loaded["step"], params["step"])


def test_a_float32_base_is_trained_as_it_is():
    params = _joined()
    _assert_bitwise(jax.jit(lambda p: lora.base_as_trained(p, "float32"))(params), params)
