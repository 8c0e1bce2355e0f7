"""Pipeline parallelism benchmark (CPU, 4 gloo ranks): torch's schedules vs the single process.

For each schedule (GPipe, 1F1B, interleaved 1F1B with 2 virtual stages per rank; ``--schedules``),
the pp layouts ``dp2xpp2``, ``tp2xpp2`` and ``pp4`` each run one step of the StepRunner on the same
global documents as the single process; ``schedules`` is the largest per-tensor gradient error
(||ours - ref|| / ||ref||) of the home gradients. ``switch_plan_max_grad_rel_err``: one step whose
stages switch dp2xpp2 -> dp4 -> tp2xcp2 -> pp4. ``param_fraction_per_rank``: per layout, the largest
share of the model's parameter elements one rank materializes. ``switch_bytes_over_bound``: bytes a
rank received (the engine's count) over the lower bound (elements of its destination copy it held
neither at home nor in its source copy, from the shard geometry, as ``benchmark_switch.py``
counts), for switches into and out of pp, the largest over ranks. ``reduce_bytes_per_rank``: per pp layout,
the bytes of a step's gradient reduction one rank received (the engine's count), the largest over ranks.
The last line is one JSON object.

    python recipes/benchmark_pipeline.py --layers 8
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import zlib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_hotspa.layout import Layout  # noqa: E402
from lightning_hotspa.testing.spawn import RankPool  # noqa: E402

MESH = ["dp2xpp2", "tp2xpp2", "pp4", "dp4", "tp2xcp2"]
PIPELINED = ["dp2xpp2", "tp2xpp2", "pp4"]
SWITCHES = [(None, "dp2xpp2"), ("dp4", "dp2xpp2"), ("dp2xpp2", "dp4"), ("dp2xpp2", "tp2xcp2"), ("tp2xcp2", "pp4"),
            ("pp4", "dp4")]


def _stage(layout: str, doc_ids: list[int], per_mb: int):
    from lightning_hotspa.plan import Stage

    lay = Layout.parse(layout)
    groups = [doc_ids[i::lay.dp] for i in range(lay.dp)]
    return Stage(lay, tuple(tuple(tuple(g[j:j + per_mb]) for j in range(0, len(g), per_mb)) for g in groups))


def _bound_elems(engine, source: str | None, target: str, owned_src, owned_dst) -> int:
    """Elements of this rank's ``target`` copy it held neither at home nor in its ``source`` copy."""
    rank, total = engine.world.rank, 0
    for name, sh in engine.shardings.items():
        if owned_dst is not None and name not in owned_dst or sh.dim is None:
            continue  # not materialized in a pp target; a never-split parameter is whole at home
        t = sh.layout_prefix(Layout.parse(target))
        dst = sh.interval(rank, t)
        held = [sh.interval(rank, sh.home_prefix)]
        if source is not None and (owned_src is None or name in owned_src):
            held.append(sh.interval(rank, sh.layout_prefix(Layout.parse(source))))
        width = dst[1] - dst[0]
        covered = max(max(0, min(h[1], dst[1]) - max(h[0], dst[0])) for h in held)
        other = 1
        for d, size in enumerate(sh.local_shape(t)):
            if d != sh.dim:
                other *= size
        total += (width - covered) * other
    return total


def bench_rank(layers: int, schedules: list[str]) -> dict:
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    import torch.distributed as dist

    from lightning_hotspa.engine.step_runner import StepRunner
    from lightning_hotspa.engine.switch import SwitchEngine, build_home_parameters
    from lightning_hotspa.mesh import WorldMesh
    from lightning_hotspa.models import Llama, LlamaConfig, llama_tp_plan, param_roles
    from lightning_hotspa.parallel.model import ParallelModel
    from lightning_hotspa.placements import build_shardings
    from lightning_hotspa.plan import StepPlan, pack_micro_batch, slice_plan

    config = LlamaConfig.preset("tiny", n_layers=layers)

    class LM(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = Llama(config)

        def training_step(self, mb):
            return self.model(mb.input_ids, mb.position_ids, mb.cu_seqlens, mb.max_seqlen, labels=mb.labels)

    g = torch.Generator().manual_seed(zlib.crc32(b"pipeline"))
    lengths = [37, 12, 51, 8, 23, 44, 16, 30, 9, 27, 40, 14, 33, 20, 11, 25]
    docs = [torch.randint(0, config.vocab_size, (n,), generator=g) for n in lengths]
    ref = LM()
    init = {n: p.detach().clone() for n, p in ref.named_parameters()}
    ref.training_step(pack_micro_batch(docs)).backward()
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    lm = LM()
    world = WorldMesh(MESH)
    roles = param_roles(lm, llama_tp_plan(config, 2, prefix="model."))
    shardings = build_shardings({n: tuple(p.shape) for n, p in init.items()}, roles, world.shape)
    home = build_home_parameters(world, shardings, lambda name, shape: init[name])
    parallel = ParallelModel(lm, roles, world)
    parallel.restore(home)
    engine = SwitchEngine(world, shardings, home)
    every = list(range(len(lengths)))
    switch_plan = (_stage("dp2xpp2", every[0::4], 1), _stage("dp4", every[1::4], 1), _stage("tp2xcp2", every[2::4], 1),
                   _stage("pp4", every[3::4], 1))

    reduce_bytes: dict[str, int] = {}  # a single-stage step's gradient reduction: bytes this rank received

    def step_error(runner, stages) -> float:
        plan = slice_plan(StepPlan(0, tuple(lengths), stages), docs, world.shape, world.rank)
        result = runner.run(plan, lm.training_step)
        if len(stages) == 1:
            reduce_bytes[str(stages[0].layout)] = result.stages[0].reduce_bytes
        engine.assign_home_grads()
        err = max(float((p.grad.full_tensor() - ref_grads[n]).norm() / ref_grads[n].norm()) for n, p in home.items())
        for p in home.values():
            p.grad = None
        engine.clear_grad_store()
        return err

    out: dict = {"schedules": {}, "fraction": {}, "bytes": {}}
    runner = None
    for schedule in schedules:
        runner = StepRunner(engine, parallel, pipeline_schedule=schedule)
        out["schedules"][schedule] = {name: step_error(runner, (_stage(name, every, 2),)) for name in PIPELINED}
    out["switch_plan"] = step_error(runner, switch_plan)
    out["reduce_bytes"] = reduce_bytes
    total = sum(p.numel() for p in home.values())
    for name in [*PIPELINED, "dp4", "tp2xcp2"]:
        engine.enter_stage([Layout.parse(name)])
        out["fraction"][name] = sum(p.numel() for p in engine.working.values() if p.untyped_storage().nbytes()) / total
        engine.release(free=True)
    itemsize = 4
    for source, target in SWITCHES:
        if source is not None:
            engine.enter_stage([Layout.parse(source)])
        owned_src = engine._owned(Layout.parse(source)) if source is not None else None
        report = engine.enter_stage([Layout.parse(target)])
        bound = _bound_elems(engine, source, target, owned_src, engine._owned(Layout.parse(target))) * itemsize
        out["bytes"][f"{source or 'home'}->{target}"] = (report.bytes_received, bound)
        engine.release(free=True)
    dist.barrier()
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8, help="decoder layers (>= 8: pp4 x 2 virtual stages)")
    parser.add_argument("--schedules", default="gpipe,1f1b,interleaved_1f1b")
    args = parser.parse_args(argv)
    pool = RankPool(4, collective_timeout_s=600)
    try:
        ranks = pool.run(bench_rank, args.layers, args.schedules.split(","), timeout_s=1800)
    finally:
        pool.close()
    schedules = {s: max(max(r["schedules"][s].values()) for r in ranks) for s in ranks[0]["schedules"]}
    over = {}
    for key in ranks[0]["bytes"]:
        ratios = []
        for r in ranks:
            got, bound = r["bytes"][key]
            ratios.append(got / bound if bound else (1.0 if got == 0 else float("inf")))
        over[key] = round(max(ratios), 4)
    for key, value in over.items():
        print(f"{key:<22} bytes / lower bound {value}")
    result = {
        "ranks": 4,
        "layers": args.layers,
        "schedules": schedules,
        "per_layout": {s: {k: max(r["schedules"][s][k] for r in ranks) for k in PIPELINED} for s in schedules},
        "switch_plan_max_grad_rel_err": max(r["switch_plan"] for r in ranks),
        "param_fraction_per_rank": {k: round(max(r["fraction"][k] for r in ranks), 4) for k in ranks[0]["fraction"]},
        "switch_bytes_over_bound": over,
        "reduce_bytes_per_rank": {k: max(r["reduce_bytes"][k] for r in ranks) for k in ranks[0]["reduce_bytes"]},
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
