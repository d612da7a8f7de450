"""Test session setup: Pallas kernels run in interpret mode on CPU."""
import gc
import os

# XLA:CPU sizes its thread pool from PJRT_NPROC or NPROC (else the CPU count) when jax
# starts. Mosaic GPU's interpreter needs more pool threads than a 2-CPU machine gives or it
# can deadlock (jaxbwd/pallas/mosaic/_mgpu.py, check_interpreter_threads); Pallas's Triton
# interpreter, whose host callbacks also run on the pool, measured faster with 8 on 2 CPUs.
os.environ.setdefault("NPROC", str(max(8, os.cpu_count() or 1)))

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


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``-n N`` without ``--dist``: work stealing instead of xdist's default ``load``.

    ``load`` hands out consecutive chunks, so the suite's few minutes-long tests (the
    8-device sharding runs, the example trainings) queue on one worker while the other
    goes idle at the end; with work stealing an idle worker takes half of the other's
    queue, so the end is bounded by the longest single test.
    """
    explicit = any(a == "-d" or a.startswith("--dist") for a in config.invocation_params.args)
    if config.getvalue("dist") == "load" and not explicit:  # `--dist load` still gets load
        from xdist.scheduler import WorkStealingScheduling

        return WorkStealingScheduling(config, log)
    return None


def pytest_sessionfinish(session):
    """Collects garbage while the session is still running, then freezes what is left.

    Under pytest-xdist, a worker reports itself finished at the end of this hook; the
    controller then closes it and, if it has not exited within 5 s, sends it SIGINT
    (execnet). The worker's last step, pytest's own ``gc.collect()`` at unconfigure,
    walks every object the session made (traced jaxprs, compiled executables): seconds
    on a busy machine. The SIGINT then lands inside jax's ``gc.callbacks`` hook and
    pytest reports a ``KeyboardInterrupt`` as an unraisable-exception warning at the
    end of a green run. Collecting here (no timer runs yet; an unraisable exception
    raised here is still reported) and freezing the survivors makes that last collect
    walk only the few objects made after this point.
    """
    gc.collect()
    gc.freeze()
