"""The tiny T5 the tests build in-process: configs/models/t5_1_1/tiny.gin's geometry (a 1M-parameter
T5 1.1 whose vocabulary is the bundled 1,024-piece SentencePiece model), with what a test changes.

A plain module rather than a fixture, so module-level constants and test_multihost.py's worker
processes can use it too; conftest.py offers it as the `tiny_config` fixture as well."""

from __future__ import annotations

from t5tpu.model.network import T5Config

TINY_GEOMETRY = dict(
    vocab_size=1024,
    emb_dim=128,
    num_heads=4,
    head_dim=32,
    mlp_dim=256,
    num_encoder_layers=2,
    num_decoder_layers=2,
)


def tiny_config(**overrides) -> T5Config:
    """The tiny geometry with `overrides` (any T5Config field: a smaller width, T5 1.0's
    activations, scan_layers, a dtype)."""
    return T5Config(**{**TINY_GEOMETRY, **overrides})
