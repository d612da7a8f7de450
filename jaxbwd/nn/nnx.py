"""Flax NNX modules whose computation runs through jaxbwd's ops.

Each class subclasses the flax NNX module of the same name and replaces only
``__call__``: parameters (names, shapes, initialisers, metadata) are flax's own, so NNX
state moves across unchanged. Each constructor takes flax's arguments plus
``implementation=None|"pallas"|"xla"``.
"""
from __future__ import annotations

from typing import Optional

import jax.numpy as jnp
from flax import nnx

import jaxbwd


def _value(p):
    return p[...] if hasattr(p, "__getitem__") else p.value


class _Impl:
    def _set_impl(self, implementation: Optional[str]):
        jaxbwd.config.resolve(implementation, type(self).__name__)
        self.implementation = implementation


class RMSNorm(nnx.RMSNorm, _Impl):
    """``flax.nnx.RMSNorm`` over the last axis via :func:`jaxbwd.rms_norm`.

    Call: x [..., num_features] floating -> same shape, x's dtype. Requires ``use_scale=True``
    and the default last-axis reduction. Errors: those of :func:`jaxbwd.rms_norm`; ValueError
    for other reduction axes. Source: Zhang & Sennrich (2019).
    """

    def __init__(self, num_features: int, *, implementation: Optional[str] = None, **kwargs):
        super().__init__(num_features, **kwargs)
        if self.reduction_axes not in (-1, (-1,)) or self.scale is None:
            raise ValueError("jaxbwd.nn.nnx.RMSNorm: only use_scale=True over the last axis is supported")
        self._set_impl(implementation)

    def __call__(self, x, mask=None):
        if mask is not None:
            raise ValueError("jaxbwd.nn.nnx.RMSNorm: mask is not supported, got a mask")
        return jaxbwd.rms_norm(x, _value(self.scale).astype(x.dtype), eps=self.epsilon,
                               implementation=self.implementation)


class LayerNorm(nnx.LayerNorm, _Impl):
    """``flax.nnx.LayerNorm`` over the last axis via :func:`jaxbwd.layer_norm`.

    Call: x [..., num_features] -> same shape, x's dtype. Requires scale and bias.
    Errors: those of :func:`jaxbwd.layer_norm`. Source: Ba et al. (2016).
    """

    def __init__(self, num_features: int, *, implementation: Optional[str] = None, **kwargs):
        super().__init__(num_features, **kwargs)
        if self.reduction_axes not in (-1, (-1,)) or self.scale is None or self.bias is None:
            raise ValueError("jaxbwd.nn.nnx.LayerNorm: only scale and bias over the last axis are supported")
        self._set_impl(implementation)

    def __call__(self, x, mask=None):
        if mask is not None:
            raise ValueError("jaxbwd.nn.nnx.LayerNorm: mask is not supported, got a mask")
        return jaxbwd.layer_norm(x, _value(self.scale).astype(x.dtype), _value(self.bias).astype(x.dtype),
                                 eps=self.epsilon, implementation=self.implementation)


class Linear(nnx.Linear, _Impl):
    """``flax.nnx.Linear`` via :func:`jaxbwd.matmul` and :func:`jaxbwd.bias_add`.

    Call: x [..., in_features] -> [..., out_features]. Errors: those of the two ops.
    """

    def __init__(self, in_features: int, out_features: int, *, implementation: Optional[str] = None, **kwargs):
        super().__init__(in_features, out_features, **kwargs)
        self._set_impl(implementation)

    def __call__(self, x, out_sharding=None):
        y = jaxbwd.matmul(x, _value(self.kernel).astype(x.dtype), implementation=self.implementation)
        if self.bias is not None:
            y = jaxbwd.bias_add(y, _value(self.bias).astype(y.dtype), implementation=self.implementation)
        return y


class Embed(nnx.Embed, _Impl):
    """``flax.nnx.Embed`` via :func:`jaxbwd.embed` (Pallas scatter-add backward).

    Call: ids int [...] -> [..., features]. ``attend(x)``: [..., features] ->
    [..., num_embeddings]. Errors: those of :func:`jaxbwd.embed`.
    """

    def __init__(self, num_embeddings: int, features: int, *, implementation: Optional[str] = None, **kwargs):
        super().__init__(num_embeddings, features, **kwargs)
        self._set_impl(implementation)

    def __call__(self, inputs, out_sharding=None):
        return jaxbwd.embed(inputs, _value(self.embedding), implementation=self.implementation)

    def attend(self, query, out_sharding=None):
        return jaxbwd.matmul(query, _value(self.embedding).T.astype(query.dtype), implementation=self.implementation)
