"""Mesh TensorFlow checkpoints of the original `t5` library (gs://t5-data/pretrained_models/
{small,base,large,3B,11B}/model.ckpt-N), read with TensorFlow's checkpoint reader: its variables
come through TensorFlow's own filesystems (gs:// on a TPU VM), which no test emulator reaches;
the checks of what a path holds go through etils' epath like every other format's.

Variable names: shared/embedding; {encoder,decoder}/block_NNN/layer_MMM/... with layer_000 the
self-attention (SelfAttention/{q,k,v,o}, relative_attention_bias in block_000 only) and its
layer_norm/scale, decoder layer_001 the cross-attention (EncDecAttention), and the last layer the
feed-forward (DenseReluDense/{wi,wo}/kernel for T5 1.0, wi_0/wi_1 for T5 1.1);
{encoder,decoder}/final_layer_norm/scale; decoder/logits/kernel (T5 1.1's separate output
layer). Kernels are stored as T5X stores them ([in, out], attention 2-D, heads major), and the
relative attention bias as [heads, buckets]. Adafactor's slots (<name>_slot_vr, _slot_vc,
_slot_v) and global_step are not parameters; global_step gives the step.
"""

from __future__ import annotations

import re

import numpy as np
from etils import epath

from t5tpu.errors import UserError
from t5tpu.formats import param_mapping
from t5tpu.formats.vocabulary_source import VocabularySource
from t5tpu.model.network import T5Config
from t5tpu.runtime.lazy_imports import tf

_TF_STATE_MAGIC = b"model_checkpoint_path"
_STEP_VARIABLE = "global_step"
# Other spellings of the norms in some `t5` library checkpoints -> the names mapped below.
_ALIASES = (
    (re.compile(r"^(encoder|decoder)/rms_norm/scale$"), r"\1/final_layer_norm/scale"),
    (re.compile(r"/rms_norm/scale$"), "/layer_norm/scale"),
)


def is_mesh_tf_checkpoint(path: str) -> bool:
    """A checkpoint prefix (model.ckpt-N, with its .index file) or a directory whose
    `checkpoint` file is TensorFlow's checkpoint state."""
    if epath.Path(path + ".index").exists():
        return True
    state = epath.Path(path, "checkpoint")
    if not state.exists() or state.is_dir():
        return False
    with state.open("rb") as f:
        return f.read(len(_TF_STATE_MAGIC)) == _TF_STATE_MAGIC


def mtf_name(name: str) -> str:
    """The `t5` library's variable name of a t5tpu parameter."""
    if name == "token_embedder/embedding":
        return "shared/embedding"
    if name == "decoder/logits_dense/kernel":
        return "decoder/logits/kernel"
    stack = name.split("/")[0]
    if name == f"{stack}/relpos_bias/rel_embedding":
        return f"{stack}/block_000/layer_000/SelfAttention/relative_attention_bias"
    if name == f"{stack}/{stack}_norm/scale":
        return f"{stack}/final_layer_norm/scale"
    param = param_mapping.parse_layer_param(name)
    if param is None:
        raise ValueError(f"no Mesh TF name for t5tpu parameter {name}")
    sublayer, t5_module = param.t5_sublayer
    prefix = f"{param.stack}/block_{param.index:03d}/layer_{sublayer:03d}/{t5_module}"
    if t5_module == "layer_norm":
        return f"{prefix}/scale"
    if t5_module == "DenseReluDense":
        return f"{prefix}/{param.part}/kernel"
    return f"{prefix}/{param_mapping.T5_PROJECTIONS[param.part]}"


def _canonical(name: str) -> str:
    for pattern, replacement in _ALIASES:
        name = pattern.sub(replacement, name)
    return name


def _is_parameter(name: str) -> bool:
    return name != _STEP_VARIABLE and "_slot_" not in name.rsplit("/", 1)[-1]


class MeshTFCheckpoint:
    """The parameters of a `t5` library checkpoint (prefix or directory), read lazily."""

    def __init__(self, path: str):
        self.path = path
        try:
            self._reader = tf.train.load_checkpoint(path)
        except (ValueError, tf.errors.OpError) as e:
            message = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise UserError(
                f"cannot read a TensorFlow checkpoint at {path} ({message}); give a "
                "model.ckpt-N prefix or a directory with a `checkpoint` file"
            ) from None
        shapes = self._reader.get_variable_to_shape_map()
        self._names = {_canonical(n): n for n in shapes if _is_parameter(n)}
        self._shapes = {name: tuple(shapes[stored]) for name, stored in self._names.items()}
        self._has_step = _STEP_VARIABLE in shapes

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return dict(self._shapes)

    def read(self, name: str) -> np.ndarray:
        return np.asarray(self._reader.get_tensor(self._names[name]))

    @property
    def step(self) -> int:
        if self._has_step:
            return int(self._reader.get_tensor(_STEP_VARIABLE))
        prefix = tf.train.latest_checkpoint(self.path) or self.path
        match = re.search(r"-(\d+)$", prefix)
        return int(match.group(1)) if match else 0


def _t5tpu_names(mtf_shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """Flat-layout shapes under t5tpu names, for what config_from_flat_shapes needs."""
    if "shared/embedding" not in mtf_shapes:
        raise UserError("checkpoint has no shared/embedding; is it a `t5` library checkpoint?")
    probe = T5Config(
        num_encoder_layers=_count_blocks(mtf_shapes, "encoder"),
        num_decoder_layers=_count_blocks(mtf_shapes, "decoder"),
        mlp_activations=(
            ("gelu", "linear")
            if "encoder/block_000/layer_001/DenseReluDense/wi_0/kernel" in mtf_shapes
            else ("relu",)
        ),
        logits_via_embedding="decoder/logits/kernel" not in mtf_shapes,
    )
    # Names come from a model of the right layer count and kind; shapes from the checkpoint.
    names = param_mapping.model_shapes(param_mapping.abstract_params(probe))
    return {name: mtf_shapes[mtf_name(name)] for name in names if mtf_name(name) in mtf_shapes}


def _count_blocks(mtf_shapes, stack: str) -> int:
    return len({n.split("/")[1] for n in mtf_shapes if n.startswith(f"{stack}/block_")})


def load_config(path: str) -> T5Config:
    """The geometry of a `t5` library checkpoint, from its variable shapes (see
    param_mapping.config_from_flat_shapes for what shapes cannot tell)."""
    return param_mapping.config_from_flat_shapes(_t5tpu_names(MeshTFCheckpoint(path).shapes()))


def load_step(path: str) -> int:
    return MeshTFCheckpoint(path).step


def vocabulary(path: str) -> VocabularySource:
    del path  # the `t5` library's checkpoints do not carry their vocabulary
    return VocabularySource()


def import_plan(abstract_params) -> dict[str, param_mapping.Source]:
    return {
        name: param_mapping.Source(
            mtf_name(name),
            param_mapping.flat_layout_shape(name, shape),
            lambda array, shape=shape: array.reshape(shape),
        )
        for name, shape in param_mapping.model_shapes(abstract_params).items()
    }


def load_params(path: str, abstract_params, shardings=None):
    """The parameters of a `t5` library checkpoint mapped onto a tree like `abstract_params`;
    a UserError lists the names and shapes that differ from the model."""
    checkpoint = MeshTFCheckpoint(path)
    return param_mapping.load_mapped(
        f"Mesh TF checkpoint {path}",
        checkpoint.shapes(),
        checkpoint.read,
        import_plan(abstract_params),
        shardings,
    )
