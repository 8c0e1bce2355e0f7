"""Runs of gradient-sharing stages leave the dp groups free: what the planner packs around.

Within a run of consecutive stages of one tp degree with replicated working copies (e.g. ``dp2xcp2``
then ``dp4``), a switch moves nothing, the gradients reduce once at the run's last stage, and each
micro-batch's collectives stay inside its tp x cp group. So between the run's first micro-batch and
its reduction no collective spans dp groups, and a dp group done with its share of one stage starts
the next stage at once while another dp group is still busy. These tests hold the runtime to that:
the wrapped collectives' ranks (every one inside the rank's tp x cp group of its stage), the causal
effect (a dp group overtakes a sleeping one), and the gradient of a run whose last stage leaves a dp
group empty (those ranks never start the overlapped reduction) against the single process.

All checks share one 4-rank spawn (module fixture). The same invariant for a ``dp2xcp2`` -> ``dp4``
run with empty dp4 groups is covered under Lightning by
``test_strategy.py::test_mixed_plans_over_every_layout_match_single_process`` (step 2's plan).
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from helpers import TinyLlama, setup_runner

from lightning_hotspa.engine.step_runner import StepHooks, StepRunner
from lightning_hotspa.layout import Layout
from lightning_hotspa.plan import Stage, StepPlan, pack_micro_batch, slice_plan
from lightning_hotspa.testing.comm_bytes import count_collective_bytes

#: seconds each rank of the cp stage's dp group 0 sleeps per micro-batch (2 micro-batches)
SLEEP_S = 0.5


class _RunWatch(StepHooks):
    """Every collective from the run's first compute until its reduction begins, by stage, and
    clock readings; the plan is one run, so a reduction in any stage but the last is a defect."""

    def __init__(self, plan) -> None:
        self.last = plan.stages[-1].label
        self.stage, self._ctx, self.log = None, None, None
        self.segments: list[tuple[str, int]] = []  # (stage label, index of its first call in the log)
        self.reductions: list[str] = []  # the stage in which each reduction began
        self.times: dict[tuple[str, str], float] = {}

    def enter_stage(self, stage) -> None:
        self.stage = stage.label
        if self._ctx is not None:
            self.segments.append((stage.label, len(self.log.calls)))

    def before_compute(self, stage) -> None:
        self.times["compute", stage.label] = time.monotonic()
        if self._ctx is None and not self.segments:  # the run's first compute: start listening
            self._ctx = count_collective_bytes()
            self.log = self._ctx.__enter__()
            self.segments.append((stage.label, 0))

    def backward(self, scaled_loss) -> None:
        scaled_loss.backward()
        self.times["backward_end", self.stage] = time.monotonic()

    def reduction_begins(self) -> None:
        """The engine's overlapped reduction (before a stage's last backward) or the reduce phase."""
        if not self.reductions or self.reductions[-1] != self.stage:
            self.reductions.append(self.stage)
        if self.stage == self.last:  # an earlier reduction keeps being recorded: its collectives fail
            self.close()

    def enter_phase(self, phase) -> None:
        if phase == "reduce":
            self.reduction_begins()

    def close(self) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(None, None, None)
            self._ctx = None

    def calls(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """(stage label, collective, its ranks) in issue order."""
        if self.log is None:
            return []
        ends = [start for _, start in self.segments[1:]] + [len(self.log.calls)]
        return [(label, self.log.calls[i][0], self.log.ranks[i])
                for (label, start), end in zip(self.segments, ends) for i in range(start, end)]


def _plan(world, stages, lengths, seed):
    """``stages``: (layout, {global rank: micro-batch count}); each micro-batch gets the next document."""
    doc, out = 0, []
    for name, per_rank in stages:
        lay = Layout.parse(name)
        groups: list[list[tuple[int, ...]]] = [[] for _ in range(lay.dp)]
        owner = {}  # dp group -> one of its ranks, whose count the group gets
        for rank, count in per_rank.items():
            owner.setdefault(world.shape.rank_coords(lay, rank)[0], count)
        for g in range(lay.dp):
            for _ in range(owner.get(g, 0)):
                groups[g].append((doc,))
                doc += 1
        out.append(Stage(lay, tuple(tuple(g) for g in groups), label=name))
    assert doc == len(lengths), (doc, lengths)
    gen = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, 260, (n,), generator=gen) for n in lengths]
    plan = StepPlan(0, tuple(lengths), tuple(out))
    return plan, docs, slice_plan(plan, docs, world.shape, world.rank)


def _run(layouts, stages, lengths, seed, sleepy=None):
    """One StepRunner step (overlapped, shared reductions: the strategy's defaults) under a watch;
    ``sleepy``: (stage label, dp index) whose ranks sleep before each of that stage's micro-batches."""
    module, world, home, parallel, engine = setup_runner(layouts, TinyLlama())
    plan, docs, mine = _plan(world, stages, lengths, seed)
    watch = _RunWatch(mine)
    overlap = engine.overlap_next_backward

    def overlap_then_record():
        watch.reduction_begins()
        overlap()

    engine.overlap_next_backward = overlap_then_record
    sleeps = sleepy is not None and world.shape.rank_coords(Layout.parse(sleepy[0]), world.rank)[0] == sleepy[1]

    def loss_fn(mb):
        if sleeps and watch.stage == sleepy[0]:
            time.sleep(SLEEP_S)
        return module(mb)

    try:
        StepRunner(engine, parallel).run(mine, loss_fn, watch)
    finally:
        watch.close()
    engine.assign_home_grads()
    grads = {n: p.grad.full_tensor() for n, p in home.items()}  # every rank gathers
    shape, rank = world.shape, world.rank
    allowed = {s.label: shape.group_ranks(rank, range(shape.prefix_length(s.layout.tp * s.layout.cp)))
               for s in plan.stages}
    tp_groups = {s.label: shape.group_ranks(rank, shape.tp_dims(s.layout)) for s in plan.stages}
    return {"calls": watch.calls(), "allowed": allowed, "tp_group": tp_groups, "reductions": watch.reductions,
            "times": watch.times, "dp_index": {s.label: shape.rank_coords(s.layout, rank)[0] for s in plan.stages},
            "micro_batches": {s.label: len(s.micro_batches) for s in mine.stages},
            "grads": grads, "plan": plan, "docs": docs}


def run_free_runs() -> dict:
    # cp-descending tp-1 run: dp2xcp2's dp group 0 has 2 micro-batches (and sleeps), group 1 one;
    # in dp4 rank 2 (of cp group 1) has 2, rank 3 none (it never starts the overlapped reduction)
    cp_run = _run(["dp2xcp2", "dp4"], [("dp2xcp2", {0: 2, 2: 1}), ("dp4", {0: 1, 1: 1, 2: 2, 3: 0})],
                  [24, 17, 30, 12, 19, 9, 14], seed=1, sleepy=("dp2xcp2", 0))
    # tp-2 run: tp2xcp2 (one dp group), then dp2xtp2 with one dp group empty
    tp_run = _run(["tp2xcp2", "dp2xtp2"], [("tp2xcp2", {0: 2}), ("dp2xtp2", {0: 2, 3: 0})],
                  [26, 15, 21, 18], seed=2)
    out = {"cp": cp_run, "tp": tp_run}
    if dist.get_rank() == 0:
        reference = TinyLlama()  # the same seed: the same initial weights, single process
        reference(pack_micro_batch(tp_run["docs"])).backward()  # token mean over every document
        out["reference"] = {n: p.grad for n, p in reference.named_parameters()}
    for run in (cp_run, tp_run):
        del run["docs"], run["plan"]
        if run is cp_run or dist.get_rank() != 0:  # the cp run's invariant: test_strategy's (module doc)
            del run["grads"]
    return out


@pytest.fixture(scope="module")
def free_runs(ranks):
    return ranks(4).run(run_free_runs, timeout_s=120)


def test_a_free_run_issues_no_collective_across_dp_groups(free_runs) -> None:
    """Between a run's first compute and its reduction every collective stays inside the rank's
    tp x cp group of its stage (dp4: none at all; dp2xtp2: the tp pair), and the run reduces once,
    in its last stage. Not vacuous: the cp and tp stages' own collectives are seen."""
    for key, last in (("cp", "dp4"), ("tp", "dp2xtp2")):
        for rank, per_rank in enumerate(free_runs):
            run = per_rank[key]
            crossing = [c for c in run["calls"] if not set(c[2]) <= set(run["allowed"][c[0]])]
            assert not crossing, (key, rank, crossing)
            assert run["reductions"] == [last], (key, rank, run["reductions"])
            stages = {label for label, _, _ in run["calls"]}
            if key == "cp":
                assert "dp2xcp2" in stages and "dp4" not in stages, (rank, run["calls"])
            elif run["micro_batches"]["dp2xtp2"]:  # its forwards' tp collectives, in the tp pair
                tp_calls = [ranks for label, _, ranks in run["calls"] if label == "dp2xtp2"]
                assert tp_calls and all(r == tuple(sorted(run["tp_group"]["dp2xtp2"])) for r in tp_calls), tp_calls


def test_a_dp_group_done_with_a_stage_starts_the_next_while_another_is_busy(free_runs) -> None:
    """Causal: dp2xcp2's dp group 0 sleeps 2 x SLEEP_S in its micro-batches; the ranks of group 1
    start computing dp4 while group 0 is still in dp2xcp2 (any sync between the stages, seen by the
    wrapper or not, would hold them back). One machine: the monotonic clocks compare."""
    cp = [per_rank["cp"] for per_rank in free_runs]
    busy = [r for r in cp if r["dp_index"]["dp2xcp2"] == 0]
    free = [r for r in cp if r["dp_index"]["dp2xcp2"] == 1]
    assert len(busy) == len(free) == 2
    busy_done = min(r["times"]["backward_end", "dp2xcp2"] for r in busy)
    free_in_dp4 = max(r["times"]["compute", "dp4"] for r in free)
    assert busy_done - free_in_dp4 >= SLEEP_S, (busy_done, free_in_dp4)


def test_a_tp_run_with_an_empty_dp_group_in_its_last_stage_matches_single_process(free_runs) -> None:
    """tp2xcp2 then dp2xtp2 with dp group 1 empty in the last stage: those ranks carry tp2xcp2's
    gradients straight into the reduction without an overlapped backward; the update's input equals
    the single-process gradient of the same documents (token-mean loss, fp32)."""
    ours, reference = free_runs[0]["tp"]["grads"], free_runs[0]["reference"]
    assert any(not r["tp"]["micro_batches"]["dp2xtp2"] for r in free_runs)  # an empty dp group
    assert set(ours) == set(reference)
    for name, g in reference.items():
        err = float((ours[name] - g).norm() / g.norm())
        assert err <= 1e-5, (name, err)
