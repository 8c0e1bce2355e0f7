"""The transient memory term of all-gather-KV / hybrid context parallelism (``cp_kv > 1``,
:mod:`lightning_hotspa.parallel.kv_gather`), bound to those kinds in :mod:`.cp_memory`.

Why its own term: beside what it saves (:mod:`.cp_memory`), the KV gather holds, per layer, transient
buffers the size of the WHOLE micro-batch's K/V. Checked against the real code path by ``hotspa memory``
(tests/unit/test_memory.py, BENCHMARKS.md).
"""

from __future__ import annotations

import math
from typing import Any

from ...layout import Layout

__all__ = ["in_flight_and_freed", "kv_gather_extra_bytes"]


def _local_kv_heads(m: Any, par: Layout) -> int:
    """kv heads one rank holds after the Ulysses exchange (which repeats them so ``u`` divides them)."""
    u = par.cp_ulysses
    heads = m.n_kv_heads // par.tp if m.n_kv_heads % par.tp == 0 else 1
    return heads * (u // math.gcd(heads, u)) // u


def kv_gather_extra_bytes(mm: Any, par: Layout, tokens: int, recomputed: float = 0.0) -> float:
    """Transient bytes the KV gather adds to the peak of a micro-batch of ``tokens``, beyond what is
    freed by then; ``recomputed``: bytes per token of the layer's attention tensors that its
    selective recomputation saves again (0 otherwise).

    Each layer's attention gathers K and V of the whole micro-batch (``tokens`` rows, the kv heads a
    rank holds after the Ulysses exchange). Its backward peaks at the reduce-scatter of dK / dV, after
    the per-chunk loop (one query chunk at a time recomputed and back-propagated through SDPA's own
    kernel; a chunk's dK / dV are freed before this point, and the loop's peak, re-gathered K/V + fp32
    sum + one chunk's grads, is lower): per gathered element the re-gathered K/V, the fp32 dK/dV sum,
    its fp32 row permutation and its working-dtype cast (``2 * wb + 8``), plus one more working-dtype
    buffer of the same size that the measurement shows (``3 * wb + 8`` in all: 14 B in bf16, the
    slope of the measured peak over the kv heads, tests/unit/test_memory.py). (The kernel's lower-right
    mask, materialized on CPU only, is ``t^2 / 2cp`` bytes and not counted: flash on CUDA holds none.)
    The layer's gradients in flight: dq, d out and the fp32 residual-stream gradient (1/tp of the
    tokens under sequence parallelism, as the norms). By then the loss head's transients and its
    per-token state, the final norm, this layer's ffn side (its norm and the SwiGLU tensors) and wo's
    saved input are freed: the term counts only where it exceeds them."""
    if tokens <= 0:
        return 0.0
    m, wb, t = mm.model, mm.param_bytes, float(tokens)
    gathered = (3.0 * wb + 8.0) * 2 * _local_kv_heads(m, par) * m.head_dim * t
    if mm.chunks.packed:  # one packed call: every chunk's key range copied (u x (2cp+1)/2cp of the rows) and
        # its gradient, plus the packing's full-size gradient (a count of the tensors, not measured: no GPU)
        copies = par.cp_ulysses * (2 * par.cp + 1) / (2 * par.cp)
        gathered += wb * (2.0 * copies + 1.0) * 2 * _local_kv_heads(m, par) * m.head_dim * t
    return max(0.0, gathered + (in_flight_and_freed(mm, par) + recomputed) * t)


def in_flight_and_freed(mm: Any, par: Layout) -> float:
    """Bytes per token of a layer's gradients in flight at its attention backward (dq, d out and the fp32
    residual-stream gradient: 1/tp of the tokens under sequence parallelism, as the norms), less what is
    freed by then (the loss head's transients and per-token state, the final norm, this layer's ffn side,
    wo's saved input): the KV gather's and the KV ring's transients count only beyond it."""
    m, wb = mm.model, mm.param_bytes
    h, a = m.hidden, mm.attn_width
    in_flight = (2.0 * wb * a + 4.0 * h) / (par.tp * par.cp)
    norm = mm.norm_bytes_per_token() / par.tp
    head_input = wb * h * (1.0 - 1.0 / par.tp)  # the head keeps its input gathered over tp
    freed = (norm + head_input + mm.head_state_bytes) / par.cp + mm.logits_bytes_per_token(par.tp, par.cp)
    freed += norm / par.cp + 2.0 * wb * m.ffn_hidden / (par.tp * par.cp)  # this layer's ffn side
    freed += wb * a / (par.tp * par.cp)  # wo's saved input
    return in_flight - freed
