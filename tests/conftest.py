"""Shared fixtures. Multi-process tests run on CPU over gloo through a reused RankPool per world
size (spawning 4 torch processes costs seconds on 2 cores); every call has a hard deadline, so a hung
collective fails the test instead of hanging CI."""

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("WANDB_MODE", "offline")

from lightning_hotspa.testing.spawn import RankPool, start_fork_server, use_fork_server  # noqa: E402

# tests/unit, tests/distributed, tests/e2e on sys.path: spawned ranks inherit sys.path and import the
# test module of the function they run by name; the shared helpers are tests/helpers.py (no test file
# imports another: tests/unit/test_architecture.py)
for _tier in ("unit", "distributed", "e2e"):
    _folder = str(Path(__file__).resolve().parent / _tier)
    if _folder not in sys.path:
        sys.path.insert(0, _folder)

# the ranks fork from one server that imported these once (a spawned rank imports Lightning, ~8 s of CPU
# on the 2-core CI box, every time a pool starts); the server starts with the first pool, and the fast
# tier starts none
use_fork_server("lightning", "lightning_hotspa.adapter.lightning.strategy", "helpers")
_POOLS: dict[int, RankPool] = {}


def _pool(world: int) -> RankPool:
    if world not in _POOLS:
        _POOLS[world] = RankPool(world)
    return _POOLS[world]


def _close_pools() -> None:
    for pool in _POOLS.values():
        pool.close()
    _POOLS.clear()


@pytest.fixture(scope="session")
def ranks():
    """``ranks(world).run(fn, *args)`` runs a module-level function on ``world`` gloo ranks."""
    yield _pool
    _close_pools()


def pytest_runtest_teardown(item, nextitem):
    """Close the rank pools at the end of each test file: an idle pooled rank is not idle (each of its gloo
    groups' transport loop wakes every few milliseconds: ~4 % of a core per rank measured with ~40 groups
    held), while a new pool forks from the server in ~0.3 s (benchmarks/2026-12-06-suite-time-3.md)."""
    if _POOLS and (nextitem is None or nextitem.path != item.path):
        _close_pools()


#: test modules whose tests run in one process (no process group, no spawned ranks); their tests
#: that take the ``ranks`` fixture or are marked ``slow`` stay out of the fast tier
FAST_MODULES = frozenset({
    "test_bad_input_table", "test_block_metrics", "test_block_plan", "test_chat_data", "test_checkpointing",
    "test_block_lanes", "test_cp_kinds", "test_docs_agree", "test_docs_paths", "test_ladder", "test_model_shape",
    "test_fsdp_planner", "test_hf",
    "test_kv_ring", "test_module_sizes",
    "test_collectives_door", "test_configs_home", "test_strategy_surface",
    "test_layout", "test_long_grid", "test_minibatches", "test_packing", "test_plan", "test_planner",
    "test_profile_update", "test_recipe_smoke", "test_timeline", "test_varlen_kernels", "test_vocab",
})


#: the test files that take longest, longest first (share of one quiet-box run's test time, measured in
#: benchmarks/2026-12-06-suite-time-3.md); collected first, so that ``make test``'s workers
#: (``--dist loadfile --no-loadscope-reorder``: files handed out in collection order) start the long
#: files first and finish together. A stale list costs balance, never a test; a file not listed keeps
#: its place after them.
LONGEST_FIRST = (
    "e2e/test_multinode.py", "unit/test_memory.py", "unit/test_planner.py", "e2e/test_recipe_smoke.py",
    "e2e/test_strategy.py", "unit/test_cli.py", "distributed/test_pipeline.py", "distributed/test_blocks.py",
    "e2e/test_reliability.py", "e2e/test_what_a_user_sees.py", "e2e/test_lightning_parity.py",
    "e2e/test_recipe_smoke_benchmark_compile.py", "e2e/test_recipes.py", "distributed/test_parallel.py",
    "distributed/test_mixed_tp.py", "unit/test_architecture.py", "e2e/test_mixed_kill.py",
    "unit/test_static_reference.py", "e2e/test_gpu_check.py", "unit/test_pipeline_fake_world.py",
    "e2e/test_strategy_pipeline.py", "distributed/test_mixed_rounds.py", "distributed/test_switch.py",
    "e2e/test_profiled.py", "distributed/test_hf_parallel.py", "distributed/test_fp8_ranks.py",
)


def _file_rank(item) -> int:
    """Position of the item's file in LONGEST_FIRST (its length if not listed)."""
    path = item.nodeid.split("::", 1)[0]
    for i, name in enumerate(LONGEST_FIRST):
        if path.endswith(name):
            return i
    return len(LONGEST_FIRST)


def pytest_collection_modifyitems(config, items):
    """Longest test files first (a stable sort: the order inside a file is kept); mark the fast tier
    (``make test-fast``: ``pytest -m fast``)."""
    items.sort(key=_file_rank)
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1] if getattr(item, "module", None) else ""
        if (module in FAST_MODULES and "ranks" not in getattr(item, "fixturenames", ())
                and item.get_closest_marker("slow") is None):
            item.add_marker(pytest.mark.fast)


@pytest.fixture(scope="session", autouse=True)
def _fork_server_starts_with_the_first_test(request):
    """Start the fork server at the first test if any test of the session may spawn ranks: its imports
    (torch, Lightning: seconds) then run beside the first tests instead of before the first pool. Started
    inside a test (not at collection), it and its ranks write into pytest's captured output, not the console."""
    if any(item.get_closest_marker("fast") is None for item in request.session.items):
        start_fork_server()


@pytest.fixture(autouse=True)
def _fast_tests_create_no_process_group(request):
    """A test of the fast tier that leaves a default process group behind fails."""
    yield
    if request.node.get_closest_marker("fast") is not None:
        import torch.distributed as dist

        assert not (dist.is_available() and dist.is_initialized()), \
            f"{request.node.nodeid} is in the fast tier but created a process group"
