"""tp overlap's two operations on gloo (issue 52): the rings of ``GlooCollectives`` equal the plain
collective followed by the GEMM, for every group of 2 and 4 ranks of a 4-rank mesh (some out of shard
order), and the row-parallel autograd node equals ``F.linear`` + the token reduce-scatter, forward and
backward. The whole model against the single process, per step and over a 3-step fp64 trajectory in a
switching plan, is tests/distributed/test_sequence_parallel.py's (tp overlap is on by default)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

TOLERANCE = 1e-12  # fp64: only the summation order differs


def run_overlap_ops() -> dict:
    from lightning_hotspa.mesh import WorldMesh
    from lightning_hotspa.models.kernels import SwiGLUDown
    from lightning_hotspa.parallel.row_scatter import row_scatter
    from lightning_hotspa.parallel.sequence_parallel import scatter_tokens
    from lightning_hotspa.shard_rows import (
        all_gather_matmul_rows,
        all_gather_rows,
        matmul_reduce_scatter_rows,
        reduce_scatter_rows,
    )

    world = WorldMesh(["tp4", "dp2xtp2", "tp2xcp2"])
    errors, shard_order, calls = {}, [], {"isend": 0}
    original = torch.distributed.isend

    def counted(*args, **kwargs):
        calls["isend"] += 1
        return original(*args, **kwargs)

    torch.distributed.isend = counted
    try:
        for layout in world.layouts:
            groups = world.layout_groups(layout)
            for role in ("tp", "cp"):
                group = getattr(groups, role)
                if group.size == 1:
                    continue
                shard_order.append(group.in_shard_order)
                g = torch.Generator().manual_seed(17 + group.index)
                x = torch.randn(6, 2, 8, generator=g, dtype=torch.float64)  # this rank's [T, b, K]
                rights = [torch.randn(8, n, generator=g, dtype=torch.float64) for n in (5, 3)]
                gathered, outs = all_gather_matmul_rows(x, rights, group)
                full = all_gather_rows(x, group)
                key = f"{layout}/{role}"
                errors[key + "/gather"] = float((gathered - full).abs().max())
                errors[key + "/gather_matmul"] = max(float((o - full @ b).abs().max()) for o, b in zip(outs, rights))
                lefts = [torch.randn(6 * group.size, 2, 8, generator=g, dtype=torch.float64) for _ in range(2)]
                summed = matmul_reduce_scatter_rows(lefts, rights[:1] * 2, group)
                plain = reduce_scatter_rows(lefts[0] @ rights[0] + lefts[1] @ rights[0], group)
                errors[key + "/matmul_scatter"] = float((summed - plain).abs().max())
                # the autograd nodes: a plain row-parallel Linear and SwiGLU's down projection
                a = torch.randn(1, 6 * group.size, 8, generator=g, dtype=torch.float64, requires_grad=True)
                b = torch.randn(1, 6 * group.size, 8, generator=g, dtype=torch.float64, requires_grad=True)
                w = torch.randn(4, 8, generator=g, dtype=torch.float64, requires_grad=True)
                up = torch.randn(1, 6, 4, generator=g, dtype=torch.float64)
                for name, left in (("linear", None), ("swiglu", SwiGLUDown.tp_row_input)):
                    inputs = (a,) if left is None else (a, b)
                    ours = row_scatter(w, group, *inputs, left=left)
                    mine = torch.autograd.grad((ours * up).sum(), [w, *inputs])
                    ref = scatter_tokens(F.linear(inputs[0] if left is None else left(a, b), w), group)
                    theirs = torch.autograd.grad((ref * up).sum(), [w, *inputs])
                    errors[f"{key}/{name}"] = max(float((ours - ref).abs().max()),
                                                  *(float((m - t).abs().max()) for m, t in zip(mine, theirs)))
    finally:
        torch.distributed.isend = original
    return {"errors": errors, "shard_order": shard_order, "isend": calls["isend"]}


def test_the_gloo_rings_equal_the_collective_then_the_gemm(ranks):
    per_rank = ranks(4).run(run_overlap_ops, timeout_s=300)
    for r in per_rank:
        worst = max(r["errors"], key=r["errors"].get)
        assert r["errors"][worst] <= TOLERANCE, (worst, r["errors"][worst])
        assert len(r["errors"]) >= 4 * 5 and r["isend"] > 0  # the rings ran
    assert not all(all(r["shard_order"]) for r in per_rank)  # some group out of shard order
