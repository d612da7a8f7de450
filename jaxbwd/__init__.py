"""jaxbwd: JAX training ops whose backward passes run as Pallas GPU kernels.

Every op declares its reverse rule as a ``jax.custom_vjp`` fwd/bwd pair: the forward
saves small residuals (row statistics, logsumexp) and the backward runs a Pallas kernel
(Triton backend) on GPU, or the same formula in XLA elsewhere. On jax >= 0.12 each op is
one primitive that also carries a tangent rule (``jaxbwd/vjp/_derivatives.py``), so
forward mode and second order work too. Choose per call with ``implementation=None|"auto"|"pallas"|"xla"``
(``"pallas:triton"``/``"pallas:mosaic"`` name the Pallas backend) or globally with
:mod:`jaxbwd.config`, which takes the same values.

Errors common to every op (each op's docstring lists its own; all name the op and are
raised while tracing):

* ``TypeError``: an operand of a dtype the op does not take (integers, 8-bit floats);
  float64 operands with a Pallas implementation named in the call (the kernels compute in
  float32; ``None`` and ``"xla"`` run XLA for them).
* ``ValueError``: an unknown ``implementation``; ``"pallas:mosaic"`` named for an op, dtype,
  head dim or GPU generation without a Mosaic kernel (``config.MOSAIC_KERNELS``); a Pallas
  implementation named with symbolic shapes (``jax.export``); a kernel to run on a CPU
  backend outside interpret mode; an empty reduction axis (hidden size, vocabulary, keys);
  a dimension a kernel indexes past 2**31 - 1 (while x64 is off, also cross_entropy's
  classes and embed's table rows on the XLA path, which JAX gathers with int32); NumPy
  int64 index arrays (ids, labels, lengths, segment ids) with values outside int32 while
  x64 is off (JAX would wrap them; with x64 on, such values are out of range and each op's
  docstring says what it does).
"""
from jaxbwd import checkpoint_policies, config
from jaxbwd.define import define_elementwise, define_op
from jaxbwd.vjp.activations import gated_linear_unit, gelu, glu, silu, softmax, swiglu
from jaxbwd.vjp.activations import leaky_relu, relu, sigmoid, tanh
from jaxbwd.vjp.attention import dot_product_attention
from jaxbwd.vjp.embedding import embed
from jaxbwd.vjp.group_norm import group_norm
from jaxbwd.vjp.losses import cross_entropy
from jaxbwd.vjp.linear_cross_entropy import linear_cross_entropy
from jaxbwd.vjp.rope import rope
from jaxbwd.vjp.regression import mse_loss
from jaxbwd.vjp.batch_norm import batch_norm
from jaxbwd.vjp.pooling import adaptive_avg_pool2d, avg_pool2d, max_pool2d
from jaxbwd.vjp.dropout import bias_dropout_add, dropout
from jaxbwd.vjp.linear import bias_add, matmul, residual_add, scale
from jaxbwd.vjp.norms import layer_norm, rms_norm
from jaxbwd.vjp.shape import reshape, row_slice
from jaxbwd.vjp.vision import conv2d, pixel_shuffle, unpatchify, upsample2d

__version__ = "0.1.0"

__all__ = [
    "checkpoint_policies", "config", "define_op", "define_elementwise",
    "rms_norm", "layer_norm", "group_norm",
    "softmax", "silu", "gelu", "swiglu", "glu", "gated_linear_unit",
    "dot_product_attention", "embed", "rope", "cross_entropy", "linear_cross_entropy",
    "matmul", "bias_add", "scale", "residual_add",
    "reshape", "row_slice",
    "conv2d", "upsample2d", "pixel_shuffle", "unpatchify",
    "relu", "leaky_relu", "sigmoid", "tanh", "mse_loss", "dropout", "bias_dropout_add", "batch_norm",
    "max_pool2d", "avg_pool2d", "adaptive_avg_pool2d",
]
