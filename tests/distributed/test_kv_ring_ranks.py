"""The KV ring on gloo ranks: the attention and its gradients equal the whole documents' (fp64, cp 2 and 4,
the hybrid, GQA with fewer kv heads than cp, a sliding window), the ring shift passes in shard order, no
host sync per call, and a rank killed mid-ring fails the others with a ``CollectiveError`` naming the group.
(The whole-model update against the single process, in switching plans, is test_parallel.py, test_blocks.py
and test_mixed_rounds.py: the ``:kv`` / ``:kv<n>`` layouts there run this ring.)"""

from __future__ import annotations

import json
import os
import signal
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lightning_hotspa.layout import Layout
from lightning_hotspa.mesh import WorldMesh
from lightning_hotspa.models.attention import sdpa_attention
from lightning_hotspa.parallel import kv_ring
from lightning_hotspa.plan import pack_micro_batch
from lightning_hotspa.testing.forked_ranks import free_port, run_forked_ranks
from lightning_hotspa.testing.host_syncs import count_host_syncs

LENGTHS = [40, 9, 72, 24]


def _documents(heads: int, kv_heads: int) -> tuple[list[torch.Tensor], ...]:
    g = torch.Generator().manual_seed(7)
    return tuple([torch.randn(n, h, 8, dtype=torch.float64, generator=g) for n in LENGTHS] for h in
                 (heads, kv_heads, kv_heads, heads))


def _local(docs: list[torch.Tensor], cp: int, r: int) -> torch.Tensor:
    """Rank ``r``'s rows of the documents as the plan packs them (chunks r and 2cp-1-r, padded)."""
    out = []
    for d in docs:
        n = -(-d.shape[0] // (2 * cp)) * 2 * cp
        padded = torch.cat([d, d.new_zeros(n - d.shape[0], *d.shape[1:])])
        c = n // (2 * cp)
        out += [padded[r * c:(r + 1) * c], padded[(2 * cp - 1 - r) * c:(2 * cp - r) * c]]
    return torch.cat(out)


def _ring_matches(layout: str, heads: int, kv_heads: int, window: int | None) -> dict:
    world = WorldMesh([layout])
    lay = Layout.parse(layout)
    groups = world.layout_groups(lay)
    cp, r = lay.cp, groups.cp.index
    q, k, v, grad = _documents(heads, kv_heads)
    mb = pack_micro_batch([torch.zeros(n, dtype=torch.long) for n in LENGTHS], cp_size=cp, cp_rank=r)
    ql, kl, vl = (_local(t, cp, r).requires_grad_() for t in (q, k, v))
    out = kv_ring.kv_ring_attention(ql, kl, vl, mb.cu_seqlens, groups, mb, window=window)
    got = torch.autograd.grad(out, (ql, kl, vl), _local(grad, cp, r))
    # the reference: each document whole, padded as the plan pads it (padding rows attend as tokens do)
    padded = [-(-n // (2 * cp)) * 2 * cp for n in LENGTHS]
    qf, kf, vf, gf = (torch.cat([torch.cat([d, d.new_zeros(p - d.shape[0], *d.shape[1:])])
                                 for d, p in zip(t, padded)]).requires_grad_() for t in (q, k, v, grad))
    cu = torch.tensor([0, *padded]).cumsum(0).to(torch.int32)
    extra = {} if window is None else {"window": window}
    ref = sdpa_attention(qf, kf, vf, cu, max(padded), **extra)
    want = torch.autograd.grad(ref, (qf, kf, vf), gf.detach())
    errs = {}
    for name, mine, whole in zip(("out", "dq", "dk", "dv"), (out, *got), (ref, *want)):
        local = _local(list(whole.detach().split(padded)), cp, r)
        errs[name] = float((mine - local).abs().max() / local.abs().max())
    with count_host_syncs() as log:
        kv_ring.kv_ring_attention(ql, kl, vl, mb.cu_seqlens, groups, mb, window=window)
    return {"errs": errs, "host_syncs": log.count}


@pytest.mark.parametrize("layout, ranks_, heads, kv_heads, window", [
    ("cp2:kv", 2, 4, 2, None), ("cp4:kv", 4, 4, 2, None), ("cp4:kv", 4, 4, 2, 13), ("cp4:kv2", 4, 4, 2, 13),
    ("dp2xcp2:kv", 4, 4, 1, None)])
def test_the_ring_equals_the_whole_documents(ranks, layout, ranks_, heads, kv_heads, window):
    for result in ranks(ranks_).run(_ring_matches, layout, heads, kv_heads, window):
        assert max(result["errs"].values()) < 1e-10, result
        assert result["host_syncs"] == 0, result


def _shift_order() -> list[int]:
    world = WorldMesh(["cp4:kv"])
    group = world.layout_groups(Layout.parse("cp4:kv")).cp_kv
    got = group.comm.ring_shift(torch.tensor([float(group.index)])).wait()
    return [int(got.item()), group.index]


def test_the_ring_shift_passes_to_the_next_shard(ranks):
    for received, index in ranks(4).run(_shift_order):
        assert received == (index - 1) % 4


def _killed_rank_main(out: Path, port: int):
    def main(rank: int) -> None:
        from lightning_hotspa.adapter.lightning.reliability import CollectiveError, StepTracker

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=4, timeout=timedelta(seconds=600))
        world = WorldMesh(["cp4:kv"], timeout=timedelta(seconds=600))
        groups = world.layout_groups(Layout.parse("cp4:kv"))
        q, k, v, _ = _documents(4, 2)
        mb = pack_micro_batch([torch.zeros(n, dtype=torch.long) for n in LENGTHS], cp_size=4, cp_rank=rank)
        ql, kl, vl = (_local(t, 4, rank) for t in (q, k, v))
        if rank == 1:  # dies inside the ring's first step, after posting its shift
            merge = kv_ring._merge

            def die(*args):
                if not args[2].first:
                    (out / "kill.json").write_text(json.dumps({"rank": rank}))
                    os.kill(os.getpid(), signal.SIGKILL)
                return merge(*args)

            kv_ring._merge = die
        try:
            with StepTracker().guard():
                for _ in range(3):
                    kv_ring.kv_ring_attention(ql, kl, vl, mb.cu_seqlens, groups, mb)
        except CollectiveError as exc:
            (out / f"rank{rank}.txt").write_text(str(exc))
            raise
    return main


def test_a_rank_killed_mid_ring_fails_the_others_with_the_group_named(tmp_path):
    """Rank 1 SIGKILLs itself inside its ring's first step (its shift posted); every other rank exits
    non-zero long before the collective timeout (600 s) with a CollectiveError naming the ring shift and
    the KV group's ranks."""
    ended = run_forked_ranks(4, _killed_rank_main(tmp_path, free_port()), deadline_s=240.0)
    assert ended.hung == [] and ended.codes[1] == -signal.SIGKILL, ended
    assert (tmp_path / "kill.json").exists()
    for rank in (0, 2, 3):
        assert ended.codes[rank] == 1, ended
        message = (tmp_path / f"rank{rank}.txt").read_text()
        assert "a ring shift (send / receive)" in message and "(ranks [0, 1, 2, 3])" in message, message
        assert "timed out" not in message.lower(), message
