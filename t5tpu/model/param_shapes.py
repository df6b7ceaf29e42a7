"""A network's parameter shapes, traced without allocating them: the one place that asks, for
training, loading, serving and every checkpoint format alike.

No shape depends on the sequence lengths (T5's positions are relative buckets), so one token
stands in for each input and none of these takes lengths.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

from t5tpu.model.model_family import network_module
from t5tpu.model.network import T5Config


def boxed_abstract_params(config: T5Config):
    """Parameter shapes still carrying their logical axis names, laid out as `config` runs
    them (a stack of layers as one array under scan_layers)."""
    tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    variables = jax.eval_shape(network_module(config).init, jax.random.PRNGKey(0), tokens, tokens)
    return variables["params"]


def abstract_params(config: T5Config, *, unrolled: bool = False):
    """Parameter shapes; `unrolled`: in the layers_N layout that every checkpoint format uses,
    whatever config.scan_layers says."""
    if unrolled:
        config = dataclasses.replace(config, scan_layers=False)
    return nn.unbox(boxed_abstract_params(config))


def sharded_abstract_params(config: T5Config, partitioner):
    """(parameter shapes, their shardings by `partitioner`'s logical axis rules)."""
    boxed = boxed_abstract_params(config)
    return nn.unbox(boxed), partitioner.param_shardings(boxed)
