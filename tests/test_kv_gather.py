"""All-gather-KV geometry and its bottom-right causal blocks, single process (the 4-rank equivalence
is in test_parallel.py and test_strategy.py)."""

import torch
import torch.nn.functional as F

from lightning_hotspa.parallel import kv_gather
from lightning_hotspa.plan import pack_micro_batch


def _cu(lengths, cp, rank):
    docs = [torch.zeros(n, dtype=torch.long) for n in lengths]
    return pack_micro_batch(docs, cp_size=cp, cp_rank=rank).cu_seqlens


def test_geometry_covers_every_position_once_and_blocks_stay_bounded(monkeypatch):
    monkeypatch.setattr(kv_gather, "BLOCK_ELEMENTS", 300)
    lengths, cp, ulysses, kv, heads = [45, 7, 130, 19], 4, 2, 2, 2
    cu = _cu(lengths, cp, 0)  # every cp rank has the same local lengths
    for kv_index in range(kv):
        g = kv_gather._build_geometry(cu, cp, ulysses, kv, kv_index, heads, "test")
        assert sorted(g.perm.tolist()) == list(range(g.full_tokens))  # a permutation of all rows
        assert torch.equal(g.perm[g.full_index], torch.arange(g.full_tokens))
        rows = sorted(r for q0, q1, *_ in g.blocks for r in range(q0, q1))
        assert rows == list(range(ulysses * int(cu[-1])))  # each query row in exactly one block
        for q0, q1, k0, k1, first in g.blocks:
            assert (q1 - q0) * (k1 - k0) * heads <= 300 or q1 - q0 == 1  # bounded mask / scores
            assert k1 - k0 == first + (q1 - q0)  # keys up to the block's last query position
        assert len(g.blocks) > 2 * ulysses * len(lengths)  # long chunks were split into blocks


def test_offset_block_is_bottom_right_causal():
    torch.manual_seed(0)
    full, first, n, heads = 24, 10, 6, 4
    q = torch.randn(full, heads, 8, dtype=torch.float64)
    k, v = torch.randn(full, 2, 8, dtype=torch.float64), torch.randn(full, 2, 8, dtype=torch.float64)
    kr, vr = (t.repeat_interleave(2, dim=1).transpose(0, 1) for t in (k, v))
    ref = F.scaled_dot_product_attention(q.transpose(0, 1), kr, vr, is_causal=True).transpose(0, 1)
    out = kv_gather._block_attention(q[first:first + n], k[:first + n], v[:first + n], first)
    torch.testing.assert_close(out, ref[first:first + n])
    out0 = kv_gather._block_attention(q[:n], k[:n], v[:n], 0)
    torch.testing.assert_close(out0, ref[:n])
