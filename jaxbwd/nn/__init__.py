"""Flax modules over jaxbwd's ops: linen here, NNX in ``jaxbwd.nn.nnx``; parameters match flax's own.

Requires the ``flax`` extra: ``pip install "jaxbwd[flax]"``.
"""
from jaxbwd.nn.linen import (
    Attention,
    BatchNorm,
    Conv,
    Dense,
    Dropout,
    Embed,
    GroupNorm,
    LayerNorm,
    MultiHeadDotProductAttention,
    PixelShuffle,
    RMSNorm,
    SwiGLUMLP,
    Upsample,
    dot_product_attention,
)

__all__ = ["Attention", "BatchNorm", "Conv", "Dense", "Dropout", "Embed", "GroupNorm", "LayerNorm", "MultiHeadDotProductAttention",
           "PixelShuffle", "RMSNorm", "SwiGLUMLP", "Upsample", "dot_product_attention"]
