"""Installs Ulysses context parallelism on every attention core of a model, once.

Why around ``core_attention`` only: everything else in a transformer is token-wise, so cp ranks run
it on their own tokens untouched; attention is the one op that mixes tokens, and the model exposes
its core as a swappable callable ``(q, k, v, cu_seqlens, max_seqlen) -> out``. The wrapper reads the
active cp group at call time (:mod:`.ulysses`), so a layout switch re-wraps nothing.
"""

from __future__ import annotations

from torch import nn

from ..layout import LayoutError
from .core_attention import attention_modules, ensure_parallel_attention
from .state import ParallelState

__all__ = ["install_context_parallel"]


def install_context_parallel(module: nn.Module, state: ParallelState) -> int:
    """Enables cp on every module with a ``core_attention``; returns how many were enabled.

    A model without one is refused: its token mixing would be invisible to cp and silently wrong.
    """
    found = attention_modules(module)
    if not found:
        raise LayoutError(f"context parallel needs the attention core exposed as a callable "
                          f"`core_attention(q, k, v, cu_seqlens, max_seqlen)` attribute; "
                          f"{type(module).__name__} has no such submodule")
    for name, owner in found:
        ensure_parallel_attention(owner, name or type(owner).__name__, state).context_parallel = True
    return len(found)
