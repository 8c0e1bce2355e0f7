"""The transient memory term of the KV ring / hybrid context parallelism (``cp_kv > 1``,
:mod:`lightning_hotspa.parallel.kv_ring`), bound to those kinds in :mod:`.cp_memory`.

Why its own term: beside what it saves (:mod:`.cp_memory`), the ring's backward holds, per layer, an
fp32 dq and the K/V and dK/dV slices in flight around the ring. Checked against the real code path by
``hotspa memory`` (tests/unit/test_memory.py, BENCHMARKS.md).
"""

from __future__ import annotations

import math
from typing import Any

from ...layout import Layout

__all__ = ["kv_ring_extra_bytes"]


def _local_kv_heads(m: Any, par: Layout) -> int:
    """kv heads one rank holds after the Ulysses exchange (which repeats them so ``u`` divides them)."""
    u = par.cp_ulysses
    heads = m.n_kv_heads // par.tp if m.n_kv_heads % par.tp == 0 else 1
    return heads * (u // math.gcd(heads, u)) // u


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
    h, a = m.hidden, mm.attn_width
    local_kv = 2 * _local_kv_heads(m, par) * m.head_dim * par.cp_ulysses / par.cp  # per token of the row
    ring = (8.0 + 4.0 * wb) * local_kv * t + 4.0 * a / (par.tp * par.cp) * t
    # sequence parallel: the residual-stream gradient and the norms hold this rank's 1/tp of the tokens
    in_flight = (2.0 * wb * a + 4.0 * h) / (par.tp * par.cp) * t
    transient = ring + in_flight + recomputed * t
    norm = mm.norm_bytes_per_token() / par.tp
    head_input = wb * h * (1.0 - 1.0 / par.tp)  # the head keeps its input gathered over tp
    freed = (norm + head_input + mm.head_state_bytes) / par.cp + mm.logits_bytes_per_token(par.tp, par.cp)
    freed += norm / par.cp + 2.0 * wb * m.ffn_hidden / (par.tp * par.cp)  # this layer's ffn side
    freed += wb * a / (par.tp * par.cp)  # wo's saved input
    return max(0.0, transient - freed * t)
