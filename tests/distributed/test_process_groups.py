"""Only the process groups a run uses, made at setup; a failed sub-group collective names its group."""

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from lightning_hotspa import mesh as mesh_module
from lightning_hotspa.adapter.lightning.reliability import CollectiveError, StepTracker, subgroup_timeout
from lightning_hotspa.engine.switch import SwitchEngine, build_home_parameters
from lightning_hotspa.layout import Layout, LayoutError
from lightning_hotspa.mesh import WorldMesh
from lightning_hotspa.models import LlamaConfig
from lightning_hotspa.placements import build_shardings
from lightning_hotspa.testing.fake_world import FakeWorld
from lightning_hotspa.tools.memory import _Wrapped, llama_roles_and_shardings

WIDE = ["dp8xtp8", "dp4xtp8xcp2", "dp2xtp8xcp4:kv", "tp8xcp8:kv2", "dp32xtp2:fsdp8"]


def _llama_engine(world_size, layouts):
    """A WorldMesh and a SwitchEngine of llama3-8b's shardings (meta home: only names and shapes)."""
    config = LlamaConfig.preset("llama3-8b")
    with torch.device("meta"):
        module = _Wrapped(config)
    world = WorldMesh(layouts)
    widest = max(world.layouts, key=lambda x: x.tp)
    _, shardings = llama_roles_and_shardings(module, config, widest, world)
    engine = SwitchEngine(world, shardings, {n: torch.empty(0, device="meta") for n in shardings})
    return world, engine


def test_only_the_ranges_the_layouts_and_the_engine_use_are_created():
    with FakeWorld(64, rank=5):
        world, engine = _llama_engine(64, WIDE)
        every = [(a, b) for a in range(world.shape.ndim) for b in range(a + 1, world.shape.ndim + 1)]
        used = set(world.layout_ranges()) | engine.needed_group_ranges()
        assert set(world.group_ranges) == {r for r in used if r[1] > r[0]}
        assert len(world.group_ranges) < len(every)  # some contiguous range no collective needs
        missing = sorted(set(every) - set(world.group_ranges))[0]
        with pytest.raises(LayoutError, match=rf"layout dp8xtp8 needs a process group over mesh dims "
                                              rf"\[{missing[0]}.*never on first use"):
            world.group(range(*missing), Layout.parse("dp8xtp8"))


def test_split_group_makes_each_range_in_one_call(monkeypatch):
    """Where the default group is a device-bound NCCL one, one ``split_group`` per range (ncclCommSplit)."""
    calls = []

    def fake_split(parent_pg=None, split_ranks=None, timeout=None, group_desc=None):
        calls.append([list(b) for b in split_ranks])
        mine = None
        for block in split_ranks:  # what split_group returns: this rank's block
            pg = dist.new_group(block, timeout=timeout, group_desc=group_desc)
            mine = pg if dist.get_rank() in block else mine
        return mine

    monkeypatch.setattr(mesh_module, "_can_split", lambda: True)
    monkeypatch.setattr(dist, "split_group", fake_split)
    with FakeWorld(16, rank=6):
        world = WorldMesh(["dp4xtp4", "dp2xtp4xcp2", "tp2xcp8"])
        assert world.creations == len(calls) == len(world.group_ranges)
        for block_list, (a, b) in zip(calls, world.group_ranges):
            assert sorted(r for blk in block_list for r in blk) == list(range(16))  # a partition of the world
            group = world.group(range(a, b))
            assert sorted(group.ranks) in block_list and group.group is not None


def test_subgroup_timeout_defaults_and_bad_values():
    from lightning_hotspa.adapter.lightning.strategy import HotSPaStrategy

    half_hour = timedelta(minutes=30)
    assert subgroup_timeout("nccl", half_hour) < half_hour
    assert subgroup_timeout("nccl", timedelta(minutes=1)) == timedelta(minutes=1)
    assert subgroup_timeout("gloo", half_hour) == half_hour
    assert subgroup_timeout("nccl", half_hour, 42) == timedelta(seconds=42)
    with pytest.raises(ValueError, match=r"subgroup_timeout must be positive, got -3"):
        HotSPaStrategy(layouts=["dp2"], reliability={"subgroup_timeout": -3})


def test_a_failure_names_the_group_of_its_noted_collective_only():
    """A failure inside a noted collective names its group (a world collective: its ranks); one
    outside any noted site names none, whatever group a caller holds."""
    from lightning_hotspa.collective_names import collective
    from lightning_hotspa.mesh import RankGroup

    held = RankGroup((0,), (0, 1), 0, object(), "hotspa mesh dims [0] ranks 0..1 (2)")

    def subgroup_collective():
        with collective("an all-gather", held):
            raise RuntimeError("gloo: Timed out waiting 2000ms")

    def world_collective():
        with collective("the step's record gather", range(4)):
            raise RuntimeError("gloo: Timed out waiting 2000ms")

    def nested():  # the innermost note wins
        with collective("the step's record gather", range(4)):
            subgroup_collective()

    def unnoted():
        raise RuntimeError("gloo: Timed out waiting 2000ms")

    for call, expected in (
            (subgroup_collective, "failed in an all-gather on process group 'hotspa mesh dims [0] ranks 0..1 (2)' "
                                  "(ranks [0, 1]) at "),
            (nested, "failed in an all-gather on process group 'hotspa mesh dims [0] ranks 0..1 (2)' "
                     "(ranks [0, 1]) at "),
            (world_collective, "failed in the step's record gather over ranks [0, 1, 2, 3] at "),
            (unnoted, "a collective failed at ")):
        outer_group = held  # noqa: F841 - what an outer caller holds
        with pytest.raises(CollectiveError) as info:
            with StepTracker().guard():
                call()
        assert expected in str(info.value), str(info.value)
        assert ("on process group" in str(info.value)) == (call in (subgroup_collective, nested))


def _skip_subgroup_collective():
    """Rank 1 skips sub-group collectives rank 0 runs: rank 0 gets a CollectiveError naming the group
    after the sub-group's timeout (rank 1 never joins, so no race decides it). Every group is created
    first, by both ranks, with the pool's long timeout (gloo's connect at creation takes the group's
    timeout too, and a loaded machine can be slow there); rank 0 then shortens its groups' timeout."""
    shapes, roles, dp2 = {"w": (8, 4)}, {"w": "replicated"}, Layout.parse("dp2")
    engines = []
    for _ in ("switch", "reduce"):
        world = WorldMesh(["dp2"], timeout=timedelta(seconds=120))
        shardings = build_shardings(shapes, roles, world.shape)
        home = build_home_parameters(world, shardings, lambda name, shape: torch.ones(shape))
        engines.append(SwitchEngine(world, shardings, home))
    engines[1].materialize(dp2)  # both ranks
    if dist.get_rank() == 1:
        return []
    for engine in engines:
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=2), engine.world.group([0]).group)
    out = []
    for run in (lambda: engines[0].materialize(dp2),  # an all-gather over mesh dims [0]
                engines[1].reduce_gradients):  # a reduce-scatter, waited on in _Pending.result
        try:
            with StepTracker().guard():
                run()
        except CollectiveError as exc:
            out.append(str(exc))
    return out


def test_failed_subgroup_collective_names_the_group(ranks):
    messages = ranks(2).run(_skip_subgroup_collective)[0]
    assert len(messages) == 2
    for message in messages:
        assert "on process group 'hotspa mesh dims [0] ranks 0..1 (2)' (ranks [0, 1])" in message, message


def _make_groups(n: int) -> int:
    groups = [dist.new_group(list(range(dist.get_world_size()))) for _ in range(n)]
    for group in groups:
        dist.all_reduce(torch.ones(1), group=group)
    return len(groups)


def _held_groups_and_threads() -> tuple[int, int]:
    import os

    from lightning_hotspa.torch_compat import process_groups

    return len(process_groups()), len(os.listdir("/proc/self/task"))


def test_the_rank_pool_restarts_ranks_that_hold_too_many_groups():
    """A pooled rank that kept every test's groups kept their gloo threads too (three per group, a
    transport loop among them that polls): ~670 threads per rank after the suite's first half. Past
    MAX_GROUPS the pool starts fresh ranks for the next call."""
    from lightning_hotspa.testing.spawn import MAX_GROUPS, RankPool

    pool = RankPool(2)  # its own: the session's pools hold what earlier tests made
    try:
        _check_restarts(pool, MAX_GROUPS)
    finally:
        pool.close()


def _check_restarts(pool, max_groups: int) -> None:
    pool.run(_make_groups, 1)  # the pool's own threads (its result queue's feeder) start on a first call
    before = pool.run(_held_groups_and_threads)
    assert pool.run(_make_groups, 4) == [4, 4]
    grown = pool.run(_held_groups_and_threads)
    assert [g for g, _ in grown] == [g + 4 for g, _ in before] and all(
        a[1] == b[1] + 12 for a, b in zip(grown, before)), (before, grown)  # 3 threads per group
    assert pool.run(_make_groups, max_groups) == [max_groups] * 2
    fresh = pool.run(_held_groups_and_threads)
    assert [g for g, _ in fresh] == [1, 1]  # only the default group: new ranks


def _what_the_rank_started_with() -> dict:
    import os
    import sys

    return {"mark": os.environ.get("HOTSPA_CALLER_MARK"), "cwd": os.getcwd(), "path0": sys.path[0],
            "parent": os.getppid()}


def test_pooled_ranks_fork_from_the_server_with_the_callers_environment(monkeypatch, tmp_path):
    """The suite's ranks fork from one server that imported torch and Lightning once (conftest.py
    calls use_fork_server), and each takes the environment, working folder and sys.path its caller
    had when the pool started, as a spawned rank does; a fork of the server alone would have the
    server's."""
    import os
    from multiprocessing import forkserver

    from lightning_hotspa.testing.spawn import RankPool, use_fork_server

    forkserver.ensure_running()  # the server exists before the caller's changes below, as in the suite
    monkeypatch.setenv("HOTSPA_CALLER_MARK", "set after the server started")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    pool = RankPool(2)
    try:
        seen = pool.run(_what_the_rank_started_with)
    finally:
        pool.close()
    for rank in seen:
        assert rank == {"mark": "set after the server started", "cwd": str(tmp_path), "path0": str(tmp_path),
                        "parent": rank["parent"]}, rank
        assert rank["parent"] != os.getpid(), "the rank was not forked by the server"
    with pytest.raises(ValueError, match="use_fork_server takes module names, got ''"):
        use_fork_server("")
    with pytest.raises(ValueError, match="use_fork_server: no module 'lightning_hotspa.no_such_module' on sys.path"):
        use_fork_server("lightning_hotspa.no_such_module")
    with pytest.raises(ValueError, match="no module 'no_such_package.sub' on sys.path"):
        use_fork_server("no_such_package.sub")
