"""The memory terms of all-gather-KV / hybrid context parallelism (``cp_kv > 1``,
:mod:`lightning_hotspa.parallel.kv_gather`) for :class:`~.memory_model.MemoryModel`.

Why its own terms: the KV gather saves different tensors than Ulysses or no cp (those the memory
model's ``attention_saved_bytes`` counts) and holds, per layer, transient buffers the size of the
WHOLE micro-batch's K/V. Checked against the real code path by ``hotspa memory``
(tests/test_memory.py, BENCHMARKS.md).
"""

from __future__ import annotations

import math
from typing import Any

from ..layout import Layout

__all__ = ["kv_gather_extra_bytes"]


def _local_kv_heads(m: Any, par: Layout) -> int:
    """kv heads one rank holds after the Ulysses exchange (which repeats them so ``u`` divides them)."""
    u = par.cp_ulysses
    heads = m.n_kv_heads // par.tp if m.n_kv_heads % par.tp == 0 else 1
    return heads * (u // math.gcd(heads, u)) // u


def kv_gather_extra_bytes(mm: Any, par: Layout, tokens: int) -> float:
    """Transient bytes the KV gather adds to the peak of a micro-batch of ``tokens``, beyond what is
    freed by then.

    Each layer's attention gathers K and V of the whole micro-batch (``tokens`` rows, the kv heads a
    rank holds after the Ulysses exchange); its backward holds the re-gathered K/V (working dtype),
    an fp32 dK/dV sum, its fp32 row permutation and the cast for the reduce-scatter: ``2 * wb + 8``
    bytes per gathered element; one query chunk at a time is recomputed and back-propagated through
    SDPA's own kernel, whose dK / dV of the chunk's keys (at most the whole micro-batch's) add
    ``2 * wb`` per gathered element (the kernel's lower-right mask, materialized on CPU only, is
    ``t^2 / 2cp`` bytes and not counted: flash on CUDA holds none); the
    layer's gradients in flight (dq, d out, the fp32 residual-stream gradient: 1/tp of the tokens under
    sequence parallelism, as the norms). That happens inside a
    layer's backward, after the loss head's transients and the layer's SwiGLU tensors are freed: it
    counts only where it exceeds them."""
    if par.cp_kv == 1 or tokens <= 0:
        return 0.0
    m, wb, t = mm.model, mm.param_bytes, float(tokens)
    h, a = m.hidden, mm.attn_width
    gathered = (2.0 * wb + 8.0) * 2 * _local_kv_heads(m, par) * m.head_dim * t
    chunk_grads = 2.0 * wb * 2 * _local_kv_heads(m, par) * m.head_dim * t
    # sequence parallel: the residual-stream gradient and the norms hold this rank's 1/tp of the tokens
    in_flight = (2.0 * wb * a + 4.0 * h) / (par.tp * par.cp) * t
    transient = gathered + chunk_grads + in_flight
    norm = mm.norm_bytes_per_token() / par.tp
    head_input = wb * h * (1.0 - 1.0 / par.tp)  # the head keeps its input gathered over tp
    freed = (norm + head_input) / par.cp + mm.logits_bytes_per_token(par.tp, par.cp)  # the loss head's
    freed += norm / par.cp + 2.0 * wb * m.ffn_hidden / (par.tp * par.cp)  # this layer's ffn side
    return max(0.0, transient - freed * t)
