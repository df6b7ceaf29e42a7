"""T5X native checkpoints: checkpoint_N/ written exactly as T5X's Checkpointer lays it out
(t5x_checkpoints.py), and the importer must give back the parameters it was written from."""

from __future__ import annotations

import dataclasses
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
    scanned_layout,
    write_t5x_checkpoint,
)

from t5tpu.errors import UserError
from t5tpu.formats import loader, t5x_format
from t5tpu.model import param_shapes
from t5tpu.model.network import T5Config, Transformer


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


# umT5 as T5X's scalable_t5 writes it: narrow, a position-bias table in every layer, 3 encoder
# layers so that a mix-up of the stacks shows.
UMT5 = dataclasses.replace(CONFIGS["1.1"], relative_bias_per_layer=True, num_encoder_layers=3)


def _same(name, array):
    return array  # scalable_t5 keeps t5tpu's own shapes (attention kernels 3-D)


@pytest.mark.parametrize("axis", [1, 0, None], ids=["scanned", "scan_axis_0", "unrolled"])
def test_scalable_t5_umt5_layouts_import_with_the_source_logits(axis, tmp_path):
    """Scanned (T5X's default param_scan_axis 1, and 0) and unrolled: the geometry read off the
    shapes, every parameter back exactly, and the logits of the parameters it was written from."""
    params = random_params(UMT5, seed=3)
    stored = params if axis is None else scanned_layout(params, axis)
    if axis is not None:
        assert stored["encoder/encoder/relpos_bias/rel_embedding"].shape[axis] == 3
        assert not any("layers_" in name for name in stored)
    path = write_t5x_checkpoint(str(tmp_path), stored, STEP, layout=_same)
    reader = t5x_format.T5XCheckpoint(path)
    assert reader.config() == UMT5
    imported = reader.load(param_shapes.abstract_params(UMT5, unrolled=True))
    flat = traverse_util.flatten_dict(imported, sep="/")
    # Unrolled, two of the leaves are written in bfloat16 (t5x_checkpoints.BFLOAT16, ...).
    written = expected_values(params) if axis is None else params
    assert sorted(flat) == sorted(written)
    for name, value in written.items():
        np.testing.assert_array_equal(flat[name], value, err_msg=name)
    rng = np.random.default_rng(0)
    enc, dec = rng.integers(1, 96, (2, 9)), rng.integers(0, 96, (2, 5))
    model = Transformer(UMT5)
    logits = model.apply({"params": imported}, enc, dec)
    source = model.apply({"params": traverse_util.unflatten_dict(written, sep="/")}, enc, dec)
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(source))


@pytest.mark.parity
def test_a_scanned_umt5_checkpoint_converts_to_t5tpu_and_on_to_transformers_umt5(tmp_path):
    """`t5tpu convert` of the scanned layout writes a model gin with the per-layer switch, and
    its export loads in transformers as UMT5 with the source parameters' logits: the way from
    T5X's scalable umT5 checkpoints to Hugging Face (transformers#22573)."""
    import torch
    import transformers

    from t5tpu.cli import convert as convert_command

    params = random_params(UMT5, seed=4)
    source = write_t5x_checkpoint(str(tmp_path / "t5x"), scanned_layout(params), STEP, layout=_same)
    converted, hf_dir = str(tmp_path / "t5tpu"), str(tmp_path / "hf")
    assert convert_command.main([f"--input={source}", f"--output_dir={converted}"]) == 0
    text = (tmp_path / "t5tpu" / "model.gin").read_text()
    assert "T5Config.relative_bias_per_layer = True" in text.splitlines()
    assert convert_command.main(["--to=hf", f"--input={converted}", f"--output_dir={hf_dir}"]) == 0
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(hf_dir).eval()
    assert type(model).__name__ == "UMT5ForConditionalGeneration"
    rng = np.random.default_rng(1)
    enc, dec = rng.integers(1, 96, (2, 9)), rng.integers(0, 96, (2, 5))
    dec[:, 0] = 0
    expected = Transformer(UMT5).apply(
        {"params": traverse_util.unflatten_dict(params, sep="/")}, enc, dec
    )
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(enc), decoder_input_ids=torch.tensor(dec)).logits
    np.testing.assert_allclose(logits.numpy(), np.asarray(expected), rtol=1e-4, atol=1e-4)
