"""Pallas GPU kernels (Triton backend) of jaxbwd's backward passes."""
from jaxbwd.pallas._common import lower_for_gpu, triton_kernel_names, abstract_gpu

__all__ = ["lower_for_gpu", "triton_kernel_names", "abstract_gpu"]
