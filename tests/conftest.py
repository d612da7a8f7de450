"""Test session setup: Pallas kernels run in interpret mode on CPU."""
import gc
import os

# XLA:CPU sizes its thread pool from PJRT_NPROC or NPROC (else the CPU count) when jax
# starts. Mosaic GPU's interpreter needs more pool threads than a 2-CPU machine gives or it
# can deadlock (jaxbwd/pallas/mosaic/_mgpu.py, check_interpreter_threads); Pallas's Triton
# interpreter, whose host callbacks also run on the pool, measured faster with 8 on 2 CPUs.
os.environ.setdefault("NPROC", str(max(8, os.cpu_count() or 1)))

import shutil
import tempfile

import jax
import pytest

from jaxbwd import config, deviceless

# The contract tests run every kernel through Pallas's interpreter on CPU. Lowering tests
# switch interpret mode off locally to emit the real Triton kernels.
config.set_default(interpret=True)


# One XLA compilation cache per test session, shared by the xdist workers and removed at the
# end: the suite compiles many identical interpreted kernels from different Python functions
# (and each worker its own copy), which jit's in-memory cache cannot reuse; measured 6-8%
# faster on 2 CPUs. Off where the [compile] extra is installed, so that no cached executable
# can stand in for a compile whose kernel cache file the compile tests read; JAXBWD_XLA_CACHE
# = 1 or 0 forces it on or off. Subprocesses (examples, sharding) do not use it.
_CACHE_ENV = "JAXBWD_TEST_XLA_CACHE_DIR"


def _xla_cache_wanted() -> bool:
    forced = os.environ.get("JAXBWD_XLA_CACHE")
    return forced == "1" if forced in ("0", "1") else bool(deviceless.missing_requirements())


def pytest_configure(config):
    if hasattr(config, "workerinput") or not _xla_cache_wanted():
        return  # a worker finds the directory in its environment, made by the controller
    os.environ[_CACHE_ENV] = config._jaxbwd_xla_cache = tempfile.mkdtemp(prefix="jaxbwd-xla-cache-")
    _use_xla_cache()


def _use_xla_cache():
    if os.environ.get(_CACHE_ENV):
        jax.config.update("jax_compilation_cache_dir", os.environ[_CACHE_ENV])
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)


_use_xla_cache()


def pytest_unconfigure(config):
    if getattr(config, "_jaxbwd_xla_cache", None):
        shutil.rmtree(config._jaxbwd_xla_cache, ignore_errors=True)


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
