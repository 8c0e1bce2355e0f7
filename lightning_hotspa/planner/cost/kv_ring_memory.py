"""The transient memory term of the KV ring / hybrid context parallelism (``cp_kv > 1``,
:mod:`lightning_hotspa.parallel.kv_ring`), bound to those kinds in :mod:`.cp_memory`.

Why its own term: beside what it saves (:mod:`.cp_memory`), the ring's backward holds, per layer, an
fp32 dq and the K/V and dK/dV slices in flight around the ring. Checked against the real code path by
``hotspa memory`` (tests/unit/test_memory.py, BENCHMARKS.md).
"""

from __future__ import annotations

from typing import Any

from ...layout import Layout
from .kv_gather_memory import _local_kv_heads, in_flight_and_freed

__all__ = ["kv_ring_extra_bytes"]


def kv_ring_extra_bytes(mm: Any, par: Layout, tokens: int, recomputed: float = 0.0) -> float:
    """Transient bytes the KV ring adds to the peak of a micro-batch of ``tokens``, beyond what is freed
    by then; ``recomputed``: bytes per token of the layer's attention tensors that its selective
    recomputation saves again (0 otherwise).

    A layer's ring backward holds at once, per local row (``u * tokens / cp`` rows after the Ulysses
    exchange, the kv heads a rank then holds): the fp32 dq sum (q's elements), the step's fp32 dK/dV
    partial sum, and four K/V-sized slices in the K/V dtype (the K/V in hand and the next in flight, the
    dK/dV partial sent on and the one received): ``(8 + 4 * wb)`` bytes per local K/V element. (The
    forward holds less: two K/V slices and the fp32 output and log-sum-exp sums.) The layer's gradients
    in flight: dq, d out and the fp32 residual-stream gradient (1/tp of the tokens under sequence
    parallelism, as the norms). By then the loss head's transients and its per-token state, the final
    norm, this layer's ffn side (its norm and the SwiGLU tensors) and wo's saved input are freed: the
    term counts only where it exceeds them (for the models measured it does not: 0, and the peak is the
    saved tensors', tests/unit/test_memory.py)."""
    if tokens <= 0:
        return 0.0
    m, wb, t = mm.model, mm.param_bytes, float(tokens)
    local_kv = 2 * _local_kv_heads(m, par) * m.head_dim * par.cp_ulysses / par.cp  # per token of the row
    ring = (8.0 + 4.0 * wb) * local_kv * t + 4.0 * mm.attn_width / (par.tp * par.cp) * t
    return max(0.0, ring + (in_flight_and_freed(mm, par) + recomputed) * t)
