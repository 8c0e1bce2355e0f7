"""Pipeline parallelism inside a layout vs the single-process model (docs/DESIGN.md, "Pipeline parallelism").

4 CPU ranks over gloo, two pool calls (an uneven layer split: 9 layers). For every supported torch
schedule: the pp layouts that split each layer too (pp2 x tp2, pp2 x cp2; two documents per
micro-batch), run by the StepRunner, give the single process's loss and home gradients (per tensor
||ours - ref|| / ||ref|| <= 1e-5, fp32); and 3 AdamW steps in fp64 of a plan that switches pp2 x dp2
-> dp4 -> tp2xcp2 -> pp4 inside each optimizer step end at the single process's weights (1e-9; the
issue asks 1e-5, fp64 leaves ~1e-13): every schedule runs every pp layout. A rank of a pp layout holds
only its stages' parameters.
"""

from __future__ import annotations

import zlib

import pytest
import torch
from helpers import LlamaFusedLoss, LlamaLoss, rel_error, single_process_reference

from lightning_hotspa.layout import Layout, LayoutError
from lightning_hotspa.models import LlamaConfig

CONFIG = LlamaConfig.preset("tiny", n_layers=9)
MESH = ["dp2xpp2", "tp2xpp2", "cp2xpp2", "pp4", "dp4", "tp2xcp2"]
PIPELINED = ["dp2xpp2", "tp2xpp2", "cp2xpp2", "pp4"]
LENGTHS = [37, 12, 51, 8, 23, 44, 16, 30, 9, 27, 40, 14, 33, 20, 11, 25]
TOLERANCE = 1e-5


def _docs() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(zlib.crc32(b"pipeline"))
    return [torch.randint(0, CONFIG.vocab_size, (n,), generator=g) for n in LENGTHS]


def _stage(layout: str, doc_ids: list[int], per_mb: int = 1):
    """``doc_ids`` dealt round-robin to the dp groups, ``per_mb`` documents per micro-batch."""
    from lightning_hotspa.plan import Stage

    lay = Layout.parse(layout)
    groups = [doc_ids[i::lay.dp] for i in range(lay.dp)]
    return Stage(lay, tuple(tuple(tuple(g[j:j + per_mb]) for j in range(0, len(g), per_mb)) for g in groups))


#: the layouts checked stage by stage in fp32 per schedule (pp2 x dp2 and pp4 run in every schedule's
#: fp64 trajectory, inside the switching plan)
CHECKED = ["tp2xpp2", "cp2xpp2"]


def cases() -> dict[str, tuple]:
    every = list(range(len(LENGTHS)))
    out = {name: (_stage(name, every, 2),) for name in PIPELINED}
    # pp -> dp4 -> tp2xcp2 -> pp inside one step (each stage a quarter of the documents)
    out["switch"] = (_stage("dp2xpp2", every[0::4]), _stage("dp4", every[1::4]), _stage("tp2xcp2", every[2::4]),
                     _stage("pp4", every[3::4]))
    return out


def build_setup(layouts: list[str], build=lambda: LlamaFusedLoss(CONFIG), dtype=torch.float32):
    """``(module, world, shardings, home, parallel, engine, init)`` on this rank's process group."""
    from lightning_hotspa.engine.switch import SwitchEngine, build_home_parameters
    from lightning_hotspa.mesh import WorldMesh
    from lightning_hotspa.models import param_roles
    from lightning_hotspa.parallel.model import ParallelModel
    from lightning_hotspa.placements import build_shardings

    module = build()
    init = {n: p.detach().clone() for n, p in module.named_parameters()}
    world = WorldMesh(layouts)
    roles = param_roles(module, LlamaLoss.plan(CONFIG))
    shardings = build_shardings({n: tuple(p.shape) for n, p in init.items()}, roles, world.shape)
    home = build_home_parameters(world, shardings, lambda name, shape: init[name], dtype)
    parallel = ParallelModel(module, roles, world)
    parallel.restore(home)
    return module, world, shardings, home, parallel, SwitchEngine(world, shardings, home), init


def run_pipeline_checks(schedules: list[str], case_names: list[str] | None = None) -> dict:
    """On every rank: per (schedule, case) the max per-tensor gradient error and the loss error vs the
    single process; the largest parameter share this rank materialized in each pp layout."""
    from lightning_hotspa.engine.step_runner import StepRunner
    from lightning_hotspa.plan import StepPlan, slice_plan

    docs = _docs()
    ref_loss, _, ref_grads = single_process_reference(lambda: LlamaFusedLoss(CONFIG), docs)
    module, world, _, home, parallel, engine, _ = build_setup(MESH)
    total = sum(p.numel() for p in home.values())
    out: dict = {"errors": {}, "fraction": {}}
    for schedule in schedules:
        runner = StepRunner(engine, parallel, pipeline_schedule=schedule)
        for case, stages in cases().items():
            if case_names is not None and case not in case_names:
                continue
            plan = slice_plan(StepPlan(0, tuple(LENGTHS), stages), docs, world.shape, world.rank)
            result = runner.run(plan, module.training_step)
            engine.assign_home_grads()
            errors = {n: rel_error(p.grad.full_tensor(), ref_grads[n]) for n, p in home.items()}
            for p in home.values():
                p.grad = None
            engine.clear_grad_store()
            out["errors"][schedule, case] = (max(errors.values()), abs(float(result.loss) - ref_loss))
        for name in PIPELINED:
            engine.enter_stage([Layout.parse(name)])
            held = sum(p.numel() for p in engine.working.values() if p.untyped_storage().nbytes())
            out["fraction"][name] = held / total
            engine.release(free=True)
        out.setdefault("built", {})[schedule] = runner.pipeline.built
    return out


def run_trajectories(schedules: list[str]) -> dict:
    """On every rank: :func:`trajectory_errors` per schedule."""
    return {schedule: trajectory_errors(schedule) for schedule in schedules}


#: the schedules whose 3-step fp64 trajectories are checked (every one: zero bubble's deferred weight
#: backward frees its received activations later, parallel/pipeline.py)
TRAJECTORY_SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"]


def trajectory_errors(schedule: str, steps: int = 3) -> dict:
    """3 AdamW steps in fp64, each step the plan that switches pp -> dp4 -> tp2xcp2 -> pp (new
    documents per step), against the single process's 3 steps on the same global mini-batches:
    the largest per-step loss error and the final weights' largest per-tensor relative error."""
    from lightning_hotspa.engine.step_runner import StepRunner
    from lightning_hotspa.plan import StepPlan, pack_micro_batch, slice_plan

    def build():
        return LlamaFusedLoss(CONFIG).double()

    def adamw(params):
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=False)

    reference = build()
    ref_opt = adamw(reference.parameters())
    module, world, _, home, parallel, engine, _ = build_setup(MESH, build, torch.float64)
    runner = StepRunner(engine, parallel, pipeline_schedule=schedule)
    optimizer = adamw(list(home.values()))
    loss_errors = []
    for step in range(steps):
        g = torch.Generator().manual_seed(zlib.crc32(f"trajectory/{step}".encode()))
        docs = [torch.randint(0, CONFIG.vocab_size, (n,), generator=g) for n in LENGTHS]
        ref_opt.zero_grad()
        ref_loss = reference.training_step(pack_micro_batch(docs))
        ref_loss.backward()
        ref_opt.step()
        ref_loss = float(ref_loss.detach())
        plan = slice_plan(StepPlan(step, tuple(LENGTHS), cases()["switch"]), docs, world.shape, world.rank)
        result = runner.run(plan, module.training_step)
        engine.assign_home_grads()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        engine.clear_grad_store()
        loss_errors.append(abs(float(result.loss) - ref_loss) / abs(ref_loss))
    ref = dict(reference.named_parameters())
    weights = {n: rel_error(p.detach().full_tensor(), ref[n]) for n, p in home.items()}
    return {"loss": max(loss_errors), "weights": max(weights.values()), "dtype": str(next(iter(home.values())).dtype)}


SCHEDULE_NAMES = ["gpipe", "1f1b", "interleaved_1f1b", "zero_bubble"]


@pytest.mark.slow
def test_pipeline_layouts_and_switch_equal_single_process(ranks):
    """Every schedule x pp layout: the single process's gradients at 1e-5 (the layouts that also split
    each layer) or its 3-step fp64 trajectory at 1e-9 (a step switching pp <-> dp4 <-> tp2xcp2); a rank
    of a pp layout holds only its stages' parameters."""
    results = ranks(4).run(run_pipeline_checks, SCHEDULE_NAMES, CHECKED, timeout_s=600)
    for rank, res in enumerate(results):
        for (schedule, case), (grad_err, loss_err) in res["errors"].items():
            assert grad_err <= TOLERANCE, (rank, schedule, case, grad_err)
            assert loss_err <= 1e-5, (rank, schedule, case, loss_err)
        assert len(res["errors"]) == len(SCHEDULE_NAMES) * len(CHECKED)
        # pp2: one of two stages (an uneven 9-layer split: 5 + the head, or 4 + the embedding)
        assert res["fraction"]["dp2xpp2"] < 0.75 and res["fraction"]["pp4"] < 0.5, res["fraction"]
        assert res["built"]["1f1b"] == len(CHECKED)  # one per (layout, micro-batch count, tokens)
    # the same rank pool: 3 fp64 AdamW steps of the switching plan per schedule
    trajectories = ranks(4).run(run_trajectories, TRAJECTORY_SCHEDULES, timeout_s=600)
    for rank, res in enumerate(trajectories):
        assert set(res) == set(TRAJECTORY_SCHEDULES)
        for schedule, traj in res.items():  # the 1e-5; fp64 rounding leaves ~1e-13 (1e-9: Adam's noise)
            assert traj["dtype"] == "torch.float64" and traj["loss"] <= 1e-10 and traj["weights"] <= 1e-9, \
                (rank, schedule, traj)


def test_pipeline_validation_errors():
    from lightning_hotspa.parallel.pipeline import PipelineRunner, layer_split

    assert [len(r) for r in layer_split(9, 4)] == [2, 3, 2, 2]
    assert [len(r) for r in layer_split(9, 2)] == [4, 5]
    with pytest.raises(LayoutError, match="layout pp4: 8 pipeline stages .* only 5 layers"):
        layer_split(5, 8, "pp4")
    with pytest.raises(LayoutError, match="schedule 'bogus' is not one of"):
        PipelineRunner(None, "bogus")
    with pytest.raises(LayoutError, match="'1f1b' takes 1 stages per rank, got virtual=2"):
        PipelineRunner(None, "1f1b", 2)
