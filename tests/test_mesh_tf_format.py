"""Mesh TensorFlow checkpoints of the `t5` library: a TF checkpoint (V2 bundle + `checkpoint`
state file) is written with the library's variable names, kernel layouts, Adafactor slot
variables and global_step, and the importer must give back the parameters it was made from."""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf
from flax import traverse_util
from t5x_checkpoints import CONFIGS, random_params, t5x_layout

from t5tpu.errors import UserError
from t5tpu.formats import loader, mesh_tf_format
from t5tpu.model import param_shapes
from t5tpu.model.network import T5Config

STEP = 1_000_000
BFLOAT16 = "shared/embedding"  # some `t5` checkpoints keep variables in bfloat16

# The `t5` library's names for one block, written out by hand (not derived from the importer):
# (its sublayer/module, t5tpu's module).
ENCODER_ATTENTION = [("layer_000/SelfAttention", "attention")]
DECODER_ATTENTION = [
    ("layer_000/SelfAttention", "self_attention"),
    ("layer_001/EncDecAttention", "encoder_decoder_attention"),
]
ENCODER_NORMS = [("layer_000", "pre_attention_layer_norm"), ("layer_001", "pre_mlp_layer_norm")]
DECODER_NORMS = [
    ("layer_000", "pre_self_attention_layer_norm"),
    ("layer_001", "pre_cross_attention_layer_norm"),
    ("layer_002", "pre_mlp_layer_norm"),
]
PROJECTIONS = [("q", "query"), ("k", "key"), ("v", "value"), ("o", "out")]


def t5_library_variables(params: dict, config: T5Config, norm: str = "layer_norm") -> dict:
    """{t5 library variable name: array} for t5tpu parameters."""
    out = {"shared/embedding": params["token_embedder/embedding"]}
    stacks = {
        "encoder": (config.num_encoder_layers, ENCODER_ATTENTION, ENCODER_NORMS, "layer_001"),
        "decoder": (config.num_decoder_layers, DECODER_ATTENTION, DECODER_NORMS, "layer_002"),
    }
    for stack, (layers, attentions, norms, mlp) in stacks.items():
        for i in range(layers):
            block, ours = f"{stack}/block_{i:03d}", f"{stack}/layers_{i}"
            for theirs, module in attentions:
                for short, long in PROJECTIONS:
                    name = f"{ours}/{module}/{long}/kernel"
                    out[f"{block}/{theirs}/{short}"] = t5x_layout(name, params[name])
            for sublayer, module in norms:
                out[f"{block}/{sublayer}/{norm}/scale"] = params[f"{ours}/{module}/scale"]
            for kernel in ("wi", "wi_0", "wi_1", "wo"):
                if f"{ours}/mlp/{kernel}/kernel" in params:
                    out[f"{block}/{mlp}/DenseReluDense/{kernel}/kernel"] = params[
                        f"{ours}/mlp/{kernel}/kernel"
                    ]
        out[f"{stack}/block_000/layer_000/SelfAttention/relative_attention_bias"] = params[
            f"{stack}/relpos_bias/rel_embedding"
        ]
        out[f"{stack}/final_layer_norm/scale"] = params[f"{stack}/{stack}_norm/scale"]
    if not config.logits_via_embedding:
        out["decoder/logits/kernel"] = params["decoder/logits_dense/kernel"]
    return out


def write_mesh_tf_checkpoint(directory: str, variables: dict[str, np.ndarray], step: int) -> str:
    """model.ckpt-<step>.{index,data-*} plus the `checkpoint` state file; returns the prefix."""
    names, tensors = [], []
    for name, value in variables.items():
        names.append(name)
        if name == BFLOAT16:
            tensors.append(tf.constant(value, tf.bfloat16))
        else:
            tensors.append(tf.constant(value))
        # Adafactor's factored slots, as the `t5` library saves them beside each variable.
        if value.ndim == 2:
            names += [f"{name}_slot_vr", f"{name}_slot_vc"]
            tensors += [tf.zeros(value.shape[:1]), tf.zeros(value.shape[1:])]
        else:
            names.append(f"{name}_slot_v")
            tensors.append(tf.zeros(value.shape))
    names.append("global_step")
    tensors.append(tf.constant(step, tf.int64))
    prefix = os.path.join(directory, f"model.ckpt-{step}")
    tf.raw_ops.SaveV2(
        prefix=prefix, tensor_names=names, shape_and_slices=[""] * len(names), tensors=tensors
    )
    tf.compat.v1.train.update_checkpoint_state(directory, prefix)
    return prefix


@pytest.fixture(scope="module", params=list(CONFIGS))
def checkpoint(request, tmp_path_factory):
    config = CONFIGS[request.param]
    params = random_params(config, seed=3)
    directory = str(tmp_path_factory.mktemp("mesh_tf"))
    prefix = write_mesh_tf_checkpoint(directory, t5_library_variables(params, config), STEP)
    return config, params, directory, prefix


def _expected(params):
    embedding = params["token_embedder/embedding"]
    rounded = embedding.astype(ml_dtypes.bfloat16).astype(np.float32)
    return {**params, "token_embedder/embedding": rounded}


def test_the_reader_sees_the_t5_library_names(checkpoint):
    _, _, directory, _ = checkpoint
    names = dict(tf.train.list_variables(directory))
    assert names["encoder/block_000/layer_000/SelfAttention/q"] == [32, 32]
    assert names["decoder/block_001/layer_001/EncDecAttention/o"] == [32, 32]
    assert names["encoder/block_000/layer_000/SelfAttention/relative_attention_bias"] == [2, 32]
    assert "encoder/block_000/layer_000/SelfAttention/q_slot_vr" in names
    assert "global_step" in names


@pytest.mark.parametrize("given", ["directory", "prefix"])
def test_imports_every_parameter_exactly(checkpoint, given):
    config, params, directory, prefix = checkpoint
    path = directory if given == "directory" else prefix
    assert loader.detect_format(path) == "mesh_tf"
    imported = loader.open_checkpoint(path).load(
        param_shapes.abstract_params(config, unrolled=True)
    )
    flat = traverse_util.flatten_dict(imported, sep="/")
    expected = _expected(params)
    assert sorted(flat) == sorted(expected)
    for name, value in expected.items():
        assert flat[name].dtype == np.float32, name
        np.testing.assert_array_equal(flat[name], value, err_msg=name)


def test_geometry_and_step_come_from_the_checkpoint(checkpoint):
    config, _, directory, prefix = checkpoint
    assert mesh_tf_format.MeshTFCheckpoint(directory).config() == config
    assert mesh_tf_format.MeshTFCheckpoint(prefix).step == STEP
    assert loader.open_checkpoint(directory).step == STEP


def test_rms_norm_spelling_is_accepted(tmp_path):
    config = CONFIGS["1.0"]
    params = random_params(config, seed=4)
    variables = t5_library_variables(params, config, norm="rms_norm")
    variables["encoder/rms_norm/scale"] = variables.pop("encoder/final_layer_norm/scale")
    prefix = write_mesh_tf_checkpoint(str(tmp_path), variables, 7)
    imported = mesh_tf_format.MeshTFCheckpoint(prefix).load(
        param_shapes.abstract_params(config, unrolled=True)
    )
    np.testing.assert_array_equal(
        imported["encoder"]["encoder_norm"]["scale"], params["encoder/encoder_norm/scale"]
    )
    np.testing.assert_array_equal(
        imported["decoder"]["layers_1"]["pre_mlp_layer_norm"]["scale"],
        params["decoder/layers_1/pre_mlp_layer_norm/scale"],
    )


def test_refuses_another_geometry_listing_names_and_shapes(checkpoint):
    config, _, directory, _ = checkpoint
    other = T5Config(**{**config.__dict__, "mlp_dim": 48})
    with pytest.raises(UserError) as error:
        mesh_tf_format.MeshTFCheckpoint(directory).load(
            param_shapes.abstract_params(other, unrolled=True)
        )
    message = str(error.value)
    assert f"Mesh TF checkpoint {directory} has another geometry" in message
    wo = "decoder/block_000/layer_002/DenseReluDense/wo/kernel"
    assert f"{wo}: found (64, 32) vs model (48, 32)" in message


def test_an_unreadable_checkpoint_is_a_user_error(tmp_path):
    (tmp_path / "checkpoint").write_text('model_checkpoint_path: "model.ckpt-5"\n')
    assert mesh_tf_format.MeshTFCheckpoint.recognizes(str(tmp_path))
    with pytest.raises(UserError, match="cannot read a TensorFlow checkpoint"):
        mesh_tf_format.MeshTFCheckpoint(str(tmp_path)).config()
