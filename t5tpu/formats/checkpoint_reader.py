"""The interface of the checkpoint formats t5tpu imports, and what they share.

Each format (hf_format, t5x_format, mesh_tf_format) is a CheckpointReader: it recognizes its
checkpoints and, opened at a path, gives their step, geometry and vocabulary, and the one name
table that says under which name it stores each t5tpu parameter (the `t5` library's names, in
T5Names, for Mesh TF and Hugging Face; t5tpu's own for T5X). Loading is shared: the stored names
and shapes are checked against the model (all differences in one error) before anything is read,
then tensors are read and converted one by one.

Layouts: t5tpu keeps attention kernels 3-D ([embed, heads, kv] and [heads, kv, embed]); T5X and
Mesh TensorFlow store them 2-D ([embed, heads*kv], [heads*kv, embed], heads major), the "flat
layout" below. Every other parameter has the same shape in all three.
"""

from __future__ import annotations

import abc
import dataclasses
import math
import re
from collections.abc import Callable, Mapping

import jax
import numpy as np
from flax import traverse_util

from t5tpu.errors import UserError
from t5tpu.formats.vocabulary_source import VocabularySource
from t5tpu.model.network import T5Config
from t5tpu.storage.checkpoints import flat_shapes, geometry_differences
from t5tpu.storage.run_record import RunRecord

# Sublayers of a T5 block as the `t5` library and Hugging Face number and name them:
# t5tpu module name -> (sublayer index, T5 module name).
_T5_SUBLAYERS = {
    "encoder": {
        "pre_attention_layer_norm": (0, "layer_norm"),
        "attention": (0, "SelfAttention"),
        "pre_mlp_layer_norm": (1, "layer_norm"),
        "mlp": (1, "DenseReluDense"),
    },
    "decoder": {
        "pre_self_attention_layer_norm": (0, "layer_norm"),
        "self_attention": (0, "SelfAttention"),
        "pre_cross_attention_layer_norm": (1, "layer_norm"),
        "encoder_decoder_attention": (1, "EncDecAttention"),
        "pre_mlp_layer_norm": (2, "layer_norm"),
        "mlp": (2, "DenseReluDense"),
    },
}
_T5_PROJECTIONS = {"query": "q", "key": "k", "value": "v", "out": "o"}

# Sizes (vocabulary, widths) from 2**31 up overflow jax's int32 shapes; no T5 comes near.
_MAX_SIZE = 2**31

_LAYER_PARAM = re.compile(r"(encoder|decoder)/layers_(\d+)/(\w+)/(\w+)(?:/(\w+))?$")


@dataclasses.dataclass(frozen=True)
class T5Names:
    """How a format spells the `t5` library's parameter names, which Mesh TF and Hugging Face
    both follow: format strings over {stack}, {index} (the block), {sublayer}, {module}
    ('SelfAttention', 'EncDecAttention', ...) and {part} ('q', 'wi_0', ...). The position bias
    is block {index}'s: block 0's where a stack has one, each block's own in umT5."""

    embedding: str
    logits: str
    relpos_bias: str
    final_norm: str
    layer_norm: str
    mlp: str
    attention: str

    def __call__(self, name: str) -> str:
        """The format's name of t5tpu parameter `name`."""
        stack = name.split("/")[0]
        outside_layers = {
            "token_embedder/embedding": self.embedding,
            "decoder/logits_dense/kernel": self.logits,
            f"{stack}/relpos_bias/rel_embedding": self.relpos_bias,
            f"{stack}/{stack}_norm/scale": self.final_norm,
        }
        if name in outside_layers:
            return outside_layers[name].format(stack=stack, index=0)
        match = _LAYER_PARAM.match(name)
        if not match:
            raise ValueError(f"no `t5` library name for t5tpu parameter {name}")
        stack, index, module, part, _ = match.groups()
        if module == "relpos_bias":  # umT5: every layer's own, in its self-attention
            return self.relpos_bias.format(stack=stack, index=int(index))
        sublayer, t5_module = _T5_SUBLAYERS[stack][module]
        by_module = {"layer_norm": self.layer_norm, "DenseReluDense": self.mlp}
        return by_module.get(t5_module, self.attention).format(
            stack=stack,
            index=int(index),
            sublayer=sublayer,
            module=t5_module,
            part=_T5_PROJECTIONS.get(part, part),
        )


def _is_attention(name: str, projections: tuple[str, ...]) -> bool:
    parts = name.split("/")
    return (
        len(parts) >= 3
        and parts[-1] == "kernel"
        and parts[-2] in projections
        and parts[-3] in ("attention", "self_attention", "encoder_decoder_attention")
    )


def flat_layout_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape T5X and Mesh TF store a t5tpu parameter in (attention kernels 2-D)."""
    if _is_attention(name, ("query", "key", "value")):
        return (shape[0], shape[1] * shape[2])
    if _is_attention(name, ("out",)):
        return (shape[0] * shape[1], shape[2])
    return tuple(shape)


def to_flat_layout(name: str, array: np.ndarray) -> np.ndarray:
    return np.asarray(array).reshape(flat_layout_shape(name, array.shape))


def as_float32(array) -> np.ndarray:
    """float32 numpy from any float array (bfloat16 and float16 included)."""
    return np.asarray(array).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class Source:
    """One stored tensor that holds a t5tpu parameter: its name and shape in the source, and
    how to turn it into t5tpu's layout (given the array read as float32)."""

    name: str
    shape: tuple[int, ...]
    to_model: Callable[[np.ndarray], np.ndarray]


class CheckpointReader(abc.ABC):
    """One checkpoint of a format t5tpu imports, at a path; what cannot be read is a one-line
    UserError. The defaults are what T5X and Mesh TF share: the flat layout, the geometry read
    off the shapes, no vocabulary recorded."""

    description: str  # how errors name it: "T5X checkpoint DIR"

    @staticmethod
    @abc.abstractmethod
    def recognizes(path: str) -> bool:
        """Whether `path` holds a checkpoint of this format."""

    @property
    @abc.abstractmethod
    def step(self) -> int:
        """The training step it was saved at (0 where the format records none)."""

    @abc.abstractmethod
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Stored name -> shape of each parameter (optimizer state, aliases, copies left out)."""

    @abc.abstractmethod
    def read(self, stored_name: str) -> np.ndarray: ...

    def stored_name(self, name: str) -> str:
        """The name it stores t5tpu parameter `name` under (T5X's are t5tpu's)."""
        return name

    def source(self, name: str, shape: tuple[int, ...]) -> Source:
        """The stored tensor that holds parameter `name` of the model's `shape`."""
        flat = flat_layout_shape(name, shape)
        return Source(self.stored_name(name), flat, lambda array: array.reshape(shape))

    def config(self) -> T5Config:
        return config_from_flat_shapes(self.shapes(), self.stored_name)

    def vocabulary(self) -> VocabularySource:
        return VocabularySource()  # T5X and Mesh TF checkpoints do not record theirs

    def run_record(self) -> RunRecord | None:
        """What the checkpoint says of the inputs and outputs it was trained for (the lengths,
        the input shaping, the decoding); None: nothing (T5X and Mesh TF record none)."""
        return None

    def load(self, abstract_params, shardings=None):
        """The parameters, as a tree like `abstract_params`: float32 numpy arrays, or jax arrays
        placed with `shardings` (a tree like the parameters) so that only one host copy exists
        at a time. Names and shapes that differ from the model are refused before anything is
        read, all listed in one UserError."""
        model = flat_shapes(abstract_params)
        plan = {name: self.source(name, shape) for name, shape in model.items()}
        expected = {source.name: source.shape for source in plan.values()}
        found = self.shapes()
        # Names come from the file: a damaged one would break the one-line list below.
        strange = [name for name in found if not name.isprintable()]
        if strange:
            raise UserError(
                f"{self.description} holds a tensor named {strange[0]!r}, which no T5 "
                "checkpoint has; is it damaged?"
            )
        differences = geometry_differences(found, expected)
        if differences:
            raise UserError(
                f"{self.description} has another geometry than the model ({differences}); use "
                "the model gin file that matches it (`t5tpu convert` writes one)"
            )
        flat_shardings = traverse_util.flatten_dict(shardings or {}, sep="/")
        params = {}
        for name, source in plan.items():
            array = source.to_model(as_float32(self.read(source.name)))
            if name in flat_shardings:
                # Every host holds the whole array and hands each of its devices its slice,
                # which works whether or not the sharding spans other hosts' devices.
                array = jax.make_array_from_callback(
                    array.shape, flat_shardings[name], lambda index, array=array: array[index]
                )
            params[name] = array
        return traverse_util.unflatten_dict(params, sep="/")


def _unchanged(name: str) -> str:
    return name


def _needed_shape(shapes, stored: str, dims: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of tensor `stored`, which a T5 checkpoint must have with `dims` dimensions."""
    if stored not in shapes:
        raise UserError(f"checkpoint has no {stored}; is it a T5 encoder-decoder checkpoint?")
    shape = shapes[stored]
    # Read from the file: a damaged one must not size (and trace) a model of any shape.
    if len(shape) not in dims or not all(0 < size < _MAX_SIZE for size in shape):
        raise UserError(
            f"checkpoint has {stored} of shape {tuple(shape)}, not a T5's; is it damaged?"
        )
    return shape


def config_from_flat_shapes(
    shapes: Mapping[str, tuple[int, ...]], stored_name: Callable[[str], str] = _unchanged
) -> T5Config:
    """The T5Config of a checkpoint in the flat layout (T5X, Mesh TF), whose name for each
    t5tpu parameter `stored_name` gives (default: t5tpu's own).

    What shapes cannot tell is taken as T5 does: a gated feed-forward (wi_0/wi_1) is T5 1.1's
    gated-GELU, and relative positions saturate at distance 128. A position-bias table in layer
    0 and none beside the layers is umT5's, one in every layer (a format that names both alike,
    as Mesh TF does, keeps one per stack).
    """

    def has(name):
        return stored_name(name) in shapes

    def need(name, dims=(2,)):
        return _needed_shape(shapes, stored_name(name), dims)

    def count(stack):
        layers = 0
        while has(f"{stack}/layers_{layers}/pre_mlp_layer_norm/scale"):
            layers += 1
        return layers

    vocab_size, emb_dim = need("token_embedder/embedding")
    shared_relpos, first_relpos = (
        "encoder/relpos_bias/rel_embedding",
        "encoder/layers_0/relpos_bias/rel_embedding",
    )
    per_layer = has(first_relpos) and not has(shared_relpos)
    num_heads, num_buckets = need(first_relpos if per_layer else shared_relpos)
    # [embed, heads*kv] flat; T5X's scalable_t5 keeps [embed, heads, kv] as t5tpu does.
    joined_kv = math.prod(need("encoder/layers_0/attention/query/kernel", dims=(2, 3))[1:])
    if joined_kv % num_heads:
        raise UserError(
            f"checkpoint has {stored_name('encoder/layers_0/attention/query/kernel')} of "
            f"{joined_kv} columns for {num_heads} heads; is it damaged?"
        )
    return T5Config(
        vocab_size=vocab_size,
        emb_dim=emb_dim,
        num_heads=num_heads,
        head_dim=joined_kv // num_heads,
        mlp_dim=need("encoder/layers_0/mlp/wo/kernel")[0],
        num_encoder_layers=count("encoder"),
        num_decoder_layers=count("decoder"),
        mlp_activations=(
            ("gelu", "linear") if has("encoder/layers_0/mlp/wi_0/kernel") else ("relu",)
        ),
        logits_via_embedding=not has("decoder/logits_dense/kernel"),
        relative_attention_num_buckets=num_buckets,
        relative_bias_per_layer=per_layer,
    )
