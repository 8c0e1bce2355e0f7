"""Each feature OUR runtime description prices (``HOTSPA`` in planner/cost/runtime_profile.py) has its code path,
and a feature without one is not priced: the description may not promise what the runtime does not run."""

from __future__ import annotations

import inspect

from lightning_hotspa.planner.cost.peer_rows import matching_options
from lightning_hotspa.planner.cost.published_runs import PUBLISHED_RUNS
from lightning_hotspa.planner.cost.runtime_profile import HOTSPA


def _strategy_parameters() -> set[str]:
    from lightning_hotspa import HotSPaStrategy

    return set(inspect.signature(HotSPaStrategy.__init__).parameters)


def test_compile_is_priced_only_with_the_per_block_compile_option():
    from lightning_hotspa.adapter.lightning.compile_blocks import check_compile_spec

    assert HOTSPA.compile_speedup > 1
    assert "compile_blocks" in _strategy_parameters()
    assert check_compile_spec(True) is not None and check_compile_spec(False) is None


def test_fp8_is_priced_only_where_an_fp8_option_exists():
    """No FP8 linears in our runtime yet (issue 51 item 3): no FP8 rate in our description, and a peer's FP8
    run is compared with ours in bf16."""
    has_option = "fp8" in _strategy_parameters()
    assert bool(HOTSPA.fp8_recipe_speedups) == has_option and HOTSPA.fp8_gemm_speedup == 0
    fp8_runs = [r for r in PUBLISHED_RUNS if r.precision == "fp8"]
    assert fp8_runs and all(bool(matching_options(r).fp8) == has_option for r in fp8_runs)


def test_overlap_flags_have_their_switches():
    """tp overlap: ParallelModel(tp_overlap=), on by default; the kept sequence-parallel input:
    HotSPaStrategy(tp_regather=False)."""
    from lightning_hotspa.parallel.model import ParallelModel

    tp_overlap = inspect.signature(ParallelModel.__init__).parameters["tp_overlap"]
    assert HOTSPA.tp_comm_overlap and tp_overlap.default is True
    assert "tp_regather" in _strategy_parameters()
