"""The engine's step runner without Lightning: the timing seam it reads, its non-finite seam, its
reduction options, and the typed seams around it (planner protocol, planning context, hardware)."""

from __future__ import annotations

import contextlib
import types

import pytest
import torch
import torch.distributed as dist
from helpers import TinyLlama, setup_runner, uneven_plan
from torch import nn

from lightning_hotspa.activation_checkpointing import Checkpointing
from lightning_hotspa.engine.records import StageRecord
from lightning_hotspa.engine.step_runner import StepHooks, StepRunner
from lightning_hotspa.engine.timing import HostClock, clock_for
from lightning_hotspa.layout import Layout, MeshShape
from lightning_hotspa.plan import Stage, StepPlan, slice_plan


def _rank_plan(world, layouts, step=0):
    lengths = [9, 5, 7, 6, 12, 4, 8, 10, 16, 8, 6, 12]
    share = len(lengths) // len(layouts)
    stages = []
    for i, name in enumerate(layouts):
        lay = Layout.parse(name)
        ids = list(range(i * share, (i + 1) * share))
        groups = tuple(tuple((d,) for d in ids[g::lay.dp]) for g in range(lay.dp))
        stages.append(Stage(lay, groups, label=f"s{i}"))
    plan = StepPlan(step, tuple(2 * n for n in lengths), tuple(stages))
    g = torch.Generator().manual_seed(step)
    docs = [torch.randint(0, 32, (2 * n,), generator=g) for n in lengths]
    return slice_plan(plan, docs, world.shape, world.rank)


class FakeClock:
    """Marks are 0, 1, 2, ...; every interval between consecutive marks is 10 s."""

    def __init__(self) -> None:
        self.count = -1

    def mark(self) -> int:
        self.count += 1
        return self.count

    def seconds(self, start: int, end: int) -> float:
        return 10.0 * (end - start)


@pytest.fixture
def world_of_one(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_stage_seconds_come_from_the_runners_clock(world_of_one) -> None:
    """Two stages in one layout share gradients: the first does not reduce (0 s), the second does."""
    module, world, home, parallel, engine = setup_runner(["dp1"])
    cpu = iter([1.0, 1.5, 4.0, 6.0])
    runner = StepRunner(engine, parallel, clock=FakeClock(), cpu_clock=lambda: next(cpu))
    result = runner.run(_rank_plan(world, ["dp1", "dp1"]), module)
    first, second = result.stages
    assert (first.switch_s, first.compute_s, first.reduce_s) == (10.0, 10.0, 0.0)
    assert (second.switch_s, second.compute_s, second.reduce_s) == (10.0, 10.0, 10.0)
    assert (first.compute_cpu_s, second.compute_cpu_s) == (0.5, 2.0)
    assert [r.stage_s for r in result.records] == [20.0, 30.0]
    # step = its stages + what lies between them (one fake-clock tick before each stage)
    assert result.between_s == 20.0 and result.step_s == 50.0 + result.between_s
    assert first.reduce_collectives == 0 and engine.grad_store  # the run reduced once, into the store
    assert isinstance(clock_for("cpu"), HostClock)


def test_a_non_finite_loss_goes_to_the_callers_policy(world_of_one) -> None:
    module, world, home, parallel, engine = setup_runner(["dp1"])
    calls = []

    def policy(loss, plan) -> bool:
        calls.append((float(loss), plan.step))
        return True

    runner = StepRunner(engine, parallel)
    ok = runner.run(_rank_plan(world, ["dp1"], step=3), module, on_nonfinite=policy)
    assert ok.finite and not ok.skip_update and not calls and engine.grad_store
    engine.clear_grad_store()
    bad = runner.run(_rank_plan(world, ["dp1"], step=4), lambda mb: module(mb) * float("nan"), on_nonfinite=policy)
    assert not bad.finite and bad.skip_update and len(calls) == 1 and calls[0][1] == 4
    assert not engine.grad_store  # nothing of the bad step reaches the optimizer


def test_hooks_see_every_stage_and_micro_batch(world_of_one) -> None:
    module, world, home, parallel, engine = setup_runner(["dp1"])
    seen = []

    class Recorder(StepHooks):
        def enter_stage(self, stage):
            seen.append(("stage", stage.label))

        def before_compute(self, stage):
            seen.append(("compute", stage.label))

        def compute_context(self):
            seen.append(("context",))
            return contextlib.nullcontext()

        def backward(self, scaled_loss):
            seen.append(("backward",))
            scaled_loss.backward()

    plan = _rank_plan(world, ["dp1", "dp1"])
    StepRunner(engine, parallel).run(plan, module, Recorder())
    per_stage = [len(s.micro_batches) for s in plan.stages]
    assert seen == [x for i, n in enumerate(per_stage)
                    for x in [("stage", f"s{i}"), ("compute", f"s{i}")] + [("context",), ("backward",)] * n]


def test_one_layout_runs_a_checkpointed_and_a_plain_stage_back_to_back(world_of_one) -> None:
    """What the planner's split checkpointing emits: two stages of one layout, only the first
    recomputing activations; the gradients equal one plain stage of the same documents."""
    lengths = [9, 5, 7, 6, 12, 4, 8, 10]
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, 32, (2 * n,), generator=g) for n in lengths]
    dp1 = Layout.parse("dp1")

    def grads(stages):
        module = TinyLlama()
        _, world, home, parallel, engine = setup_runner(["dp1"], module)
        seen = []

        class Spy(StepHooks):
            def before_compute(self, stage):
                seen.append(module.model.activation_checkpointing)

        plan = StepPlan(0, tuple(2 * n for n in lengths), tuple(stages))
        result = StepRunner(engine, parallel).run(slice_plan(plan, docs, world.shape, world.rank), module, Spy())
        engine.assign_home_grads()
        return {n: p.grad.full_tensor() for n, p in home.items()}, seen, result

    split, seen, result = grads([Stage(dp1, (((0, 1), (2,)),), True), Stage(dp1, (((3, 4, 5), (6, 7)),), False)])
    plain, _, _ = grads([Stage(dp1, (((0, 1), (2,), (3, 4, 5), (6, 7)),), False)])
    full, none = Checkpointing.FULL, Checkpointing.NONE
    assert seen == [full, none] and [s.activation_checkpointing for s in result.stages] == [full, none]
    assert result.stages[0].reduce_collectives == 0  # same layout: one reduction, at the second stage
    for name, g in plain.items():
        assert torch.allclose(split[name], g, rtol=1e-5, atol=1e-7), name


def test_metrics_of_a_layout_split_into_two_stages_keep_both(world_of_one) -> None:
    """A plan with ``dp1+ac, dp1`` (the cost planner's split checkpointing): each stage gets its own
    metric keys (by bucket), the per-stage tokens add up to the step's, and the plan text counts each stage."""
    import dataclasses

    from lightning_hotspa.adapter.observability.callbacks import plan_text
    from lightning_hotspa.adapter.observability.stats import monitor_metrics, step_metrics

    lengths = [9, 5, 7, 6, 12, 4, 8, 10]
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, 32, (2 * n,), generator=g) for n in lengths]
    dp1, module = Layout.parse("dp1"), TinyLlama()
    _, world, home, parallel, engine = setup_runner(["dp1"], module)
    plan = StepPlan(0, tuple(2 * n for n in lengths), (Stage(dp1, (((0, 1), (2,)),), True, "short"),
                                                        Stage(dp1, (((3, 4), (5,), (6, 7)),), False, "long")))
    batch = slice_plan(plan, docs, world.shape, world.rank)
    result = StepRunner(engine, parallel).run(batch, module)
    records = [dataclasses.replace(r, predicted_s=float(r.order + 1)) for r in result.records]
    metrics, monitor = step_metrics(records), monitor_metrics(records, result.step_s, None, None)
    first, second = records
    assert (metrics["hotspa/short/tokens"], metrics["hotspa/long/tokens"]) == (first.tokens, second.tokens)
    assert metrics["hotspa/short/tokens"] + metrics["hotspa/long/tokens"] == sum(2 * n for n in lengths)
    assert (metrics["hotspa/short/documents"], metrics["hotspa/long/documents"]) == (3, 5)
    assert (monitor["hotspa/short/predicted_s"], monitor["hotspa/long/predicted_s"]) == (1.0, 2.0)
    assert metrics["hotspa/tokens"] == sum(2 * n for n in lengths)
    assert plan_text(batch, records) == "short->dp1 x2, long->dp1 x3"


def _grads_under_options(overlap: bool, share: bool) -> dict:
    layouts = ["dp4", "dp2xtp2", "tp2xcp2"]  # the last two share gradients (same tp)
    module, world, home, parallel, engine = setup_runner(layouts, TinyLlama())
    StepRunner(engine, parallel, overlap=overlap, share_gradients=share).run(_rank_plan(world, layouts), module)
    engine.assign_home_grads()
    return {n: p.grad.full_tensor() for n, p in home.items()}


def run_option_grads() -> list:
    return [_grads_under_options(o, s) for o, s in ((True, True), (False, False))]


@pytest.mark.slow
def test_carry_out_sums_two_runs_before_reducing_them(world_of_one) -> None:
    """Gradient accumulation's seam: ``carry_out`` leaves the last stage unreduced and its working copy
    alive; the next run accumulates into it and reduces once, or an evaluation reduces it first."""
    module, world, home, parallel, engine = setup_runner(["dp1"])
    runner = StepRunner(engine, parallel)
    a, b = _rank_plan(world, ["dp1", "dp1"], step=1), _rank_plan(world, ["dp1"], step=2)
    runner.run(a, module)
    runner.run(b, module)
    separate = {n: g.clone() for n, g in engine.grad_store.items()}
    engine.clear_grad_store()
    runner.run(a, module, carry_out=True)
    assert runner.carried == (Layout.parse("dp1"),) and engine.active is not None and not engine.grad_store
    assert all(p is home[n] for n, p in module.named_parameters())  # Lightning sees home between batches
    runner.run(b, module)
    assert runner.carried is None and engine.active is None and separate.keys() == engine.grad_store.keys()
    assert all(torch.allclose(engine.grad_store[n], g, rtol=1e-6, atol=1e-8) for n, g in separate.items())
    engine.clear_grad_store()
    runner.run(a, module, carry_out=True)
    runner.run_forward(b, module)  # an evaluation inside the window: what was carried is reduced first
    assert runner.carried is None and engine.grad_store and all(
        g.abs().sum() > 0 for g in engine.grad_store.values())


def test_reduction_options_give_the_same_gradients(ranks) -> None:
    """Overlapped and shared reductions (the strategy's) equal a plain reduce per stage (calibration's)."""
    for per_rank in ranks(4).run(run_option_grads):
        reference = per_rank[1]
        for other in per_rank[:1]:
            for name, g in reference.items():
                assert torch.allclose(other[name], g, rtol=1e-6, atol=1e-7), name
        assert any(g.abs().sum() > 0 for g in reference.values())


class _StageTraffic(StepHooks):
    """Every collective of each stage's micro-batches (forward and backward), by layout."""

    def __init__(self) -> None:
        self.logs, self._open = {}, None

    def before_compute(self, stage) -> None:
        from lightning_hotspa.testing.comm_bytes import count_collective_bytes

        self._open = count_collective_bytes()
        self.logs[stage.layout.name] = self._open.__enter__()

    def enter_phase(self, phase) -> None:
        if self._open is not None:
            self._open.__exit__(None, None, None)
            self._open = None


def _calls(units) -> dict:
    return dict(units.collectives, prefetch=units.prefetches, backward_prefetch=units.backward_prefetches)


def run_fsdp_traffic() -> dict:
    layouts = ["dp4:fsdp", "dp4", "dp2xcp2:kv:fsdp"]
    module, world, home, parallel, engine = setup_runner(layouts, TinyLlama())
    runner = StepRunner(engine, parallel, overlap=False, share_gradients=False,  # no reductions in compute
                        activation_checkpointing=lambda layout: layout.cp > 1)
    traffic, units = _StageTraffic(), runner.units
    before = {}
    original = traffic.before_compute

    def before_compute(stage):
        before[stage.layout.name] = dict(units.bytes), _calls(units)
        original(stage)

    def enter_phase(phase):
        if traffic._open is not None:
            name = next(reversed(traffic.logs))
            nbytes, calls = before[name]
            now = _calls(units)
            before[name] = ({k: units.bytes[k] - nbytes[k] for k in units.bytes},
                            {k: now[k] - calls[k] for k in calls})
        _StageTraffic.enter_phase(traffic, phase)

    traffic.before_compute, traffic.enter_phase = before_compute, enter_phase
    plan = uneven_plan(world, layouts)
    result = runner.run(plan, module, traffic)
    out = {"units": len(units.units)}
    start = units.collectives["forward"]
    with torch.no_grad():
        runner.run_forward(plan, module)  # evaluation: idle rounds only gather
    out["eval_gathers"] = units.collectives["forward"] - start
    for stage in result.stages:
        name, log = stage.layout.name, traffic.logs[stage.layout.name]
        out[name] = {"log_bytes": log.bytes_received, "log_calls": [c for c, _ in log.calls],
                     "fsdp_bytes": before[name][0], "fsdp_calls": before[name][1],
                     "switch_bytes": stage.switch_bytes, "reduce_bytes": stage.reduce_bytes,
                     "stage_fsdp_bytes": stage.fsdp_bytes}
    from lightning_hotspa.adapter.observability.stats import stage_keys, step_metrics

    local = torch.tensor([float(s.fsdp_bytes) for s in result.stages], dtype=torch.float64)
    dist.all_reduce(local)  # every rank's bytes: what the records and the logged metrics carry
    metrics = step_metrics(result.records)
    keys = stage_keys(result.records)
    out["records_fsdp_mb"] = {r.layout.name: (r.fsdp_mb, local[i].item() / 1e6,
                                              metrics.get(f"hotspa/{keys[i]}/fsdp_MB"))
                              for i, r in enumerate(result.records)}
    return out


def run_odd_dims() -> tuple:
    """The same plan with sharded and with replicated working copies; ffn_hidden 178 splits over 2
    of the 4 ranks only, so home replicates those weights on one mesh dim (summed at the stage end)."""
    layouts = ["dp4:fsdp", "dp2xcp2:fsdp", "dp4", "dp2xcp2"]
    module, world, home, parallel, engine = setup_runner(layouts, TinyLlama(ffn_hidden=178))
    runner, grads = StepRunner(engine, parallel), []
    for names in (layouts[:2], layouts[2:]):
        runner.run(uneven_plan(world, names), module)
        engine.assign_home_grads()
        grads.append({n: p.grad.full_tensor() for n, p in home.items()})
        engine.clear_grad_store()
    homes = {n: engine.shardings[n].home_prefix for n in ("model.layers.0.feed_forward.w1.weight",
                                                          "model.layers.0.attention.wq.weight")}
    return grads, homes


def test_fsdp_with_dims_home_cannot_split_equals_replicated(ranks) -> None:
    (sharded, replicated), homes = ranks(4).run(run_odd_dims)[0]
    assert homes == {"model.layers.0.feed_forward.w1.weight": 1, "model.layers.0.attention.wq.weight": 2}
    for name, g in replicated.items():
        err = float((sharded[name] - g).norm() / g.norm())
        assert err <= 1e-6, (name, err)


def test_fsdp_stage_gathers_once_per_unit_and_round_and_counts_its_bytes(ranks) -> None:
    """dp4:fsdp with uneven dp groups (3 rounds: ranks of group 0 compute 3 micro-batches, the others
    1 plus 2 idle rounds): per round, one fused all-gather per unit in forward (all but the first
    prefetched by the previous unit's forward), one per re-gathered unit in backward (all but the
    first started by the previous re-gather), one reduce-scatter per unit; the engine's byte counts
    equal the wrapped collectives'; the replicated dp4 stage moves no parameter bytes inside its
    micro-batches; under activation checkpointing the recomputation re-gathers the blocks (not
    prefetched); evaluation's idle rounds gather as the busy ranks' forwards do."""
    results = ranks(4).run(run_fsdp_traffic)
    for r in results:
        units, sharded, replicated = r["units"], r["dp4:fsdp"], r["dp4"]
        assert units == 4  # embedding, 2 blocks, head (the tiny Llama)
        rounds = 3
        calls = sharded["fsdp_calls"]
        assert calls["forward"] == units * rounds and calls["reduce_scatter"] == units * rounds, calls
        assert calls["backward"] == (units - 1) * rounds, calls  # the embedding's backward needs no weight
        assert calls["prefetch"] == (units - 1) * rounds, calls  # each unit's forward starts the next's gather
        # the head's re-gather starts block 1's, block 1's starts block 0's (the embedding's backward
        # needs no weight: none is started for it)
        assert calls["backward_prefetch"] == (units - 2) * rounds, calls
        assert sharded["log_calls"].count("all_gather_into_tensor") == calls["forward"] + calls["backward"]
        assert sum(sharded["fsdp_bytes"].values()) == sharded["log_bytes"] == sharded["stage_fsdp_bytes"], sharded
        # at the stage end only the final norm reduces (outside every unit: a reduce-scatter of its
        # 64 fp32 over 4 ranks, 3/4 of it received); the replicated dp4 reduces everything there
        assert sharded["reduce_bytes"] == 64 * 4 * 3 // 4 < replicated["reduce_bytes"], sharded["reduce_bytes"]
        assert replicated["log_bytes"] == 0 and replicated["fsdp_bytes"] == dict.fromkeys(sharded["fsdp_bytes"], 0)
        assert r["eval_gathers"] == 2 * units * rounds  # both fsdp stages, busy or idle alike
        kv = r["dp2xcp2:kv:fsdp"]  # its KV gathers come on top of the units' traffic
        assert kv["log_bytes"] > sum(kv["fsdp_bytes"].values()) > 0
        for layout, (record_mb, summed_mb, logged_mb) in r["records_fsdp_mb"].items():
            assert record_mb == pytest.approx(summed_mb) and (record_mb > 0) == layout.endswith(":fsdp")
            assert logged_mb == (record_mb if layout.endswith(":fsdp") else None), (layout, logged_mb)
        # activation checkpointing: the blocks' recomputation gathers them again, inside its forward
        blocks = units - 2
        assert kv["fsdp_calls"] == {"forward": (units + blocks) * 3, "backward": 3,  # the head only
                                    "reduce_scatter": units * 3, "prefetch": (units - 1) * 3,
                                    "backward_prefetch": 0}, kv["fsdp_calls"]


class _TiedBlocks(nn.Module):
    """Two blocks in a ModuleList (the default units) that share one weight."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.blocks[1].weight = self.blocks[0].weight

    def forward(self, mb) -> torch.Tensor:
        return self.blocks[1](self.blocks[0](torch.ones(2, 8))).sum()


def test_fsdp_working_copies_sit_at_home_and_share_gradients_with_fsdp_peers_only() -> None:
    from lightning_hotspa.testing.fake_world import FakeWorld

    layouts = ["dp4:fsdp", "dp2xcp2:fsdp", "dp4", "dp2xtp2:fsdp", "dp2xtp2"]
    with FakeWorld(4):
        module, world, home, parallel, engine = setup_runner(layouts, TinyLlama())
        StepRunner(engine, parallel)  # registers the units: every parameter but the final norm
        assert engine.fsdp_names == set(home) - {"model.norm.weight"}
        engine.materialize(Layout.parse("dp2xtp2:fsdp"))
        for name, w in engine.working.items():
            sharding = engine.shardings[name]
            tp_replicated = sharding.role.tp_grad == "replicate"
            want = sharding.layout_prefix(Layout.parse("dp2xtp2")) if name == "model.norm.weight" or \
                tp_replicated else sharding.home_prefix
            assert tuple(w.shape) == sharding.local_shape(want), name
        engine.release()
        assert engine.shares_gradients(Layout.parse("dp4:fsdp"), Layout.parse("dp2xcp2:fsdp"))
        assert not engine.shares_gradients(Layout.parse("dp4:fsdp"), Layout.parse("dp4"))
        assert not engine.shares_gradients(Layout.parse("dp2xtp2:fsdp"), Layout.parse("dp2xtp2"))
        # sequence parallel: the norms' gradients are partial over tp too, so under plain fsdp every
        # parameter's gradient lands in its home shard in either tp degree: one reduction serves both
        assert engine.shares_gradients(Layout.parse("dp2xtp2:fsdp"), Layout.parse("dp4:fsdp"))


class _DeadBranch(nn.Module):
    """Three blocks; block 1 saves its weight but its output never reaches the loss."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])

    def forward(self, mb) -> torch.Tensor:
        x = self.blocks[0](torch.ones(2, 8, requires_grad=True))  # an input with a grad: saves the weight
        self.blocks[1](x)  # dead: its backward never unpacks
        return self.blocks[2](x).sum()


def test_fsdp_backward_prefetch_nobody_consumes_is_dropped_at_the_backward_end() -> None:
    """Backward re-gathers in reverse order of the forward's weight-saving units, each starting the
    next one's: block 2 starts block 1's, which never unpacks, so block 0 gathers on its own and
    block 1's stays in flight until ``end_backward`` finishes it (the next forward would too)."""
    from lightning_hotspa.testing.fake_world import FakeWorld

    with FakeWorld(4):  # collectives are no-ops: the order and counts are what is checked
        module, world, home, parallel, engine = setup_runner(["dp4:fsdp"], _DeadBranch())
        runner = StepRunner(engine, parallel)
        units = runner.units
        engine.materialize(Layout.parse("dp4:fsdp"))
        parallel.activate(world.layouts[0], engine.working)
        for micro_batch in range(2):
            with units.forward_prefetch():
                assert units.regather is None  # micro-batch 0's, dropped by the new forward
                loss = module(None)
            assert [units.previous_saver[u] for u in units.units] == [None, units.units[0], units.units[1]]
            loss.backward()
            assert units.regather is not None and units.regather[0] is units.units[1]
            assert units.backward_prefetches == micro_batch + 1
            assert units.collectives["backward"] == 3 * (micro_batch + 1)  # 2 gathered, 1 started
        units.end_backward()
        assert units.regather is None and units.previous_saver == {}
        parallel.restore(home)
        engine.release()
        seen, started = [], units.backward_prefetches

        class Watch(StepHooks):  # nothing in flight when a micro-batch or the stage end begins
            def enter_micro_batch(self, mb) -> None:
                seen.append(units.regather)

            def enter_phase(self, phase) -> None:
                seen.append(units.regather)

        plan = _rank_plan(world, ["dp4:fsdp"])
        runner.run(plan, module, Watch())  # the runner ends every backward
        rounds = plan.stages[0].num_rounds
        assert rounds == 3 and seen == [None] * (rounds + 2)  # + reduce, metrics
        assert units.backward_prefetches - started == rounds


def test_fsdp_layouts_refuse_what_they_cannot_shard() -> None:
    from lightning_hotspa.engine.fsdp import ShardedUnits
    from lightning_hotspa.layout import LayoutError
    from lightning_hotspa.testing.fake_world import FakeWorld

    with FakeWorld(4):  # collectives are no-ops: only the checks run
        module, world, home, parallel, engine = setup_runner(["dp4:fsdp", "dp4"])  # TinyLM: no blocks
        with pytest.raises(LayoutError,
                           match=r"\['dp4:fsdp'\] shard the working copy per unit, but TinyLM has no units"):
            StepRunner(engine, parallel)
        with pytest.raises(LayoutError, match="layout dp4:fsdp shards the working copy per unit, but no fsdp units"):
            engine.materialize(Layout.parse("dp4:fsdp"))
        with pytest.raises(LayoutError, match=r"fsdp units name parameters \['nope'\]"):
            engine.set_fsdp_units({"nope"})
        with pytest.raises(LayoutError, match="fsdp unit 'missing' is not a submodule of TinyLM"):
            ShardedUnits(engine, module, ["missing"])
        tied, _, _, _, engine = setup_runner(["dp4:fsdp"], _TiedBlocks())
        tied.blocks[1].weight = tied.blocks[0].weight  # installing the home params untied them: tie again
        with pytest.raises(LayoutError,
                           match=r"'blocks.1': parameter blocks.1.weight is shared \(also 'blocks.0.weight'\)"):
            ShardedUnits(engine, tied)
    with pytest.raises(LayoutError, match="fsdp shards the working copy over the dp and cp ranks, but dp = cp = 1"):
        Layout.parse("tp4:fsdp")


# ------------------------------------------------------------------ typed seams
def test_the_one_planner_check_names_what_is_missing() -> None:
    from lightning_hotspa.planner import (
        BalancedPlanner,
        CostModelPlanner,
        Planner,
        PlannerBase,
        PricedPlanner,
        ProfiledPlanner,
        StatefulPlanner,
        ThresholdPlanner,
        check_planner,
    )

    class Bare:
        layouts = (Layout(dp=1),)

        def plan(self, step, doc_lengths):
            raise NotImplementedError

    with pytest.raises(TypeError, match="lacks capacity, longest_document \\(") as err:
        check_planner(Bare(), "Test")
    assert "PlannerBase" in str(err.value)

    class Minimal(PlannerBase):
        layouts = (Layout(dp=1),)

        def capacity(self, layout):
            return 64

        def plan(self, step, doc_lengths, *, latest=False):
            raise NotImplementedError

    assert isinstance(check_planner(Minimal(), "Test"), Planner)
    assert Minimal().longest_document() == 64
    rule = ThresholdPlanner(["dp2", "tp2"], tokens_per_rank=64)
    assert check_planner(rule, "Test") is rule and rule.longest_document() == rule.buckets[-1].high
    # the optional protocols: what each planner offers beyond the core, checked with isinstance
    cost = CostModelPlanner(["dp2", "tp2"], model="tiny")
    optional = (PricedPlanner, StatefulPlanner, ProfiledPlanner, BalancedPlanner)
    assert [isinstance(Minimal(), p) for p in optional] == [False, False, False, False]
    assert [isinstance(rule, p) for p in optional] == [False, True, False, True]
    assert [isinstance(cost, p) for p in optional] == [True, True, True, False]
    assert not hasattr(cost, "hand_set_bounds") and rule.hand_set_bounds == ()


def test_the_datamodule_plans_with_the_strategys_context_only() -> None:
    from lightning_hotspa.data import HotSPaDataModule, TokenizedCorpus
    from lightning_hotspa.data.context import PlanningContext
    from lightning_hotspa.data.errors import DataError
    from lightning_hotspa.planner.rule import ThresholdPlanner

    layouts = ["dp2", "tp2"]
    planner, mesh = ThresholdPlanner(layouts, tokens_per_rank=64), MeshShape.for_layouts(layouts, 2)
    context = PlanningContext(planner, mesh, 1, 2)

    class Provider:
        def planning_context(self):
            return context

    corpus = TokenizedCorpus.from_token_arrays([torch.arange(n).numpy() for n in (30, 50, 90)])
    dm = HotSPaDataModule(corpus, tokens_per_batch=256, context_length=100)
    dm.trainer = types.SimpleNamespace(strategy=Provider(), global_rank=1, world_size=2)
    assert dm._planning() is context
    # a strategy that merely has planner / mesh_shape attributes is not asked
    dm.trainer = types.SimpleNamespace(strategy=types.SimpleNamespace(planner=planner, mesh_shape=mesh),
                                       global_rank=0, world_size=2)
    with pytest.raises(DataError, match="planning_context"):
        dm._planning()


def test_cost_planner_follows_the_accelerator(monkeypatch) -> None:
    from lightning_hotspa.adapter.lightning.planner_factory import hardware_for
    from lightning_hotspa.planner.cost.hardware import profile_for_device

    assert hardware_for(None, torch.device("cpu")) == "cpu-gloo"
    assert hardware_for("H100", torch.device("cpu")) == "H100"  # a name given by hand wins
    assert profile_for_device("cuda", "NVIDIA H200") == "H200"
    assert profile_for_device("cuda", "NVIDIA A100-SXM4-80GB") == "A100-80G"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H200")
    assert hardware_for(None, torch.device("cuda", 0)) == "H200"
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Future GPU X1")
    with pytest.raises(ValueError, match=r"'Future GPU X1'.*hardware=NAME"):
        hardware_for(None, torch.device("cuda", 0))


def test_metrics_come_from_records_with_the_documented_keys() -> None:
    from pathlib import Path

    from lightning_hotspa.adapter.observability.stats import monitor_metrics, step_metrics

    record = StageRecord(step=1, order=0, layout=Layout(dp=2, tp=2), label="(0,256]", tokens=100.0, documents=3.0,
                         micro_batches=2.0, switch_s=1.0, switch_mb=2.5, compute_s=3.0, reduce_s=0.5, stage_s=4.0,
                         flops=1e9, predicted_s=5.0)
    metrics = step_metrics([record])
    extra = monitor_metrics([record], 4.0, 2.0, 1e9)
    assert set(extra) == {"train/step_loss", "hotspa/0-256/mfu",
                          "hotspa/0-256/predicted_s", "hotspa/mfu", "hotspa/predicted_step_s",
                          "hotspa/predicted_over_measured"}
    readme = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()
    for key in [*metrics, *(k for k in extra if k.startswith("hotspa/"))]:  # all in docs/metrics.md
        short = key.replace("hotspa/0-256/", "")
        assert f"`{key.replace('0-256', '<stage>')}`" in readme or f"`{short}`" in readme, key
    assert metrics["hotspa/0-256/tokens_per_s"] == 25.0  # over the slowest rank's stage time
    assert metrics["hotspa/step_s"] == 4.0 and metrics["hotspa/switch_fraction"] == 0.25
    assert metrics["hotspa/0-256/stage_s"] == 4.0 and metrics["hotspa/between_s"] == 0.0
    between = step_metrics([record], between_s=0.5)  # what lies between stages is part of the step
    assert between["hotspa/step_s"] == 4.5 == between["hotspa/0-256/stage_s"] + between["hotspa/between_s"]
    assert metrics["hotspa/tokens"] == 100.0 and metrics["hotspa/documents"] == 3.0
    unpadded = step_metrics([record], doc_tokens=[90])  # the plan's document tokens; padding apart
    assert (unpadded["hotspa/0-256/tokens"], unpadded["hotspa/0-256/padded_tokens"]) == (90.0, 100.0)
    assert unpadded["hotspa/0-256/tokens_per_s"] == 22.5 and unpadded["hotspa/tokens"] == 90.0
