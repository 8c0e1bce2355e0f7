"""The memory terms of all-gather-KV / hybrid context parallelism (``cp_kv > 1``,
:mod:`lightning_hotspa.parallel.kv_gather`) for :class:`~.memory_model.MemoryModel`.

Why its own terms: the KV gather saves different tensors than Ulysses or no cp (those the memory
model's ``attention_saved_bytes`` counts) and holds, per layer, transient buffers the size of the WHOLE micro-batch's K/V. Checked
against the real code path by ``hotspa memory`` (tests/test_memory.py, BENCHMARKS.md).
"""

from __future__ import annotations

import math
from typing import Any

from .parallelism import Parallelism

__all__ = ["KV_BLOCK_ELEMENTS", "kv_gather_extra_bytes"]

#: parallel.kv_gather.BLOCK_ELEMENTS (the planner does not import parallel): most (query rows x keys x
#: heads) entries one SDPA call of the KV gather holds; tests/test_memory.py checks they agree
KV_BLOCK_ELEMENTS = 2**24


def _local_kv_heads(m: Any, par: Parallelism) -> int:
    """kv heads one rank holds after the Ulysses exchange (which repeats them so ``u`` divides them)."""
    u = par.cp_ulysses
    heads = m.n_kv_heads // par.tp if m.n_kv_heads % par.tp == 0 else 1
    return heads * (u // math.gcd(heads, u)) // u


def kv_gather_extra_bytes(mm: Any, par: Parallelism, tokens: int) -> float:
    """Transient bytes the KV gather adds to the peak of a micro-batch of ``tokens``, beyond what is
    freed by then.

    Each layer's attention gathers K and V of the whole micro-batch (``tokens`` rows, the kv heads a
    rank holds after the Ulysses exchange); its backward holds the re-gathered K/V (working dtype),
    an fp32 dK/dV sum, its fp32 row permutation and the cast for the reduce-scatter: ``2 * wb + 8``
    bytes per gathered element; per query block SDPA (3-D inputs: the math kernel) holds fp32 scores,
    probabilities and their gradient for at most ``KV_BLOCK_ELEMENTS`` entries (12 B each); the
    layer's gradients in flight (dq, d out, the fp32 residual-stream gradient). That happens inside a
    layer's backward, after the loss head's transients and the layer's SwiGLU tensors are freed: it
    counts only where it exceeds them."""
    if par.cp_kv == 1 or tokens <= 0:
        return 0.0
    m, wb, t = mm.model, mm.param_bytes, float(tokens)
    h, a = m.hidden, mm.attn_width
    q_heads = m.n_heads / (par.tp * par.cp_ulysses)
    gathered = (2.0 * wb + 8.0) * 2 * _local_kv_heads(m, par) * m.head_dim * t
    largest_block = max(min(float(KV_BLOCK_ELEMENTS), q_heads * t * t / (2 * par.cp)), q_heads * t)  # >= 1 row
    in_flight = (2.0 * wb * a / par.tp + 4.0 * h) / par.cp * t
    transient = gathered + 12.0 * largest_block + in_flight
    norm = mm.norm_bytes_per_token()
    freed = norm / par.cp + mm.logits_bytes_per_token(par.tp, par.cp)  # the loss head's transients
    freed += norm / par.cp + 2.0 * wb * m.ffn_hidden / (par.tp * par.cp)  # this layer's ffn side
    return max(0.0, transient - freed * t)
