"""Host-side facts about tensors that live on a device, known where the batch was built.

Why: reading a device tensor's values on the host (``cu_seqlens.tolist()``, a token-id min/max) makes
the host wait for the GPU stream, once per layer and micro-batch if the model re-derives them. The
data side already knows them (it built the tensors on the host), so :class:`~lightning_hotspa.plan.MicroBatch`
records them here when it is built and carries them to the copies its ``.to(device)`` makes; the
hot path (attention, the Ulysses / all-gather-KV row orders, the token-id checks) asks here first
and reads the tensor only when nobody told (a tensor a user built by hand).

A fact is keyed by the tensor object (a weak reference and its in-place version counter), so it
dies with the tensor and a tensor changed in place is read again.
"""

from __future__ import annotations

import weakref
from typing import Any

from torch import Tensor

__all__ = ["forget_all", "recall", "remember"]

_FACTS: dict[int, tuple[weakref.ref, int, dict[str, Any]]] = {}


def _version(t: Tensor) -> int | None:
    """The in-place version counter; None for inference tensors (no facts kept for them)."""
    try:
        return t._version
    except RuntimeError:
        return None


def _drop(key: int) -> None:
    hit = _FACTS.get(key)
    if hit is not None and hit[0]() is None:  # not a newer tensor that reuses the id
        del _FACTS[key]


def remember(t: Tensor, name: str, value: Any) -> None:
    """Records ``name = value`` about ``t`` (until ``t`` dies or changes in place).

    Args:
        t: the tensor (any device).
        name: what the fact is (``"bounds"``, ``"id_range"``).
        value: a host-side value (ints, tuples).
    """
    version = _version(t)
    if version is None:
        return
    key = id(t)
    hit = _FACTS.get(key)
    if hit is None or hit[0]() is not t or hit[1] != version:
        hit = (weakref.ref(t, lambda _, key=key: _drop(key)), version, {})
        _FACTS[key] = hit
    hit[2][name] = value


def recall(t: Tensor, name: str) -> Any | None:
    """The value recorded about ``t`` under ``name``, or None (unknown, or ``t`` changed since).

    Args:
        t: the tensor.
        name: the fact's name.
    """
    hit = _FACTS.get(id(t))
    if hit is None or hit[0]() is not t or hit[1] != _version(t):
        return None
    return hit[2].get(name)


def forget_all() -> None:
    """Drops every fact (tests)."""
    _FACTS.clear()
