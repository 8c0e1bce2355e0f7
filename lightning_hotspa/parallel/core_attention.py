"""The one wrapper around a module's ``core_attention`` that tensor and context parallelism share.

Why one object and not two nested wrappers: the two installers run in either order, but the
steps must run in a fixed one — first pick the kv heads this tp rank's q heads need (replicated_partial
kv projections), then the layout's cp kind's attention over cp (:data:`CP_ATTENTION`, one call per
kind of the registry :mod:`lightning_hotspa.cp_kinds`). Each installer switches its part on; the
wrapper reads the active layout from :class:`ParallelState` at call time, so a layout switch re-wraps
nothing.

Global head counts do not depend on the layout (local heads x tp), so the wrapper records them on
its first call and :meth:`validate` rejects a later layout that cannot split them, before any
collective runs.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..cp_kinds import CP_KINDS, check_bound
from ..layout import LayoutError
from ..mesh import LayoutGroups
from ..models.attention_kernels import chunk_kernel_for
from ..op_handles import handle_for
from .cp_attention_op import cp_attention_op
from .kv_gather import kv_gather_attention
from .kv_ring import kv_ring_attention
from .state import ParallelState
from .ulysses import ulysses_attention

__all__ = ["CP_ATTENTION", "ParallelCoreAttention", "attention_modules", "ensure_parallel_attention",
           "kv_head_range", "check_attention"]


def kv_head_range(q_heads: int, kv_heads: int, tp: int, tp_rank: int) -> tuple[int, int]:
    """Global kv heads [start, stop) that tp rank ``tp_rank``'s contiguous q heads attend with.

    ``q_heads`` and ``kv_heads`` are GLOBAL counts; q head i uses kv head ``i // (q_heads // kv_heads)``.
    """
    if q_heads % tp:
        raise LayoutError(f"tp={tp} does not divide the {q_heads} query heads")
    if q_heads % kv_heads:
        raise LayoutError(f"{kv_heads} kv heads do not divide the {q_heads} query heads")
    local, group = q_heads // tp, q_heads // kv_heads
    if local % group and group % local:
        raise LayoutError(f"tp={tp}: each rank's {local} query heads straddle groups of {group} "
                          f"query heads per kv head unevenly")
    start = tp_rank * local // group
    stop = -(-(tp_rank + 1) * local // group)
    return start, stop


def sliding_window(core: object) -> int | None:
    """The sliding window bound into a core attention (``models.attention.with_sliding_window``), or None."""
    keywords = getattr(core, "keywords", None)
    return keywords.get("window") if isinstance(keywords, dict) else None


class ParallelCoreAttention:
    """Callable with the core-attention signature ``(q, k, v, cu_seqlens, max_seqlen) -> out``."""

    def __init__(self, inner: object, state: ParallelState, owner: str) -> None:
        self.inner = inner
        self.state = state
        self.owner = owner  # module name, for error messages
        self.select_kv = False  # set by tensor parallel: k / v hold ALL kv heads (replicated_partial)
        self.context_parallel = False  # set by context parallel
        self.heads: tuple[int, int] | None = None  # global (q, kv) heads, seen on the first call
        self.handle = handle_for(self)  # how a compiled block's cp op finds this wrapper (weakly held)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int) -> Tensor:
        groups = self.state.groups
        if groups is None:
            return self.inner(q, k, v, cu_seqlens, max_seqlen)
        tp = groups.tp.size
        self._record_heads(q.shape[1] * tp, k.shape[1] * (1 if self.select_kv else tp))
        self.validate(groups)
        if self.select_kv and tp > 1:
            start, stop = kv_head_range(*self.heads, tp, groups.tp.index)
            k, v = k[:, start:stop], v[:, start:stop]
        if self.context_parallel and groups.cp.size > 1:
            if torch.compiler.is_compiling():  # one opaque op: host metadata and P2P stay out of the graph
                return cp_attention_op(self, q, k, v, cu_seqlens, max_seqlen)
            return self.run_context_parallel(q, k, v, cu_seqlens, max_seqlen)
        return self.inner(q, k, v, cu_seqlens, max_seqlen)

    def run_context_parallel(self, q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int) -> Tensor:
        """The active layout's cp kind's attention around the inner attention (eager; a compiled block's
        ``hotspa::cp_attention`` op runs it too).

        Args:
            q, k, v: the local rows, the kv heads this tp rank needs already selected.
            cu_seqlens, max_seqlen: this rank's local document boundaries and longest document.
        """
        groups = self.state.groups
        return CP_ATTENTION[groups.layout.cp_kind](self, q, k, v, cu_seqlens, max_seqlen, groups)

    def _record_heads(self, q_heads: int, kv_heads: int) -> None:
        if self.heads is None:
            self.heads = (q_heads, kv_heads)
        elif self.heads != (q_heads, kv_heads):
            raise LayoutError(f"{self.owner}: attention saw {q_heads} query / {kv_heads} kv heads, earlier "
                              f"{self.heads[0]} / {self.heads[1]}; are the projections sharded as planned?")

    def validate(self, groups: LayoutGroups) -> None:
        """Raises if ``groups``' layout cannot split the heads (a no-op before the first call)."""
        if self.heads is None:
            return
        q_heads, kv_heads = self.heads
        tp, cp, layout = groups.tp.size, groups.cp.size, groups.layout
        if q_heads % tp:
            raise LayoutError(f"layout {layout}: tp={tp} does not divide the {q_heads} query heads of {self.owner}")
        if self.select_kv:
            try:
                kv_head_range(q_heads, kv_heads, tp, 0)
            except LayoutError as err:
                raise LayoutError(f"layout {layout}, {self.owner}: {err}") from None
        elif kv_heads % tp:
            raise LayoutError(f"layout {layout}: tp={tp} does not divide the {kv_heads} kv heads of "
                              f"{self.owner}; give its kv projections the role 'replicated_partial'")
        kind = CP_KINDS[layout.cp_kind]
        scattered = layout.cp_ulysses  # Ulysses' share of cp scatters heads; the KV ring splits none
        if self.context_parallel and kind.scatters_heads and (q_heads // tp) % scattered:
            part = f"the Ulysses part of cp ({scattered} = cp / cp_kv)" if kind.gathers_kv else f"cp={cp}"
            hint = "" if kind.gathers_kv else "; the KV kind ('cp..:kv') does not split heads"
            raise LayoutError(f"layout {layout}: {part} does not divide the {q_heads // tp} query heads each "
                              f"tp rank of {self.owner} holds ({q_heads} heads / tp={tp}); Ulysses scatters "
                              f"heads{hint}")


def _ulysses(wrapper: ParallelCoreAttention, q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor,
             max_seqlen: int, groups: LayoutGroups) -> Tensor:
    """Ulysses over the whole cp group around the wrapper's inner attention."""
    return ulysses_attention(wrapper.inner, q, k, v, cu_seqlens, max_seqlen, groups.cp,
                             wrapper.state.micro_batch, wrapper.owner)


def _kv_ring(wrapper: ParallelCoreAttention, q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor,
             max_seqlen: int, groups: LayoutGroups) -> Tensor:
    """The KV ring (under Ulysses in the hybrid): causal blocks in the chunk kernel the attention-kernel
    registry sets beside the inner backend; beside a Hopper-class backend whose chunk kernel is a packed
    one (every chunk in one varlen call over gathered keys), the KV gather instead."""
    window = sliding_window(wrapper.inner)
    if chunk_kernel_for(wrapper.inner, q, window).packed:
        return kv_gather_attention(q, k, v, cu_seqlens, groups, wrapper.state.micro_batch, wrapper.owner,
                                   window=window, core=wrapper.inner)
    return kv_ring_attention(q, k, v, cu_seqlens, groups, wrapper.state.micro_batch, wrapper.owner,
                             window=sliding_window(wrapper.inner), core=wrapper.inner)


#: each registered cp kind's attention (``lightning_hotspa.cp_kinds``), by its name: ``(wrapper, q, k,
#: v, cu_seqlens, max_seqlen, groups) -> out``
CP_ATTENTION = {"ulysses": _ulysses, "kv": _kv_ring, "hybrid": _kv_ring}

check_bound(CP_ATTENTION, "parallel/core_attention.py's CP_ATTENTION")


def ensure_parallel_attention(module: nn.Module, name: str, state: ParallelState) -> ParallelCoreAttention:
    """The module's wrapper, created on first use (both installers share it)."""
    current = module.core_attention
    if isinstance(current, ParallelCoreAttention):
        if current.state is not state:
            raise LayoutError(f"{name}.core_attention is already wrapped for another ParallelModel")
        return current
    if not callable(current):
        raise LayoutError(f"{name}.core_attention is not callable: {current!r}")
    wrapper = ParallelCoreAttention(current, state, name)
    module.core_attention = wrapper
    module._hotspa_attention = wrapper  # remembered, so a later backend swap can be adopted
    return wrapper


def check_attention(root: nn.Module, groups: LayoutGroups) -> None:
    """Before a layout becomes active: re-inserts each wrapper whose ``core_attention`` was replaced
    after install (e.g. by ``set_attention_backend``; the new callable becomes its inner attention),
    and rejects a layout that cannot split the heads seen so far."""
    for _, module in root.named_modules():
        wrapper = module.__dict__.get("_hotspa_attention")
        if wrapper is None:
            continue
        if module.core_attention is not wrapper:
            wrapper.inner = module.core_attention
            module.core_attention = wrapper
        wrapper.validate(groups)


def attention_modules(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """Modules exposing a callable ``core_attention`` (the swappable attention core)."""
    return [(n, m) for n, m in root.named_modules() if callable(getattr(m, "core_attention", None))]
