"""T5X native checkpoints: checkpoint_N/ written exactly as T5X's Checkpointer lays it out
(t5x_checkpoints.py), and the importer must give back the parameters it was written from."""

from __future__ import annotations

import os

import jax
import numpy as np
import pytest
from flax import traverse_util
from t5x_checkpoints import (
    BFLOAT16,
    CONFIGS,
    STEP,
    expected_values,
    random_params,
    write_t5x_checkpoint,
)

from t5tpu.errors import UserError
from t5tpu.formats import loader, t5x_format
from t5tpu.model import param_shapes
from t5tpu.model.network import T5Config


@pytest.fixture(scope="module", params=list(CONFIGS))
def checkpoint(request, tmp_path_factory):
    config = CONFIGS[request.param]
    params = random_params(config)
    path = write_t5x_checkpoint(str(tmp_path_factory.mktemp("t5x")), params, STEP)
    return config, params, path


def test_imports_every_parameter_exactly(checkpoint):
    config, params, path = checkpoint
    imported = t5x_format.T5XCheckpoint(path).load(
        param_shapes.abstract_params(config, unrolled=True)
    )
    flat = traverse_util.flatten_dict(imported, sep="/")
    expected = expected_values(params)
    assert sorted(flat) == sorted(expected)
    for name, value in expected.items():
        assert flat[name].dtype == np.float32 and flat[name].shape == value.shape, name
        np.testing.assert_array_equal(flat[name], value, err_msg=name)
    # bfloat16 leaves really went through bfloat16 (and differ from the float32 originals)
    assert not np.array_equal(flat[BFLOAT16], params[BFLOAT16])


def test_geometry_and_step_come_from_the_checkpoint(checkpoint):
    config, _, path = checkpoint
    reader = t5x_format.T5XCheckpoint(path)
    assert reader.config() == config
    assert reader.step == STEP
    assert loader.open_checkpoint(path).step == STEP


def test_open_checkpoint_detects_the_directory_and_the_index_file(checkpoint):
    config, params, path = checkpoint
    abstract = param_shapes.abstract_params(config, unrolled=True)
    assert loader.detect_format(path) == "t5x"
    assert loader.detect_format(os.path.join(path, "checkpoint")) == "t5x"
    for given in (path, os.path.join(path, "checkpoint")):
        imported = loader.open_checkpoint(given).load(abstract)
        np.testing.assert_array_equal(
            imported["token_embedder"]["embedding"], params["token_embedder/embedding"]
        )


def test_shardings_place_each_parameter(checkpoint):
    config, _, path = checkpoint
    abstract = param_shapes.abstract_params(config, unrolled=True)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shardings = jax.tree_util.tree_map(lambda _: device, abstract)
    imported = loader.open_checkpoint(path).load(abstract, shardings)
    leaves = jax.tree_util.tree_leaves(imported)
    assert all(isinstance(x, jax.Array) and x.sharding == device for x in leaves)


def test_refuses_another_geometry_listing_names_and_shapes(checkpoint):
    config, _, path = checkpoint
    wider = T5Config(**{**config.__dict__, "num_heads": 4})
    with pytest.raises(UserError) as error:
        t5x_format.T5XCheckpoint(path).load(param_shapes.abstract_params(wider, unrolled=True))
    message = str(error.value)
    assert f"T5X checkpoint {path} has another geometry" in message
    key = "decoder/layers_0/encoder_decoder_attention/key/kernel"
    assert f"{key}: found (32, 32) vs model (32, 64)" in message


def test_a_directory_without_a_msgpack_index_is_refused(tmp_path):
    (tmp_path / "checkpoint").write_text("model_checkpoint_path: 'model.ckpt-5'\n")
    assert not t5x_format.T5XCheckpoint.recognizes(str(tmp_path))
    with pytest.raises(UserError, match="not a T5X checkpoint"):
        t5x_format.T5XCheckpoint(str(tmp_path)).load({})
    (tmp_path / "checkpoint").write_bytes(b"\xc1 not msgpack")
    with pytest.raises(UserError, match="not a readable T5X msgpack index"):
        t5x_format.T5XCheckpoint(str(tmp_path)).config()
