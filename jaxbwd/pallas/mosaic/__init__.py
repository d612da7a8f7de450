"""Mosaic GPU (Hopper, sm_90) kernels behind ``jaxbwd.config.use(pallas_backend="mosaic")``.

``_mgpu`` is the only module that imports Mosaic GPU's experimental Pallas API; kernel
modules (``attention``) use it through that module.
"""
