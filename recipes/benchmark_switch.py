"""Hot-switch benchmark: our fused switch vs the naive way, side by side in one run.

For the parameters of a scaled-down Llama block stack, every ordered pair of distinct layouts of
the set below plus home -> each layout is switched (a) by :class:`SwitchEngine` and (b) naively:
every rank materializes each full tensor from the source layout (``DTensor.full_tensor()``) and
slices out its destination shard. Bytes come from wrapping the collective calls (not from the
engine's report); the lower bound is computed from DTensor's own shard geometry. Time is the median
over repeats of the slowest rank. The last line printed is one JSON object.

    python recipes/benchmark_switch.py --world 4
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_hotspa.engine.switch import SwitchEngine, build_home_parameters  # noqa: E402
from lightning_hotspa.layout import Layout  # noqa: E402
from lightning_hotspa.mesh import WorldMesh  # noqa: E402
from lightning_hotspa.placements import build_shardings  # noqa: E402
from lightning_hotspa.testing.comm_bytes import count_collective_bytes  # noqa: E402
from lightning_hotspa.testing.spawn import run_on_ranks  # noqa: E402

LAYOUTS = {4: ["dp4", "dp2xtp2", "tp4", "dp2xcp2", "tp2xcp2"],
           8: ["dp8", "dp4xtp2", "dp2xtp4", "tp8", "dp4xcp2", "tp4xcp2", "dp2xtp2xcp2"],
           2: ["dp2", "tp2", "cp2"]}


def block_stack(hidden: int, ffn: int, layers: int) -> tuple[dict, dict]:
    shapes, roles = {}, {}
    for i in range(layers):
        p = f"layers.{i}."
        for name, shape, role in [
            ("attention_norm.weight", (hidden,), "replicated"),
            ("attention.wq.weight", (hidden, hidden), "colwise"),
            ("attention.wk.weight", (hidden, hidden), "colwise"),
            ("attention.wv.weight", (hidden, hidden), "colwise"),
            ("attention.wo.weight", (hidden, hidden), "rowwise"),
            ("ffn_norm.weight", (hidden,), "replicated"),
            ("feed_forward.w1.weight", (ffn, hidden), "colwise"),
            ("feed_forward.w3.weight", (ffn, hidden), "colwise"),
            ("feed_forward.w2.weight", (hidden, ffn), "rowwise"),
        ]:
            shapes[p + name], roles[p + name] = shape, role
    return shapes, roles


def _init(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(shape, generator=g)


def _lower_bound_bytes(global_shape, mesh, src_placements, dst_placements, itemsize) -> int:
    """Bytes of this rank's destination shard that its source shard does not hold (DTensor geometry)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    src_shape, src_off = compute_local_shape_and_global_offset(global_shape, mesh, src_placements)
    dst_shape, dst_off = compute_local_shape_and_global_offset(global_shape, mesh, dst_placements)
    overlap = 1
    for s_len, s_off, d_len, d_off in zip(src_shape, src_off, dst_shape, dst_off):
        overlap *= max(0, min(s_off + s_len, d_off + d_len) - max(s_off, d_off))
    return (torch.Size(dst_shape).numel() - overlap) * itemsize


def _as_dtensor(local: torch.Tensor, world: WorldMesh, sharding, layout: Layout) -> DTensor:
    return DTensor.from_local(local, world.device_mesh, sharding.layout_placements(layout), run_check=False,
                              shape=torch.Size(sharding.shape),
                              stride=torch.empty(sharding.shape, device="meta").stride())


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def bench_rank(layout_names: list[str], hidden: int, ffn: int, layers: int, repeats: int) -> list[dict]:
    # DTensor warns on every multi-dim all-gather of the naive path; the warning is the point here
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    world = WorldMesh(layout_names)
    shapes, roles = block_stack(hidden, ffn, layers)
    shardings = build_shardings(shapes, roles, world.shape)
    home = build_home_parameters(world, shardings, _init)
    engine = SwitchEngine(world, shardings, home)
    rank = world.rank
    rows = []
    pairs = [(None, d) for d in layout_names] + [(s, d) for s in layout_names for d in layout_names if s != d]
    for src, dst in pairs:
        dst_layout = Layout.parse(dst)
        ours_t, naive_t = [], []
        for _ in range(repeats):
            # ours
            if src is not None:
                engine.materialize(Layout.parse(src))
            dist.barrier()
            with count_collective_bytes() as ours_log:
                start = time.perf_counter()
                engine.materialize(dst_layout) if src is None else engine.switch(dst_layout)
                elapsed = time.perf_counter() - start
            ours_t.append(_slowest(elapsed))
            ours = {n: w.detach() for n, w in engine.working.items()}
            # naive: full tensor from the source layout, then slice the destination shard
            if src is None:
                sources = home
            else:
                engine.materialize(Layout.parse(src))
                sources = {n: _as_dtensor(engine.working[n].detach(), world, sh, Layout.parse(src))
                           for n, sh in shardings.items()}
            dist.barrier()
            with count_collective_bytes() as naive_log:
                start = time.perf_counter()
                naive = {}
                for n, sh in shardings.items():
                    full = sources[n].full_tensor()
                    prefix = sh.layout_prefix(dst_layout)
                    lo, hi = sh.interval(rank, prefix)
                    naive[n] = full if sh.dim is None or prefix == 0 else full.narrow(sh.dim, lo, hi - lo).clone()
                elapsed = time.perf_counter() - start
            naive_t.append(_slowest(elapsed))
        correct = all(torch.equal(ours[n], naive[n]) for n in shardings)
        src_placements = {n: (sh.home_placements() if src is None else sh.layout_placements(Layout.parse(src)))
                          for n, sh in shardings.items()}
        bound = sum(_lower_bound_bytes(torch.Size(sh.shape), world.device_mesh, src_placements[n],
                                       sh.layout_placements(dst_layout), 4) for n, sh in shardings.items())
        rows.append({"src": src or "home", "dst": dst, "correct": correct,
                     "ours_bytes": ours_log.bytes_received, "naive_bytes": naive_log.bytes_received,
                     "lower_bound": bound, "ours_s": statistics.median(ours_t),
                     "naive_s": statistics.median(naive_t)})
    return rows


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4, choices=sorted(LAYOUTS))
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=2816)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    per_rank = run_on_ranks(bench_rank, args.world, LAYOUTS[args.world], args.hidden, args.ffn, args.layers,
                            args.repeats, timeout_s=1800)
    pairs = []
    for i, row in enumerate(per_rank[0]):
        rows = [r[i] for r in per_rank]
        ours = sum(r["ours_bytes"] for r in rows)
        bound = sum(r["lower_bound"] for r in rows)
        pairs.append({"src": row["src"], "dst": row["dst"], "correct": all(r["correct"] for r in rows),
                      "ours_bytes": ours, "naive_bytes": sum(r["naive_bytes"] for r in rows), "lower_bound": bound,
                      "ours_over_bound": (ours / bound) if bound else (1.0 if ours == 0 else float("inf")),
                      "ours_s": row["ours_s"], "naive_s": row["naive_s"]})
    print(f"{'pair':<22}{'ours MB':>10}{'naive MB':>10}{'bound MB':>10}{'ours/bnd':>10}{'ours ms':>10}{'naive ms':>10}")
    for p in pairs:
        print(f"{p['src'] + '->' + p['dst']:<22}{p['ours_bytes'] / 1e6:>10.2f}{p['naive_bytes'] / 1e6:>10.2f}"
              f"{p['lower_bound'] / 1e6:>10.2f}{p['ours_over_bound']:>10.3f}{p['ours_s'] * 1e3:>10.1f}"
              f"{p['naive_s'] * 1e3:>10.1f}")
    result = {
        "world": args.world,
        "layouts": LAYOUTS[args.world],
        "model": {"hidden": args.hidden, "ffn": args.ffn, "layers": args.layers, "dtype": "float32"},
        "pairs": len(pairs),
        "repeats": args.repeats,
        "correct": all(p["correct"] for p in pairs),
        "max_bytes_over_lower_bound": max(p["ours_over_bound"] for p in pairs),
        "bytes_vs_naive": sum(p["ours_bytes"] for p in pairs) / sum(p["naive_bytes"] for p in pairs),
        "time_vs_naive": sum(p["ours_s"] for p in pairs) / sum(p["naive_s"] for p in pairs),
        "ours_seconds_total": sum(p["ours_s"] for p in pairs),
        "naive_seconds_total": sum(p["naive_s"] for p in pairs),
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
