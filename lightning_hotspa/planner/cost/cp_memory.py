"""The memory terms of each context-parallel kind (:mod:`lightning_hotspa.cp_kinds`), bound by its name
for :class:`~.memory_model.MemoryModel`.

Why here and not in the kind's record: the terms read the attention-kernel records (what a kernel keeps
for backward, ``models/attention_kernels.py``, floor 1) and the memory model's own per-token terms, so
they sit on the planner's floor; :data:`MEMORY_TERMS` names every registered kind once, checked at
import. Checked against the real code path by ``hotspa memory`` (tests/unit/test_memory.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ...cp_kinds import check_bound
from ...layout import Layout
from .kv_gather_memory import _local_kv_heads, kv_gather_extra_bytes
from .kv_ring_memory import kv_ring_extra_bytes

__all__ = ["CpMemoryTerms", "MEMORY_TERMS"]


@dataclass(frozen=True)
class CpMemoryTerms:
    """What one cp kind adds to a rank's memory.

    Args:
        saved: ``(memory model, par) -> bytes`` per token per layer one rank's attention saves for
            backward under ``par`` (cp > 1; without cp the memory model's own term).
        extra: ``(memory model, par, tokens, recomputed) -> bytes`` of per-layer transients beyond
            what is freed by then (:func:`~.kv_ring_memory.kv_ring_extra_bytes`); None: it has none,
            so a token capacity is the closed-form bound (with one, it is bisected).
    """

    saved: Callable[[Any, Layout], float]
    extra: Callable[[Any, Layout, int, float], float] | None = None


def _ulysses_saved(mm: Any, par: Layout) -> float:
    """q, k and v as the kernel sees them, the output and after its all-to-all back the output again
    (a new tensor, wo's input), the kv heads each rank holds after the exchange for the whole row,
    the kernel's own state (its log-sum-exp)."""
    m, wb, a, tp, cp = mm.model, mm.param_bytes, mm.attn_width, par.tp, par.cp
    state = mm.attention_state_bytes() / (tp * cp)
    return wb * (3 * a / (tp * cp) + 2 * _local_kv_heads(m, par) * m.head_dim) + state


def _kv_ring_saved(mm: Any, par: Layout) -> float:
    """q, its LOCAL k / v and wo's input (its own output, or in the hybrid the Ulysses output, which
    replaces it), the merged log-sum-exp when the block kernel keeps it (``chunks.saves_lse``; both
    do: the ring's backward runs from it), and in the hybrid the merged output before the exchange back
    (``chunks.saves_output``)."""
    m, wb, a, tp, cp = mm.model, mm.param_bytes, mm.attn_width, par.tp, par.cp
    kv_local = _local_kv_heads(m, par) * par.cp_ulysses * tp * m.head_dim  # full-width units
    kept = (4.0 * m.n_heads if mm.chunks.saves_lse else 0.0) \
        + (wb * a if mm.chunks.saves_output and par.cp_ulysses > 1 else 0.0)
    return (wb * (2 * a + 2 * kv_local) + kept) / (tp * cp)


def _kv_extra(mm: Any, par: Layout, tokens: int, recomputed: float = 0.0) -> float:
    """The KV ring's transient, or the KV gather's where the chunk kernel is a packed one (it gathers)."""
    extra = kv_gather_extra_bytes if mm.chunks.packed else kv_ring_extra_bytes
    return extra(mm, par, tokens, recomputed)


#: every registered cp kind's memory terms by its name
MEMORY_TERMS: dict[str, CpMemoryTerms] = {
    "ulysses": CpMemoryTerms(_ulysses_saved),
    "kv": CpMemoryTerms(_kv_ring_saved, _kv_extra),
    "hybrid": CpMemoryTerms(_kv_ring_saved, _kv_extra),
}

check_bound(MEMORY_TERMS, "planner/cost/cp_memory.py's MEMORY_TERMS")
