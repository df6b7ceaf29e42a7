"""Training low-rank adapters on a frozen base (train.method = @lora()).

The train state (trainer.TrainState) holds the adapters as its parameters, so gradients,
optimizer state and checkpoints cover them alone; the base is a separate input of the jit'd step,
in its own dtype (bfloat16 by default), never donated, never updated, with no gradient. The
step is trainer.train_step itself, on a model whose loss joins base and adapters.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from t5tpu.model import lora, param_shapes
from t5tpu.model.encoder_decoder import EncoderDecoderModel
from t5tpu.partitioning import Partitioner
from t5tpu.training import trainer


class _WithBase:
    """The adapted model as train_step sees it: its parameters are the adapters, the loss runs
    on base and adapters joined."""

    def __init__(self, model: EncoderDecoderModel, base):
        self.model, self.base = model, base
        # train_step draws dropout keys when the config has dropout; the adapters' counts too.
        rate = max(model.config.dropout_rate, model.config.lora.dropout)
        self.config = dataclasses.replace(model.config, dropout_rate=rate)

    def loss(self, adapters, batch, dropout_rng=None):
        return self.model.loss(lora.join(self.base, adapters), batch, dropout_rng)

    def normalizer(self, num_tokens):
        return self.model.normalizer(num_tokens)


@dataclasses.dataclass(frozen=True)
class LoraBaseShapes:
    """The train state's abstract shapes and shardings (adapters and their optimizer state),
    and the base's (in its training dtype) beside them."""

    abstract: trainer.TrainState
    shardings: trainer.TrainState
    base: object
    base_shardings: object


def state_shardings(
    model: EncoderDecoderModel, optimizer, partitioner: Partitioner
) -> LoraBaseShapes:
    """Like trainer.state_shardings for the adapted `model`: adapters and their moments are
    partitioned by their logical axes, like the kernels they adapt; the base likewise."""
    boxed = param_shapes.boxed_abstract_params(model.config)
    boxed_base, boxed_adapters = lora.split(boxed)
    adapters = nn.unbox(boxed_adapters)
    abstract = jax.eval_shape(
        lambda p: trainer.TrainState(jnp.int32(0), p, optimizer.init(p)), adapters
    )
    shardings = trainer.TrainState(
        partitioner.replicated(),
        partitioner.param_shardings(boxed_adapters),
        partitioner.opt_state_shardings(abstract.opt_state, boxed_adapters),
    )
    dtype = jnp.dtype(model.config.lora.base_dtype)
    base = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, dtype), nn.unbox(boxed_base)
    )
    return LoraBaseShapes(abstract, shardings, base, partitioner.param_shardings(boxed_base))


def initial_state(model: EncoderDecoderModel, optimizer, rng, input_length, target_length):
    """Fresh adapters (A random, B zero: the base's outputs unchanged) and their optimizer
    state."""
    params = nn.unbox(model.init(rng, input_length, target_length))
    _, adapters = lora.split(params)
    return trainer.TrainState(jnp.int32(0), adapters, optimizer.init(adapters))


def compile_train_step(
    model, optimizer, shapes: LoraBaseShapes, partitioner: Partitioner, num_microbatches: int = 1
):
    """The jit'd step (state, base, batch, dropout_seed) -> (state, metrics); the old state is
    donated, the base is not."""

    def step(state, base, batch, dropout_seed):
        return trainer.train_step(
            _WithBase(model, base),
            optimizer,
            state,
            batch,
            dropout_seed,
            num_microbatches,
            shapes.shardings.params,
        )

    shardings = shapes.shardings
    return partitioner.jit(
        step,
        in_shardings=(
            shardings,
            shapes.base_shardings,
            partitioner.batch_sharding(),
            partitioner.replicated(),
        ),
        out_shardings=(shardings, partitioner.replicated()),
        donate_argnums=(0,),
    )
