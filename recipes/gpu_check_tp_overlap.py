"""gpu_check part ``tp_overlap``: tp overlap's fused operations against the collective-then-GEMM path.

On NCCL with CUDA tensors the group's collectives object (``lightning_hotspa/group_collectives.py``,
``DeviceCollectives``) runs ``torch.ops.symm_mem.fused_all_gather_matmul`` / ``fused_matmul_reduce_scatter``
on a group enabled for symmetric memory; this part checks on every tp group of the GPUs it is given
that both equal the plain collective followed by the GEMM (bf16: relative error <= 2e-2; fp32: 1e-5)
and times both (CUDA events, median of the repeats). NEVER RUN ON A GPU YET (2026-12-06): it needs at
least 2 GPUs in one process group (one device cannot hold two NCCL ranks; the lent machine has one).
``--dry-run`` runs the same code on 2 gloo CPU ranks (the ring decomposition), which the smoke test does.

    torchrun --nproc-per-node 8 recipes/gpu_check_tp_overlap.py        # NCCL, every GPU of the node
    python recipes/gpu_check_tp_overlap.py --dry-run                   # 2 gloo CPU ranks, seconds

The last line printed is one JSON object (rank 0's report, every rank's errors folded in).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

SHAPES = {"real": {"tokens": 4096, "hidden": 8192, "out": 8192, "repeats": 10},  # a 70B layer's row at tp8
          "dry": {"tokens": 64, "hidden": 32, "out": 48, "repeats": 2}}


def _time(fn: Any, device: torch.device, repeats: int) -> float:
    """Median seconds of ``fn()`` (CUDA events on a GPU, the host clock on a CPU)."""
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def check(device: torch.device, dtype: torch.dtype, shape: dict[str, int]) -> dict[str, Any]:
    """On this rank: the fused (or ring) operations against their unfused composition, per tp group."""
    from lightning_hotspa.group_collectives import GroupCollectives
    from lightning_hotspa.layout import Layout
    from lightning_hotspa.mesh import WorldMesh

    world = dist.get_world_size()
    layout = Layout(tp=world)
    mesh = WorldMesh([layout], device_type=device.type)
    group = mesh.layout_groups(layout).tp
    comm = group.comm
    g = torch.Generator(device="cpu").manual_seed(100 + dist.get_rank())
    rows = shape["tokens"] // world
    x = torch.randn(rows, shape["hidden"], generator=g).to(device, dtype)
    b = (torch.randn(shape["hidden"], shape["out"], generator=g) / shape["hidden"] ** 0.5).to(device, dtype)
    lefts = torch.randn(world, rows, shape["hidden"], generator=g).to(device, dtype)
    out: dict[str, Any] = {"world": world, "backend": group.backend, "collectives": type(comm).__name__,
                           "dtype": str(dtype)}
    fused_ag = comm.all_gather_matmul(x, [b])
    plain_ag = GroupCollectives.all_gather_matmul(comm, x, [b])
    fused_rs = comm.matmul_reduce_scatter([lefts], [b])
    plain_rs = GroupCollectives.matmul_reduce_scatter(comm, [lefts], [b])

    def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
        return float((a.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))

    out["all_gather_matmul_rel_error"] = max(rel(fused_ag[0], plain_ag[0]), rel(fused_ag[1][0], plain_ag[1][0]))
    out["matmul_reduce_scatter_rel_error"] = rel(fused_rs, plain_rs)
    out["tolerance"] = 2e-2 if dtype == torch.bfloat16 else 1e-5
    reps = shape["repeats"]
    out["seconds"] = {
        "all_gather_matmul_fused": _time(lambda: comm.all_gather_matmul(x, [b]), device, reps),
        "all_gather_matmul_plain": _time(lambda: GroupCollectives.all_gather_matmul(comm, x, [b]), device, reps),
        "matmul_reduce_scatter_fused": _time(lambda: comm.matmul_reduce_scatter([lefts], [b]), device, reps),
        "matmul_reduce_scatter_plain": _time(lambda: GroupCollectives.matmul_reduce_scatter(comm, [lefts], [b]),
                                             device, reps)}
    out["ok"] = out["all_gather_matmul_rel_error"] <= out["tolerance"] and \
        out["matmul_reduce_scatter_rel_error"] <= out["tolerance"]
    return out


def _dry_rank(_: int = 0) -> dict[str, Any]:
    return check(torch.device("cpu"), torch.float32, SHAPES["dry"])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="2 gloo CPU ranks, tiny shapes")
    args = parser.parse_args(argv)
    if args.dry_run:
        from lightning_hotspa.testing.spawn import run_on_ranks

        per_rank = run_on_ranks(_dry_rank, 2, timeout_s=240)
    else:
        if "LOCAL_RANK" not in os.environ:
            raise SystemExit("run under torchrun with >= 2 GPUs (one device cannot hold two NCCL ranks); "
                             "--dry-run checks the code on 2 gloo CPU ranks")
        local = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        if dist.get_world_size() < 2:
            raise SystemExit("tp overlap needs >= 2 ranks")
        mine = check(torch.device("cuda", local), torch.bfloat16, SHAPES["real"])
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, mine)
        dist.destroy_process_group()
        if local != 0:
            return mine
    report = dict(per_rank[0])
    report["ok"] = all(r["ok"] for r in per_rank)
    report["worst_rel_error"] = max(max(r["all_gather_matmul_rel_error"], r["matmul_reduce_scatter_rel_error"])
                                    for r in per_rank)
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
