"""A seam for host-side reads of small metadata tensors (document bounds, chunk lengths).

Code that turns a tensor into Python numbers (``.tolist()``, ``.item()``) wraps the read in
:func:`host_reads`. Normally that does nothing; the memory estimator (``hotspa memory``), which runs
the model under ``FakeTensorMode``, installs a context that lets such reads see the real metadata
tensors it built outside the mode (fake tensors hold no values).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager

__all__ = ["host_reads", "set_host_reads"]

_factory: Callable[[], AbstractContextManager] = contextlib.nullcontext


def host_reads() -> AbstractContextManager:
    """Context around a host-side read of a metadata tensor."""
    return _factory()


def set_host_reads(factory: Callable[[], AbstractContextManager] | None) -> Callable[[], AbstractContextManager]:
    """Installs ``factory`` (None: the default no-op); returns the previous one."""
    global _factory
    previous, _factory = _factory, factory or contextlib.nullcontext
    return previous
