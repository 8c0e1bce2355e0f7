"""Block stages (docs/DESIGN.md §4, "Blocks"): blocks of their own layouts, working copies (sharded over
the block's own ranks or replicated), micro-batch streams and checkpointing modes at once, then one
joint gradient reduction, against the single process on 4 and 8 ranks."""

import functools

import pytest
from helpers import BLOCK_LAYOUTS, BLOCK_SHAPES, LENGTHS, SMALLISH, block_plans, fit_and_compare, tiny_lm, worst

from lightning_hotspa.layout import Layout
from lightning_hotspa.plan import StepPlan


def run_blocks(world: int, precision: str, kv_heads: int | None = None):
    """:func:`fit_and_compare` over :func:`block_plans` (one AdamW step per plan, a real Trainer);
    ``kv_heads``: a tiny model with that many kv heads (1: fewer than every block's cp)."""
    plans = block_plans(world)
    return fit_and_compare(BLOCK_LAYOUTS[world], len(plans), precision, plans=plans,
                           make_model=functools.partial(tiny_lm, kv_heads=kv_heads))


def _check(result, grad_tol, loss_tol, weight_tol, steps):
    assert result["global_step"] == steps
    for step, errors in enumerate(result["grads"]):
        assert worst(errors)[1] <= grad_tol, (step, worst(errors))
    assert max(result["losses"]) <= loss_tol, result["losses"]
    assert worst(result["weights"])[1] <= weight_tol, worst(result["weights"])


@pytest.mark.parametrize("world, precision", [
    (4, "32-true"),
    pytest.param(4, "64-true", marks=pytest.mark.slow),
    pytest.param(8, "32-true", marks=pytest.mark.slow),
    pytest.param(8, "64-true", marks=pytest.mark.slow),
])
def test_block_stages_match_single_process(ranks, world, precision):
    """fp32: per step the gradients equal the single process's on the same weights (1e-5), with one
    kv head (fewer than every block's cp); fp64: the whole trajectory matches (1e-10)."""
    steps = len(BLOCK_SHAPES[world])
    if precision == "32-true":
        _check(ranks(world).run(run_blocks, world, precision, 1)[0], 1e-5, 1e-5, 1e-4, steps)
    else:
        _check(ranks(world).run(run_blocks, world, precision)[0], 1e-10, 1e-12, 1e-9, steps)


class _BlockWatch:
    """Every collective a rank issues inside each block stage, from its compute until its joint
    reduction (StepHooks' before_compute -> enter_phase("reduce"))."""

    def __init__(self) -> None:
        from lightning_hotspa.testing.comm_bytes import count_collective_bytes

        self._count, self._ctx, self.stage = count_collective_bytes, None, None
        self.calls: list[tuple[str, str, tuple[int, ...]]] = []  # (block note, collective, its ranks)

    def enter_stage(self, stage) -> None:
        self.stage = stage

    def enter_micro_batch(self, micro_batch) -> None: ...

    def before_compute(self, stage) -> None:
        if stage.block_note:
            self._ctx = self._count()
            self._log = self._ctx.__enter__()

    def enter_phase(self, phase) -> None:
        if phase == "reduce" and self._ctx is not None:
            self._ctx.__exit__(None, None, None)
            self._ctx = None
            self.calls += [(self.stage.block_note, c[0], tuple(r)) for c, r in zip(self._log.calls, self._log.ranks)]

    def compute_context(self):
        import contextlib

        return contextlib.nullcontext()

    def record_loss(self, loss, micro_batch) -> None: ...

    def backward(self, scaled_loss) -> None:
        scaled_loss.backward()


def run_block_containment() -> list[tuple[str, str, tuple[int, ...]]]:
    """The 4-rank block plans 0 and 2 (sharded cp2 blocks beside sharded and replicated dp blocks)
    through a StepRunner under :class:`_BlockWatch`: this rank's collectives inside its block stages."""
    import torch.distributed as dist
    from helpers import TinyLlama, make_docs, setup_runner

    from lightning_hotspa.engine.step_runner import StepRunner
    from lightning_hotspa.plan import slice_plan

    module, world, home, parallel, engine = setup_runner(BLOCK_LAYOUTS[4], TinyLlama())
    runner = StepRunner(engine, parallel)
    out = []
    for plan in block_plans(4)[0:3:2]:
        mine = slice_plan(plan, make_docs(plan.step, plan.doc_lengths), world.shape, dist.get_rank())
        watch = _BlockWatch()
        runner.run(mine, module, watch)
        engine.clear_grad_store()
        out += watch.calls
    return out


def test_every_collective_of_a_block_stays_inside_it(ranks):
    """Deadlock-free by construction: between a block stage's compute and its joint reduction a
    rank joins only collectives over ranks of its own block (the sharded blocks' unit gathers and
    reduce-scatters, the cp and tp collectives, are seen: not vacuous)."""
    import re

    per_rank = ranks(4).run(run_block_containment)
    seen = 0
    for rank, calls in enumerate(per_rank):
        for note, name, group in calls:
            lo, hi = map(int, re.search(r"ranks (\d+)-(\d+)", note).groups())
            assert rank in group and set(group) <= set(range(lo, hi + 1)), (rank, note, name, group)
        seen += len(calls)
    assert all(any(n.startswith("1/") and "sharded" in n for n, _, _ in calls) for calls in per_rank[:2])
    assert seen > 0


def test_memory_model_and_estimator_agree_on_a_sharded_block():
    """A block sharded over its own 2 ranks costs parameters / 2 ranks: ``hotspa memory``'s estimator,
    running rank 0's cp2:kv block for real (FakeTensorMode; its copy from home and its gradients into
    home through the joint exchange), peaks within 2 % of the memory model's block term."""
    from lightning_hotspa.planner.cost.cost_model import AnalyticCostModel
    from lightning_hotspa.tools.memory import estimate_layout

    peers = ("dp2xcp2:kv:fsdp2",) * 2 + ("dp4", "dp4")
    got = estimate_layout(SMALLISH, 4, peers[0], 1024, peers=peers, overlap=False, bucket_bytes=1)
    lay, cm = Layout.parse(peers[0]), AnalyticCostModel(SMALLISH, "H100", 4)
    assert abs(got["peak_bytes"] / cm.peak_bytes(lay, False, 1024, mixed_tp=True) - 1) < 0.02
    # the working copy and its main grads: twice the world-sharded copy's per rank (2 ranks, not 4)
    assert cm.memory(lay, False).working == pytest.approx(2 * cm.memory(Layout.parse("dp2xcp2:kv:fsdp"), False).working)


def ladder_plans() -> list[StepPlan]:
    """The ladder planner's own block plans (planner/solve/ladder.py) over :data:`LENGTHS` on 4 ranks:
    the candidates declare every block layout (priced as llama7b on H100 with 36 tokens per rank and no
    checkpointing, so the longest documents need a cp2 block beside dp blocks)."""
    from lightning_hotspa.planner.solve.solver import CostModelPlanner

    planner = CostModelPlanner(BLOCK_LAYOUTS[4], model="llama7b", hardware="H100", world_size=4,
                               tokens_per_rank=36, activation_checkpointing="none")
    plans = [planner.plan_ladder(step, LENGTHS[step % len(LENGTHS)]) for step in range(2)]
    assert all(p is not None and len({b.layout for b in p.stages[0].blocks}) > 1 for p in plans), plans
    return plans


def run_ladder(precision: str):
    return fit_and_compare(BLOCK_LAYOUTS[4], 2, precision, plans=ladder_plans())


def test_the_planners_ladder_matches_single_process(ranks):
    """A planner-made block plan (a cp2 block beside a dp block, each on its own stream) trains like
    the single process: fp32 gradients per step at 1e-5."""
    _check(ranks(4).run(run_ladder, "32-true", timeout_s=900)[0], 1e-5, 1e-5, 1e-4, 2)
