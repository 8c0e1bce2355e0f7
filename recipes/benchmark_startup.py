"""Start-up that scales with the shard: one rank's home-state set-up with REAL tensors on the fake
process group (any world size in one process), side by side in one run:

* ``shard``: the tiled scheme (models/init.py): the rank generates only the tiles its shard overlaps;
* ``full`` (the old way, as the code did before the tiled scheme): every parameter generated in full
  by one generator (``normal_`` over the whole tensor), then cut to the shard;
* ``own_elements``: generating the shard's element count with one ``normal_`` (the target's yardstick:
  ``shard`` should take at most 2x this).

``--full-layers N`` measures the old way on the embeddings, the head and N decoder layers only and
scales the layers' part to the whole model (it takes ~6 minutes at 70B); ``full_extrapolated`` says so.
Times are this process' CPU seconds (``process_time``; single-threaded, so immune to the load of a
shared machine), wall seconds next to them. The last line printed is one JSON object.

    python recipes/benchmark_startup.py --model llama7b --world 8
    python recipes/benchmark_startup.py --model llama3-70b --world 64 --full-layers 1
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from lightning_hotspa.engine.home import build_home_parameters  # noqa: E402
from lightning_hotspa.mesh import WorldMesh  # noqa: E402
from lightning_hotspa.models import (  # noqa: E402
    Llama,
    LlamaConfig,
    init_parameter,
    llama_tp_plan,
    param_roles,
    parameter_seed,
)
from lightning_hotspa.placements import build_shardings  # noqa: E402
from lightning_hotspa.testing.fake_world import FakeWorld  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama7b")
    parser.add_argument("--world", type=int, default=8)
    parser.add_argument("--layout", default=None, help="default: dp{world/8}xtp8 (dp{world} below 8)")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--full-layers", type=int, default=None, help="old way on this many layers only")
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = LlamaConfig.preset(args.model)
    layout = args.layout or (f"dp{args.world // 8}xtp8" if args.world >= 8 else f"dp{args.world}")
    with torch.device("meta"):
        model = Llama(config)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    with FakeWorld(args.world, args.rank):
        world = WorldMesh([layout])
        tp = world.layouts[0].tp
        roles = param_roles(model, llama_tp_plan(config, tp)) if tp > 1 else dict.fromkeys(shapes, "replicated")
        shardings = build_shardings(shapes, roles, world.shape)
        n_layers = config.n_layers

        def shard(name, shape, dim, start, stop):
            return init_parameter(name, shape, 0, n_layers=n_layers, dim=dim, start=start, stop=stop)

        def old_full(name, shape):  # the pre-tiles init: one generator over the full tensor
            if name.endswith("norm.weight"):
                return torch.ones(shape)
            g = torch.Generator().manual_seed(parameter_seed(0, name))
            return torch.empty(shape).normal_(0.0, 0.02, generator=g)

        t, w = time.process_time(), time.perf_counter()
        home = build_home_parameters(world, shardings, None, init_shard=shard)
        shard_s, shard_wall = time.process_time() - t, time.perf_counter() - w
        elements = sum(p.to_local().numel() for p in home.values())
        del home
        t = time.process_time()
        torch.empty(elements).normal_()
        own_s = time.process_time() - t

        subset = shardings
        if args.full_layers is not None:
            keep = {f"layers.{i}." for i in range(args.full_layers)}
            subset = {n: s for n, s in shardings.items() if not n.startswith("layers.") or
                      any(n.startswith(k) for k in keep)}
        t = time.process_time()
        build_home_parameters(world, subset, old_full)
        full_s = time.process_time() - t
        if args.full_layers is not None:  # scale the measured layers to all of them
            outer = {n: s for n, s in subset.items() if not n.startswith("layers.")}
            t = time.process_time()
            build_home_parameters(world, outer, old_full)
            outer_s = time.process_time() - t
            full_s = outer_s + (full_s - outer_s) * n_layers / args.full_layers
    out = {"model": args.model, "world": args.world, "layout": layout, "rank": args.rank,
           "shard_elements": elements, "shard_s": round(shard_s, 2), "shard_wall_s": round(shard_wall, 2),
           "own_elements_s": round(own_s, 2),
           "shard_over_own": round(shard_s / own_s, 3), "full_s": round(full_s, 1),
           "full_extrapolated": args.full_layers is not None, "speedup": round(full_s / shard_s, 1)}
    print(f"{args.model} on {args.world} ranks ({layout}), rank {args.rank}: shard-only {shard_s:.1f} CPU s, "
          f"generating its {elements / 1e9:.2f}G elements {own_s:.1f} s (x{shard_s / own_s:.2f}); "
          f"full-then-cut {full_s:.1f} s{' (extrapolated)' if args.full_layers is not None else ''}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
