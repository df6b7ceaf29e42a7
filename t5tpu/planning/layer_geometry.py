"""What the memory plan reads of a model family: each stack's widths and depth, and the traits
of its layers that change which tensors the backward pass keeps. memory_plan.py counts the
tensors; this says, per family, how wide they are and which kinds a layer has. T5's (every
T5Config: T5 1.0, 1.1, mT5, ByT5, umT5) and T5Gemma's are the two descriptions.
"""

from __future__ import annotations

import dataclasses

from t5tpu.model.network import T5Config
from t5tpu.model.t5gemma_network import T5GemmaConfig, T5GemmaStack


@dataclasses.dataclass(frozen=True)
class StackGeometry:
    """One stack's layers: widths, heads and depth."""

    emb_dim: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    mlp_dim: int
    num_layers: int
    # The logical axis of the key and value projections' heads: T5's share 'heads' with the
    # queries; T5Gemma's fewer key/value heads are 'kv_heads' (sharded only where they divide).
    kv_axis: str = "heads"


@dataclasses.dataclass(frozen=True)
class Geometry:
    """A model as the memory plan sees it."""

    family: str  # "t5" or "t5gemma"
    encoder: StackGeometry
    decoder: StackGeometry
    vocab_size: int
    mlp_inputs: int  # the feed-forward's input projections: 1 (ReLU) or 2 (gated)
    # T5's one-hot relative position buckets, kept per stack (float32, not batched); 0 for
    # T5Gemma's rotary positions.
    position_buckets: int
    # The parameters whose gradients the backward pass computes first (the output layer's).
    output_layers: tuple[str, ...]
    # T5Gemma's traits: a norm after each block too (its input, the block's output, is kept),
    # and tanh soft-capped attention scores and output logits (the tanh is kept).
    sandwich_norms: bool = False
    softcapped_scores: bool = False
    softcapped_logits: bool = False

    @property
    def gemma(self) -> bool:
        return self.family == "t5gemma"


def _gemma_stack(stack: T5GemmaStack) -> StackGeometry:
    return StackGeometry(
        emb_dim=stack.emb_dim,
        num_heads=stack.num_heads,
        num_kv_heads=stack.num_kv_heads,
        head_dim=stack.head_dim,
        mlp_dim=stack.mlp_dim,
        num_layers=stack.num_layers,
        kv_axis="kv_heads",
    )


def geometry_of(config: T5Config | T5GemmaConfig) -> Geometry:
    if isinstance(config, T5GemmaConfig):
        return Geometry(
            family="t5gemma",
            encoder=_gemma_stack(config.encoder),
            decoder=_gemma_stack(config.decoder),
            vocab_size=config.vocab_size,
            mlp_inputs=2,
            position_buckets=0,
            # Tied: the decoder's embedding is the output layer.
            output_layers=("decoder/token_embedder/embedding",),
            sandwich_norms=True,
            softcapped_scores=config.encoder.attn_logit_softcapping is not None,
            softcapped_logits=config.final_logit_softcapping is not None,
        )
    c = config

    def stack(layers: int) -> StackGeometry:
        return StackGeometry(c.emb_dim, c.num_heads, c.num_heads, c.head_dim, c.mlp_dim, layers)

    return Geometry(
        family="t5",
        encoder=stack(c.num_encoder_layers),
        decoder=stack(c.num_decoder_layers),
        vocab_size=c.vocab_size,
        mlp_inputs=len(c.mlp_activations),
        position_buckets=c.relative_attention_num_buckets,
        output_layers=("token_embedder/embedding", "decoder/logits_dense/kernel"),
    )
