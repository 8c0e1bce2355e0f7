"""The reference system's three 7B strategies as layouts, run by the real step on 8 fake ranks.

HotSPa's own 7B-on-8-GPU scripts hot-switch among (dp, tp, pp) = (1, 4, 2), (8, 1, 1) and (2, 2, 2):
here ``tp4xpp2``, ``dp8`` and ``dp2xtp2xpp2``, each a stage of its own and all three inside one
step, with the ``make train`` model (the ``tiny`` preset), run rank by rank in a fake process group
of 8 (:mod:`lightning_hotspa.testing.fake_world`; real tensors, collectives move no bytes). Checked:
every rank completes the step (its own pipeline stages, the switches between the layouts, the
gradient reduction, the metrics gather), and the point-to-point bytes each rank receives across its
pp boundary (:func:`~lightning_hotspa.testing.comm_bytes.count_collective_bytes`) are exactly the
schedule's activations forward and their gradients backward: micro-batches x padded tokens / tp x
hidden x 4 bytes, with its pp peer only.

Under ``FakeTensorMode`` the pipeline schedule runs too (:func:`test_7b_pipeline_under_fake_tensor_mode`,
the 7B shapes); the full step does not: its metrics gather reads the loss (``float``), which a fake
tensor does not hold.
"""

from __future__ import annotations

import zlib

import torch

from lightning_hotspa.layout import Layout
from lightning_hotspa.models import LlamaConfig

LAYOUTS = ["tp4xpp2", "dp8", "dp2xtp2xpp2"]
CONFIG = LlamaConfig.preset("tiny")  # what `make train` trains
#: 32 documents of make-train-like lengths (tokens_per_rank 256: the longest fits a tp4 micro-batch)
LENGTHS = [(37 * k) % 200 + 17 for k in range(32)]
WORLD = 8


def _stage(name: str, doc_ids: list[int], per_mb: int):
    from lightning_hotspa.plan import Stage

    lay = Layout.parse(name)
    groups = [doc_ids[i::lay.dp] for i in range(lay.dp)]
    return Stage(lay, tuple(tuple(tuple(g[j:j + per_mb]) for j in range(0, len(g), per_mb)) for g in groups),
                 label=name)


def plans():
    """One plan per layout (every document), and one that switches among the three inside one step."""
    from lightning_hotspa.plan import StepPlan

    every = list(range(len(LENGTHS)))
    out = {name: StepPlan(0, tuple(LENGTHS), (_stage(name, every, 4),)) for name in LAYOUTS}
    out["switch"] = StepPlan(1, tuple(LENGTHS), (_stage("tp4xpp2", every[0::3], 2), _stage("dp8", every[1::3], 1),
                                                 _stage("dp2xtp2xpp2", every[2::3], 2)))
    return out


def _marks(log):
    """StepHooks that note where each stage's collectives begin in ``log`` (``.starts``)."""
    from lightning_hotspa.engine.step_runner import StepHooks

    class Marks(StepHooks):
        starts: list[int] = []

        def enter_stage(self, stage) -> None:
            self.starts.append(len(log.calls))

    hooks = Marks()
    hooks.starts = []
    return hooks


def run_rank(rank: int, schedule: str) -> dict:
    """Rank ``rank`` of the fake world: each plan's step; per plan and stage the pp-boundary bytes."""
    from lightning_hotspa.engine.home import build_home_parameters
    from lightning_hotspa.engine.step_runner import StepRunner
    from lightning_hotspa.engine.switch import SwitchEngine
    from lightning_hotspa.mesh import WorldMesh
    from lightning_hotspa.parallel.model import ParallelModel
    from lightning_hotspa.plan import slice_plan
    from lightning_hotspa.testing.comm_bytes import count_collective_bytes
    from lightning_hotspa.testing.fake_world import FakeWorld, static_pipeline_votes
    from lightning_hotspa.tools.memory import _Wrapped, llama_roles_and_shardings

    g = torch.Generator().manual_seed(zlib.crc32(b"reference-7b"))
    docs = [torch.randint(0, CONFIG.vocab_size, (n,), generator=g) for n in LENGTHS]
    out: dict = {}
    with FakeWorld(WORLD, rank), static_pipeline_votes():
        world = WorldMesh([Layout.parse(x) for x in LAYOUTS])
        torch.manual_seed(0)
        module = _Wrapped(CONFIG)
        init = {n: p.detach().clone() for n, p in module.named_parameters()}
        roles, shardings = llama_roles_and_shardings(module, CONFIG, Layout.parse("tp4xpp2"), world)
        home = build_home_parameters(world, shardings, lambda name, shape: init[name])
        parallel = ParallelModel(module, roles, world)
        parallel.restore(home)
        engine = SwitchEngine(world, shardings, home)
        runner = StepRunner(engine, parallel, pipeline_schedule=schedule)
        peers = {name: world.layout_groups(Layout.parse(name)).pp.ranks for name in LAYOUTS}
        for name, plan in plans().items():
            mine = slice_plan(plan, docs, world.shape, rank)
            with count_collective_bytes() as log:
                hooks = _marks(log)
                result = runner.run(mine, module, hooks)
            engine.clear_grad_store()
            bounds = [*hooks.starts, len(log.calls)]
            stages = []
            for k, stage in enumerate(mine.stages):
                calls = list(zip(log.calls[bounds[k]:bounds[k + 1]], log.ranks[bounds[k]:bounds[k + 1]]))
                p2p = [(c, r) for c, r in calls if c[0] in ("batch_isend_irecv", "isend", "irecv", "send", "recv")]
                stages.append({
                    "layout": str(stage.layout), "micro_batches": len(stage.micro_batches),
                    "padded_tokens": max((mb.num_tokens for mb in stage.micro_batches), default=0),
                    "p2p_calls": len(p2p), "p2p_bytes": sum(c[1] for c, _ in p2p),
                    "p2p_ranks": sorted({x for _, r in p2p for x in r}),
                    "pp_group": sorted(peers[str(stage.layout)]),
                    "collective_bytes": sum(c[1] for c, _ in calls)})
            out[name] = {"stages": stages, "records": len(result.records), "built": runner.pipeline.built}
    return out


def _check(results: dict[int, dict]) -> None:
    hidden, fp32 = CONFIG.hidden, 4
    for rank, res in results.items():
        for name, plan in res.items():
            assert plan["records"] == len(plan["stages"]), (rank, name)
            for st in plan["stages"]:
                lay = Layout.parse(st["layout"])
                if lay.pp == 1:
                    assert st["p2p_calls"] == 0, (rank, name, st)
                    continue
                # one boundary (pp2): forward activations in on the last stage, their gradients in
                # on the first; sequence parallel: a rank's tp share of the padded tokens
                want = st["micro_batches"] * st["padded_tokens"] // lay.tp * hidden * fp32
                assert st["p2p_bytes"] == want, (rank, name, st, want)
                assert st["p2p_ranks"] == st["pp_group"] and len(st["pp_group"]) == 2, (rank, name, st)
    # every pp boundary (pp group) of every layout: its two ranks together received 2 x the activations
    for name in results[0]:
        for k, st in enumerate(results[0][name]["stages"]):
            lay = Layout.parse(st["layout"])
            if lay.pp == 1:
                continue
            groups = {tuple(results[r][name]["stages"][k]["pp_group"]) for r in results}
            assert len(groups) == WORLD // 2
            for grp in groups:  # both ranks of a pp group run the same dp group's micro-batches
                own = results[grp[0]][name]["stages"][k]
                got = sum(results[r][name]["stages"][k]["p2p_bytes"] for r in grp)
                assert got == 2 * own["micro_batches"] * own["padded_tokens"] // lay.tp * hidden * fp32, (name, grp)


def test_reference_7b_strategies_run_on_8_fake_ranks():
    """tp4xpp2, dp8, dp2xtp2xpp2 (and a step switching among them) complete on every one of 8 fake
    ranks; the pp-boundary point-to-point bytes are exactly the activations and their gradients."""
    results = {rank: run_rank(rank, "1f1b") for rank in range(WORLD)}
    _check(results)
    assert results[0]["switch"]["built"] == 4  # tp4xpp2, dp2xtp2xpp2 alone, and in the switching step


def test_7b_pipeline_under_fake_tensor_mode():
    """At the 7B shapes (llama7b, 32 layers cut to 4 here for time) under ``FakeTensorMode``: a rank's
    pipeline stages of tp4xpp2 and dp2xtp2xpp2 run their micro-batches through torch's 1F1B schedule
    (forward, backward, P2P); the working parameters it materializes are its own stage's only."""
    from lightning_hotspa.engine.home import build_home_parameters
    from lightning_hotspa.engine.step_runner import StepHooks, StepRunner
    from lightning_hotspa.engine.switch import SwitchEngine
    from lightning_hotspa.host import set_host_reads
    from lightning_hotspa.mesh import WorldMesh
    from lightning_hotspa.parallel.model import ParallelModel
    from lightning_hotspa.plan import slice_plan
    from lightning_hotspa.testing.comm_bytes import count_collective_bytes
    from lightning_hotspa.testing.fake_world import (
        FakeWorld,
        fake_mode,
        host_reads_real,
        is_fake,
        static_pipeline_votes,
    )
    from lightning_hotspa.tools.memory import _empty_shard, _Wrapped, llama_roles_and_shardings

    config = LlamaConfig.preset("llama7b", n_layers=4)
    lengths = [1024, 768, 512, 1024] * 2
    docs = [torch.zeros(n, dtype=torch.int64) for n in lengths]
    for rank in (0, 7):  # the first stage (embedding) and the last (loss head)
        with FakeWorld(WORLD, rank), static_pipeline_votes():
            world = WorldMesh([Layout.parse(x) for x in LAYOUTS])
            with torch.device("meta"):
                module = _Wrapped(config)
            roles, shardings = llama_roles_and_shardings(module, config, Layout.parse("tp4xpp2"), world)
            sliced = {name: slice_plan(plans_for(name, lengths), docs, world.shape, rank)  # real metadata
                      for name in ("tp4xpp2", "dp2xtp2xpp2")}
            previous = set_host_reads(host_reads_real)
            try:
                with fake_mode():
                    module.to_empty(device="cpu")
                    home = build_home_parameters(world, shardings, None, init_shard=_empty_shard)
                    parallel = ParallelModel(module, roles, world)
                    parallel.restore(home)
                    engine = SwitchEngine(world, shardings, home, working_dtype=torch.bfloat16,
                                          grad_accum_dtype=torch.float32)
                    runner = StepRunner(engine, parallel)
                    for name, plan in sliced.items():
                        layout = Layout.parse(name)
                        stage = plan.stages[0]
                        runner.enter(stage)
                        parallel.activate(layout, engine.working)
                        held = {n for n, p in engine.working.items() if p.untyped_storage().nbytes()}
                        last = rank >= WORLD // 2
                        assert ("model.output.weight" in held) == last and \
                               ("model.tok_embeddings.weight" in held) != last, (rank, name)
                        with count_collective_bytes() as log:
                            loss = runner._run_pipeline(stage, plan, 1.0, StepHooks())
                        assert is_fake(loss)
                        grads = [engine.working_grad(n) for n in held]  # fp32 main grads of its stage
                        assert all(g is not None and is_fake(g) and g.dtype == torch.float32 for g in grads), \
                            (rank, name)
                        p2p = sum(b for n, b in log.calls if n == "batch_isend_irecv")
                        assert p2p == len(stage.micro_batches) * 1024 // layout.tp * config.hidden * 2, (rank, name)
                        parallel.restore(home)
                        engine.release()
                        engine.clear_grad_store()
            finally:
                set_host_reads(previous)


def plans_for(name: str, lengths: list[int]):
    from lightning_hotspa.plan import StepPlan

    return StepPlan(0, tuple(lengths), (_stage(name, list(range(len(lengths))), 1),))
