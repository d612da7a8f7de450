"""Implementation choice and Pallas interpret mode.

Every op takes ``implementation=None | "pallas" | "xla"``. ``None`` defers to the
global default, which is ``JAXBWD_IMPLEMENTATION`` from the environment, or, when
unset, "pallas" on GPU and "xla" elsewhere. Interpret mode (Pallas kernels run on
CPU through ``pallas_call(..., interpret=True)``) is off unless ``JAXBWD_INTERPRET=1``
or set from code. The choice is read once, at trace time: a jitted function keeps
what it was traced with.

Example::

    with jaxbwd.config.use(implementation="pallas", interpret=True):
        loss, grads = jax.value_and_grad(loss_fn)(params)
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
from typing import Any, Iterator, Optional

import jax

IMPLEMENTATIONS = ("pallas", "xla")


def _env_implementation() -> Optional[str]:
    value = os.environ.get("JAXBWD_IMPLEMENTATION", "").strip().lower()
    if value in ("", "auto", "none"):
        return None
    if value not in IMPLEMENTATIONS:
        raise ValueError(
            f"jaxbwd: JAXBWD_IMPLEMENTATION must be one of {IMPLEMENTATIONS} or unset, got {value!r}"
        )
    return value


def _env_interpret() -> bool:
    return os.environ.get("JAXBWD_INTERPRET", "").strip().lower() in ("1", "true", "yes", "on")


@dataclasses.dataclass(frozen=True)
class _Settings:
    implementation: Optional[str]  # None: Pallas on GPU, XLA elsewhere
    interpret: bool


_UNSET = object()
# The process-wide default (every thread sees it) and, on top, a per-context override
# set by ``use`` (seen only by code traced inside the ``with`` block, in that thread).
_default: Optional[_Settings] = None
_override: contextvars.ContextVar[Optional[_Settings]] = contextvars.ContextVar("jaxbwd_override", default=None)


def _current() -> _Settings:
    global _default
    s = _override.get()
    if s is not None:
        return s
    if _default is None:
        _default = _Settings(_env_implementation(), _env_interpret())
    return _default


def _check_implementation(implementation, where="implementation"):
    if implementation is not None and implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"jaxbwd: {where} must be None, 'pallas' or 'xla', got {implementation!r}"
        )


def _merged(implementation, interpret) -> _Settings:
    cur = _current()
    if implementation is not _UNSET:
        if implementation == "auto":
            implementation = None
        _check_implementation(implementation)
    return _Settings(
        cur.implementation if implementation is _UNSET else implementation,
        cur.interpret if interpret is _UNSET else bool(interpret),
    )


def set_default(*, implementation: Any = _UNSET, interpret: Any = _UNSET) -> None:
    """Sets the process-wide defaults (seen by every thread); omitted arguments keep their value.

    Args:
      implementation: ``"pallas"``, ``"xla"``, or ``None``/``"auto"`` for Pallas on GPU and
        XLA elsewhere.
      interpret: run Pallas kernels in interpret mode (CPU).

    Raises:
      ValueError: ``implementation`` is not one of those values.
    """
    global _default
    _default = _merged(implementation, interpret)


@contextlib.contextmanager
def use(*, implementation: Any = _UNSET, interpret: Any = _UNSET) -> Iterator[None]:
    """Context manager form of :func:`set_default`: overrides the settings inside the block
    (for this thread and context) and restores them on exit; omitted arguments are inherited.

    Only tracing that happens inside the ``with`` block sees the new settings.

    Raises:
      ValueError: ``implementation`` is not ``None``, ``"auto"``, ``"pallas"`` or ``"xla"``.
    """
    token = _override.set(_merged(implementation, interpret))
    try:
        yield
    finally:
        _override.reset(token)


def interpret() -> bool:
    """Whether Pallas kernels run in interpret mode (set by code or ``JAXBWD_INTERPRET=1``)."""
    return _current().interpret


def default_implementation() -> str:
    """The implementation that ``implementation=None`` resolves to right now."""
    s = _current()
    if s.implementation is not None:
        return s.implementation
    return "pallas" if jax.default_backend() in ("gpu", "cuda", "rocm") else "xla"


def resolve(implementation: Optional[str], op: str) -> str:
    """Resolves an op's ``implementation`` argument to ``"pallas"`` or ``"xla"`` at trace time.

    Raises:
      ValueError: an unknown implementation name.
    """
    _check_implementation(implementation, f"{op}: implementation")
    return implementation if implementation is not None else default_implementation()
