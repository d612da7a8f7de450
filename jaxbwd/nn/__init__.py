"""Flax modules over jaxbwd's ops: linen here, NNX in ``jaxbwd.nn.nnx``; parameters match flax's own.

Requires the ``flax`` extra: ``pip install "jaxbwd[flax]"``.
"""
from jaxbwd.nn.linen import (
    Attention,
    Dense,
    Embed,
    LayerNorm,
    RMSNorm,
    SwiGLUMLP,
)

__all__ = ["Attention", "Dense", "Embed", "LayerNorm", "RMSNorm", "SwiGLUMLP"]
