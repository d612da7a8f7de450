"""Test session setup: Pallas kernels run in interpret mode on CPU."""
import os

import jax
import pytest

from jaxbwd import config

# The contract tests run every kernel through Pallas's interpreter on CPU. Lowering tests
# switch interpret mode off locally to emit the real Triton kernels.
config.set_default(interpret=True)


def pytest_collection_modifyitems(config, items):
    on_gpu = jax.default_backend() == "gpu"
    skip_gpu = pytest.mark.skip(reason="needs a GPU (tests marked `gpu` run real compiled kernels)")
    for item in items:
        if "gpu" in item.keywords and not on_gpu:
            item.add_marker(skip_gpu)
