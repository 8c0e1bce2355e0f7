"""Measuring the numbers behind the ``cpu-gloo`` hardware profile (``hotspa calibrate``).

Kept out of :mod:`lightning_hotspa.planner.cost.hardware`: it starts ranks (``testing.spawn``), which the
runtime planner never does. The figures it printed on the development machine are recorded there as
``CPU_GLOO_CALIBRATION``.
"""

from __future__ import annotations

from typing import Any

from ..testing.spawn import run_on_ranks

__all__ = ["measure_cpu_gloo"]


def _time(fn: Any, repeats: int) -> float:
    """Median seconds of ``fn()`` over ``repeats`` calls (after one warm-up)."""
    import time

    fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    samples.sort()
    return samples[len(samples) // 2]


def _calibrate_rank(repeats: int) -> dict[str, float]:
    """Runs on every rank at once (so the rates include sharing the cores, as training does)."""
    import torch
    import torch.distributed as dist

    from ..group_collectives import world_collectives

    world = world_collectives()
    out: dict[str, float] = {}
    for m, k, n in ((1024, 384, 1024), (2048, 64, 176)):  # 'small' and 'tiny' preset GEMM shapes
        a, b = torch.randn(m, k), torch.randn(k, n)
        world.barrier()
        out[f"matmul_{m}x{k}x{n}_flops"] = 2 * m * k * n / _time(lambda a=a, b=b: a @ b, repeats)
    for nbytes in (4 * 2**20, 16 * 2**20):
        x = torch.zeros(nbytes // 4)
        world.barrier()
        sec = _time(lambda x=x: world.all_reduce(x), repeats)
        g = dist.get_world_size()
        out[f"allreduce_{nbytes >> 20}MiB_busbw"] = 2 * (g - 1) / g * nbytes / sec
    small = torch.zeros(256)
    world.barrier()
    out["allreduce_1KiB_s"] = _time(lambda: world.all_reduce(small), repeats * 4)
    return out


def measure_cpu_gloo(ranks: int = 4, repeats: int = 9) -> dict[str, float]:
    """Measures matmul rates and gloo all-reduce bandwidth/latency on ``ranks`` local processes;
    returns the median over ranks of each figure (the numbers behind the ``cpu-gloo`` profile)."""
    import statistics

    per_rank = run_on_ranks(_calibrate_rank, ranks, repeats, timeout_s=600)
    return {k: statistics.median(r[k] for r in per_rank) for k in per_rank[0]}
