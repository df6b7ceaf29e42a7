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
from t5tpu.runtime.lazy_imports import tf

_TF_STATE_MAGIC = b"model_checkpoint_path"
_STEP_VARIABLE = "global_step"
# Other spellings of the norms in some `t5` library checkpoints -> NAMES' spelling.
_ALIASES = (
    (re.compile(r"^(encoder|decoder)/rms_norm/scale$"), r"\1/final_layer_norm/scale"),
    (re.compile(r"/rms_norm/scale$"), "/layer_norm/scale"),
)
# The `t5` library's name of each t5tpu parameter.
NAMES = param_mapping.T5Names(
    embedding="shared/embedding",
    logits="decoder/logits/kernel",
    relpos_bias="{stack}/block_000/layer_000/SelfAttention/relative_attention_bias",
    final_norm="{stack}/final_layer_norm/scale",
    layer_norm="{stack}/block_{index:03d}/layer_{sublayer:03d}/layer_norm/scale",
    mlp="{stack}/block_{index:03d}/layer_{sublayer:03d}/DenseReluDense/{part}/kernel",
    attention="{stack}/block_{index:03d}/layer_{sublayer:03d}/{module}/{part}",
)


def _canonical(name: str) -> str:
    for pattern, replacement in _ALIASES:
        name = pattern.sub(replacement, name)
    return name


def _is_parameter(name: str) -> bool:
    return name != _STEP_VARIABLE and "_slot_" not in name.rsplit("/", 1)[-1]


class MeshTFCheckpoint(param_mapping.CheckpointReader):
    """The parameters of a `t5` library checkpoint (prefix or directory), read lazily."""

    def __init__(self, path: str):
        self.path = path
        self.description = f"Mesh TF checkpoint {path}"
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

    @staticmethod
    def recognizes(path: str) -> bool:
        """A checkpoint prefix (model.ckpt-N, with its .index file) or a directory whose
        `checkpoint` file is TensorFlow's checkpoint state."""
        if epath.Path(path + ".index").exists():
            return True
        state = epath.Path(path, "checkpoint")
        if not state.exists() or state.is_dir():
            return False
        with state.open("rb") as f:
            return f.read(len(_TF_STATE_MAGIC)) == _TF_STATE_MAGIC

    def stored_name(self, name: str) -> str:
        return NAMES(name)

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
