"""Implementation choice and Pallas interpret mode.

Every op takes ``implementation=None | "auto" | "pallas" | "xla" | "pallas:triton" |
"pallas:mosaic"``, and :func:`use`, :func:`set_default` and ``JAXBWD_IMPLEMENTATION`` take
the same values (one vocabulary; ``"pallas:<backend>"`` names the Pallas backend too, below).
``None`` or ``"auto"`` defers to the global default, which is ``JAXBWD_IMPLEMENTATION`` from
the environment, or, when unset, "pallas" on GPU and "xla" elsewhere. Interpret mode (Pallas kernels run on
CPU through ``pallas_call(..., interpret=True)``) is off unless ``JAXBWD_INTERPRET=1``
or set from code. The choice is read once, at trace time: a jitted function keeps
what it was traced with.

Pallas backends. The Pallas path compiles through Triton (the default) or, for the ops and
GPU generations listed in ``MOSAIC_KERNELS``, through Mosaic GPU. The choice comes from
``use(pallas_backend=...)``/``set_default(pallas_backend=...)``, ``JAXBWD_PALLAS_BACKEND``
(``triton`` or ``mosaic``), ``implementation="pallas:mosaic"`` / ``"pallas:triton"`` given to
those settings (the same as ``implementation="pallas"`` with that ``pallas_backend``; both
given and different: ``ValueError``), or per call as ``implementation="pallas:mosaic"`` /
``"pallas:triton"``. The rule when Mosaic is asked for an op, GPU generation or dtype the
table does not list:

- asked for through the settings (``use``, ``set_default``, the environment): that op runs
  its Triton kernels, so a model can switch globally while only some ops have Mosaic
  kernels;
- asked for per call (``implementation="pallas:mosaic"``): ``ValueError``, since the caller
  named that kernel explicitly.

The Mosaic kernels need jax >= 0.12 (``MOSAIC_AVAILABLE``); on older jax no op has one, and
the same rule applies.

Mosaic interpret mode (``interpret=True`` with the Mosaic backend) runs the kernels in Mosaic
GPU's interpreter (``plgpu.InterpretGPUParams``), which simulates shared memory, TMA,
barriers and wgmma and, with ``detect_races`` (on by default here), checks for data races.
Without a GPU the generation is Hopper (sm_90), the one the interpreter simulates.

Example::

    with jaxbwd.config.use(implementation="pallas", interpret=True):
        loss, grads = jax.value_and_grad(loss_fn)(params)

    with jaxbwd.config.use(pallas_backend="mosaic"):
        out = jaxbwd.dot_product_attention(q, k, v, is_causal=True)
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
from typing import Any, Iterator, Optional

import jax
import numpy as np

IMPLEMENTATIONS = ("pallas", "xla")
PALLAS_BACKENDS = ("triton", "mosaic")
# Per-call spellings of a Pallas backend: ``implementation="pallas:mosaic"``.
_PER_CALL = {f"pallas:{b}": b for b in PALLAS_BACKENDS}

# Ops with a Mosaic GPU kernel: op -> {compute capability (major * 10 + minor) -> what it
# covers: input "dtypes" and the largest last dim of the first input ("max_last_dim", the
# head dim for attention)}. A generation not listed runs Triton. Triton stays the default
# for every op until GPU timing (bench/gpu_check.sh) shows a Mosaic kernel ahead there.
MOSAIC_KERNELS = {
    # wgmma (sm_90a) with f32 accumulators; 16-bit inputs only (f32 would be tf32 in wgmma,
    # below the f32 contract's accuracy); head dims up to 256, above 128 with one consumer
    # warpgroup and dk/dv split in two kernels (jaxbwd/pallas/mosaic/attention.py).
    "dot_product_attention": {90: {"dtypes": ("bfloat16", "float16"), "max_last_dim": 256}},
}
# The Mosaic GPU kernels are written against jax 0.12's Pallas Mosaic GPU API; on older jax
# the table is empty (settings-wide choices run Triton, per-call requests raise).
MOSAIC_AVAILABLE = tuple(int(p) for p in jax.__version__.split(".")[:2]) >= (0, 12)


_NAMES = "None, 'auto', 'pallas', 'xla', 'pallas:triton' or 'pallas:mosaic'"


def _split(implementation, where: Optional[str]) -> tuple[Optional[str], Optional[str]]:
    """``implementation`` as (``"pallas"``/``"xla"``/None for the default, the Pallas backend
    it names or None): ``"pallas:mosaic"`` -> ("pallas", "mosaic"), ``"auto"`` -> (None, None)."""
    at = f"jaxbwd{'.' + where if where else ''}"
    if implementation is None:
        return None, None
    if not isinstance(implementation, str):
        raise TypeError(f"{at}: implementation must be a string or None ({_NAMES}), got {implementation!r}")
    if implementation == "auto":
        return None, None
    if implementation in IMPLEMENTATIONS:
        return implementation, None
    if implementation in _PER_CALL:
        return "pallas", _PER_CALL[implementation]
    raise ValueError(f"{at}: implementation must be {_NAMES}, got {implementation!r}")


def _env_settings() -> tuple[Optional[str], str]:
    """(implementation, Pallas backend) from ``JAXBWD_IMPLEMENTATION`` and ``JAXBWD_PALLAS_BACKEND``."""
    value = os.environ.get("JAXBWD_IMPLEMENTATION", "").strip().lower()
    try:
        implementation, named = _split(None if value in ("", "none") else value, None)
    except ValueError:
        raise ValueError("jaxbwd: JAXBWD_IMPLEMENTATION must be one of auto, none, pallas, xla, pallas:triton, "
                         f"pallas:mosaic or unset, got {value!r}") from None
    backend = os.environ.get("JAXBWD_PALLAS_BACKEND", "").strip().lower()
    if backend not in ("", "auto", "none") + PALLAS_BACKENDS:
        raise ValueError(
            f"jaxbwd: JAXBWD_PALLAS_BACKEND must be one of auto, none, triton, mosaic or unset, got {backend!r}"
        )
    backend = backend if backend in PALLAS_BACKENDS else None
    if named and backend and named != backend:
        raise ValueError(f"jaxbwd: JAXBWD_IMPLEMENTATION={value} and JAXBWD_PALLAS_BACKEND={backend} "
                         "name different Pallas backends")
    return implementation, named or backend or "triton"


def _env_flag(name: str, default: bool) -> bool:
    raw = os.environ.get(name, "")
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    if value == "":
        return default
    raise ValueError(f"jaxbwd: {name} must be 1/true/yes/on, 0/false/no/off or unset, got {raw!r}")


@dataclasses.dataclass(frozen=True)
class _Settings:
    implementation: Optional[str]  # None: Pallas on GPU, XLA elsewhere
    interpret: bool
    pallas_backend: str = "triton"
    custom_partitioning: bool = True


_UNSET = object()
# The process-wide default (every thread sees it) and, on top, a per-context override
# set by ``use`` (seen only by code traced inside the ``with`` block, in that thread).
_default: Optional[_Settings] = None
_override: contextvars.ContextVar[Optional[_Settings]] = contextvars.ContextVar("jaxbwd_override", default=None)


def _process_default() -> _Settings:
    global _default
    if _default is None:
        implementation, backend = _env_settings()
        _default = _Settings(implementation, _env_flag("JAXBWD_INTERPRET", False), backend,
                             _env_flag("JAXBWD_CUSTOM_PARTITIONING", True))
    return _default


def _current() -> _Settings:
    s = _override.get()
    return s if s is not None else _process_default()


def named(implementation: Optional[str]) -> bool:
    """Whether ``implementation`` names one (``"pallas"``, ``"xla"``, ``"pallas:<backend>"``)
    rather than deferring to the settings (None or ``"auto"``): a bool. Where an input has no
    kernel, a named Pallas implementation is an error and the default falls back to XLA.
    The value is not validated (any other value counts as named; :func:`check_implementation`
    checks it); raises nothing."""
    return implementation is not None and implementation != "auto"


def check_implementation(implementation: Optional[str], where: str) -> None:
    """Checks an ``implementation`` value where it is given rather than where it is first used
    (the modules in :mod:`jaxbwd.nn` check theirs when built).

    Args:
      implementation: the value to check: None, ``"auto"``, ``"pallas"``, ``"xla"``,
        ``"pallas:triton"`` or ``"pallas:mosaic"`` (what an op, :func:`use` and
        :func:`set_default` take).
      where: what took it, for the message (``"nn.LayerNorm"`` -> ``jaxbwd.nn.LayerNorm: ...``).

    Raises:
      ValueError: a string that is not one of those values.
      TypeError: neither a string nor None.
    """
    _split(implementation, where)


def _check_backend(pallas_backend, where="config"):
    if pallas_backend not in PALLAS_BACKENDS:
        raise ValueError(f"jaxbwd.{where}: pallas_backend must be None, 'auto', 'triton' or 'mosaic', "
                         f"got {pallas_backend!r}")


def _check_flag(value, name, where):
    # a string such as "no" would read as True: only real booleans (numpy's too)
    if value is not _UNSET and not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"jaxbwd.{where}: {name} must be True or False, got {value!r}")


def _merged(cur: _Settings, implementation, interpret, pallas_backend=_UNSET, custom_partitioning=_UNSET,
            where="config") -> _Settings:
    _check_flag(interpret, "interpret", where)
    _check_flag(custom_partitioning, "custom_partitioning", where)
    named = None
    if implementation is not _UNSET:
        implementation, named = _split(implementation, where)
    if pallas_backend is not _UNSET:
        if pallas_backend is None or pallas_backend == "auto":  # as JAXBWD_PALLAS_BACKEND=auto
            pallas_backend = named or "triton"
        _check_backend(pallas_backend, where)
        if named and named != pallas_backend:
            raise ValueError(f"jaxbwd.{where}: implementation 'pallas:{named}' and pallas_backend "
                             f"{pallas_backend!r} name different Pallas backends")
    elif named:
        pallas_backend = named
    return _Settings(
        cur.implementation if implementation is _UNSET else implementation,
        cur.interpret if interpret is _UNSET else bool(interpret),
        cur.pallas_backend if pallas_backend is _UNSET else pallas_backend,
        cur.custom_partitioning if custom_partitioning is _UNSET else bool(custom_partitioning),
    )


def set_default(*, implementation: Any = _UNSET, interpret: Any = _UNSET, pallas_backend: Any = _UNSET,
                custom_partitioning: Any = _UNSET) -> None:
    """Sets the process-wide defaults (seen by every thread); omitted arguments keep their
    process-wide value. Inside a :func:`use` block the block's settings still apply until it
    exits; the new defaults hold outside it.

    Args:
      implementation: ``"pallas"``, ``"xla"``, or ``None``/``"auto"`` for Pallas on GPU and
        XLA elsewhere; ``"pallas:triton"``/``"pallas:mosaic"``: ``"pallas"`` with that
        ``pallas_backend``.
      interpret: run Pallas kernels in interpret mode (CPU).
      pallas_backend: ``"triton"`` (default; also ``None``/``"auto"``) or ``"mosaic"``: Mosaic
        GPU kernels for the ops and GPU generations in ``MOSAIC_KERNELS``, Triton for the rest
        (module docstring).
      custom_partitioning: under a mesh with Auto axes, hand each op to XLA's partitioner
        through ``jax.experimental.custom_partitioning`` (default True; environment
        ``JAXBWD_CUSTOM_PARTITIONING``). False runs the ops as whole-array code that XLA
        partitions like any other, gathering around opaque kernel calls: the setting for
        ``jax.export`` under such a mesh, which refuses custom_partitioning's Python
        callbacks.

    Raises:
      ValueError: ``implementation`` or ``pallas_backend`` is not one of those values, or the
        two name different Pallas backends.
      TypeError: ``implementation`` is neither a string nor None; ``interpret`` or
        ``custom_partitioning`` is not a bool.
    """
    global _default
    _default = _merged(_process_default(), implementation, interpret, pallas_backend, custom_partitioning,
                       "config.set_default")


@contextlib.contextmanager
def use(*, implementation: Any = _UNSET, interpret: Any = _UNSET, pallas_backend: Any = _UNSET,
        custom_partitioning: Any = _UNSET) -> Iterator[None]:
    """Context manager form of :func:`set_default`: overrides the settings inside the block
    (for this thread and context) and restores them on exit; omitted arguments are inherited.

    Only tracing that happens inside the ``with`` block sees the new settings.

    Args: as :func:`set_default`. Yields: None.

    Raises:
      ValueError: ``implementation`` is not ``None``, ``"auto"``, ``"pallas"``, ``"xla"``,
        ``"pallas:triton"`` or ``"pallas:mosaic"``; ``pallas_backend`` is not ``None``,
        ``"auto"``, ``"triton"`` or ``"mosaic"``; the two name different Pallas backends.
      TypeError: ``implementation`` is neither a string nor None; ``interpret`` or
        ``custom_partitioning`` is not a bool.
    """
    token = _override.set(_merged(_current(), implementation, interpret, pallas_backend, custom_partitioning,
                                  "config.use"))
    try:
        yield
    finally:
        _override.reset(token)


def interpret() -> bool:
    """Whether Pallas kernels run in interpret mode (set by code or ``JAXBWD_INTERPRET=1``):
    a bool. Raises ValueError for a malformed ``JAXBWD_*`` variable (read at the first call)."""
    return _current().interpret


def custom_partitioning() -> bool:
    """Whether ops under an Auto-axes mesh go through ``custom_partitioning`` (see
    :func:`set_default`): a bool. Raises ValueError for a malformed ``JAXBWD_*`` variable (read at the first call)."""
    return _current().custom_partitioning


def default_implementation() -> str:
    """The implementation that ``implementation=None`` resolves to right now: ``"pallas"``
    or ``"xla"``. Raises ValueError for a malformed ``JAXBWD_*`` variable (read at the first call)."""
    s = _current()
    if s.implementation is not None:
        return s.implementation
    return "pallas" if jax.default_backend() in ("gpu", "cuda", "rocm") else "xla"


def resolve(implementation: Optional[str], op: str) -> str:
    """Resolves an op's ``implementation`` argument to ``"pallas"`` or ``"xla"`` at trace time
    (``"pallas:triton"``/``"pallas:mosaic"`` resolve to ``"pallas"``, None and ``"auto"`` to
    the default).

    Args:
      implementation: the op's argument (None, ``"auto"``, ``"pallas"``, ``"xla"``,
        ``"pallas:triton"``, ``"pallas:mosaic"``).
      op: the op's name, for the message.

    Returns:
      ``"pallas"`` or ``"xla"``.

    Raises:
      ValueError: an unknown implementation name.
      TypeError: neither a string nor None.
    """
    implementation, _ = _split(implementation, op)
    return implementation if implementation is not None else default_implementation()


def pallas_backend() -> str:
    """The Pallas backend the settings ask for (``"triton"`` or ``"mosaic"``), before the
    per-op table is consulted (see :func:`resolve_pallas_backend`). Raises ValueError for a
    malformed ``JAXBWD_*`` variable (read at the first call)."""
    return _current().pallas_backend


def mosaic_supported(op: str, dtype, sm: int, last_dim: Optional[int] = None) -> bool:
    """Whether ``MOSAIC_KERNELS`` has a Mosaic GPU kernel for ``op`` on compute capability
    ``sm`` (major * 10 + minor) with inputs of ``dtype`` whose last dim is ``last_dim``.

    Args: op, an op name; dtype, a dtype or None (None: False); sm, an int; last_dim, an
    int or None (not checked). Returns: a bool. Raises: TypeError for a non-dtype ``dtype``
    where ``op`` has a Mosaic kernel for ``sm`` (elsewhere the answer is False without
    reading it); TypeError or ValueError for an ``sm`` that ``int()`` does not take.
    """
    entry = MOSAIC_KERNELS.get(op, {}).get(int(sm)) if MOSAIC_AVAILABLE else None
    if entry is None or dtype is None or jax.numpy.dtype(dtype).name not in entry["dtypes"]:
        return False
    return last_dim is None or last_dim <= entry.get("max_last_dim", last_dim)


def resolve_pallas_backend(implementation: Optional[str], op: str, dtype, sm: int,
                           last_dim: Optional[int] = None) -> str:
    """The Pallas backend an op's kernels use, at trace time: ``"triton"`` or ``"mosaic"``.

    ``implementation="pallas:<backend>"`` names it per call; otherwise the settings do. Mosaic
    runs only where ``MOSAIC_KERNELS`` lists ``op`` for generation ``sm`` and ``dtype``;
    elsewhere a settings-wide choice falls back to Triton.

    Args:
      implementation: the op's argument, as for :func:`resolve`.
      op: the op's name; dtype: its first input's dtype (None for an op without operands);
      sm: the GPU's compute capability, major * 10 + minor; last_dim: the first input's
        last dim (attention's head dim), or None.

    Returns:
      ``"triton"`` or ``"mosaic"``.

    Raises:
      ValueError: ``implementation="pallas:mosaic"`` for an op, generation, dtype or last dim
        without a Mosaic kernel, or on a jax without the Mosaic kernels (< 0.12); a malformed
        ``JAXBWD_*`` variable (read at the first call). ``implementation`` is not otherwise
        validated here (an unknown value reads as the settings'; :func:`resolve` checks it).
    """
    requested = _PER_CALL.get(implementation) if isinstance(implementation, str) else None
    backend = requested or pallas_backend()
    if backend == "mosaic" and not mosaic_supported(op, dtype, sm, last_dim):
        if requested:
            if not MOSAIC_AVAILABLE:
                raise ValueError(
                    f"jaxbwd.{op}: implementation='pallas:mosaic' needs jax >= 0.12 (the Mosaic GPU "
                    f"kernels use its Pallas API), got jax {jax.__version__} (use 'pallas' for the "
                    "Triton kernels)"
                )
            table = MOSAIC_KERNELS.get(op, {})
            if dtype is None:  # called without operands: an op whose work is XLA's by design
                raise ValueError(
                    f"jaxbwd.{op}: implementation='pallas:mosaic' has no Mosaic GPU kernel: this op has "
                    f"no Pallas kernels (its work is XLA's by design); Mosaic kernels exist for "
                    f"{sorted(MOSAIC_KERNELS)}"
                )
            if not table:
                raise ValueError(
                    f"jaxbwd.{op}: implementation='pallas:mosaic': {op} has no Mosaic GPU kernel (Mosaic "
                    f"kernels exist for {sorted(MOSAIC_KERNELS)}); use 'pallas' for its Triton kernels"
                )
            covers = "; ".join(
                f"sm_{k}: {'/'.join(v['dtypes'])} inputs"
                + (f", last dim <= {v['max_last_dim']}" if "max_last_dim" in v else "")
                for k, v in sorted(table.items()))
            too_wide = any(last_dim is not None and last_dim > v.get("max_last_dim", last_dim) for v in table.values())
            raise ValueError(
                f"jaxbwd.{op}: implementation='pallas:mosaic' has no Mosaic GPU kernel for "
                f"{jax.numpy.dtype(dtype).name} inputs with last dim {last_dim} on sm_{sm}; its Mosaic "
                f"kernels cover {covers}" + ("" if too_wide else " (use 'pallas' for the Triton kernels)")
            )
        return "triton"
    return backend
