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
from typing import Iterator, Optional

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
    implementation: Optional[str]
    interpret: bool


_settings: contextvars.ContextVar[Optional[_Settings]] = contextvars.ContextVar(
    "jaxbwd_settings", default=None
)


def _current() -> _Settings:
    s = _settings.get()
    if s is None:
        s = _Settings(_env_implementation(), _env_interpret())
        _settings.set(s)
    return s


def _check_implementation(implementation, where="implementation"):
    if implementation is not None and implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"jaxbwd: {where} must be None, 'pallas' or 'xla', got {implementation!r}"
        )


def set_default(*, implementation: Optional[str] = None, interpret: Optional[bool] = None) -> None:
    """Sets the process-wide defaults.

    Args:
      implementation: ``None`` (Pallas on GPU, XLA elsewhere), ``"pallas"`` or ``"xla"``.
      interpret: run Pallas kernels in interpret mode (CPU); ``None`` leaves it unchanged.

    Raises:
      ValueError: ``implementation`` is not one of the three values.
    """
    _check_implementation(implementation)
    cur = _current()
    _settings.set(_Settings(implementation, cur.interpret if interpret is None else bool(interpret)))


@contextlib.contextmanager
def use(*, implementation: Optional[str] = None, interpret: Optional[bool] = None) -> Iterator[None]:
    """Context manager form of :func:`set_default`; restores the previous settings on exit.

    Only tracing that happens inside the ``with`` block sees the new settings.

    Raises:
      ValueError: ``implementation`` is not ``None``, ``"pallas"`` or ``"xla"``.
    """
    _check_implementation(implementation)
    cur = _current()
    token = _settings.set(
        _Settings(
            implementation if implementation is not None else cur.implementation,
            cur.interpret if interpret is None else bool(interpret),
        )
    )
    try:
        yield
    finally:
        _settings.reset(token)


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
