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


def __getattr__(name):
    # ``jaxbwd.nn.nnx`` after ``import jaxbwd.nn``, imported on first use (it imports flax.nnx).
    if name == "nnx":
        import importlib

        return importlib.import_module("jaxbwd.nn.nnx")
    raise AttributeError(f"module 'jaxbwd.nn' has no attribute {name!r}")
