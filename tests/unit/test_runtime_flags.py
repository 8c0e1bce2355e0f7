"""Each feature OUR runtime description prices (``HOTSPA`` in planner/cost/runtime_profile.py) has its code path,
and a feature without one is not priced: the description may not promise what the runtime does not run."""

from __future__ import annotations

import inspect

from lightning_hotspa.planner.cost.peer_rows import matching_options
from lightning_hotspa.planner.cost.published_runs import PUBLISHED_RUNS
from lightning_hotspa.planner.cost.runtime_profile import HOTSPA


def _strategy_parameters() -> set[str]:
    """The strategy's keywords and its runtime group's fields (``HotSPaStrategy(runtime=RuntimeOptions(...))``)."""
    import dataclasses

    from lightning_hotspa import HotSPaStrategy, RuntimeOptions

    return set(inspect.signature(HotSPaStrategy.__init__).parameters) | {
        f.name for f in dataclasses.fields(RuntimeOptions)}


def test_compile_is_priced_only_with_the_per_block_compile_option():
    from lightning_hotspa.adapter.lightning.compile_blocks import check_compile_spec

    assert HOTSPA.compile_speedup > 1
    assert "compile_blocks" in _strategy_parameters()
    assert check_compile_spec(True) is not None and check_compile_spec(False) is None


def test_fp8_is_priced_only_where_the_user_turns_it_on():
    """FP8 linears (parallel/fp8.py, ``strategy.runtime.fp8``): our default description has no FP8 rate (the planner's
    default prices are bf16); ``hotspa_runtime(recipe)`` has torchao's rate for exactly the recipes the switch
    accepts (each validated and run through ParallelModel's fp8 path), and a peer's FP8 run is compared with
    ours with the switch on."""
    from lightning_hotspa.parallel.fp8 import FP8_RECIPES as CODE_RECIPES
    from lightning_hotspa.parallel.fp8 import check_fp8
    from lightning_hotspa.parallel.model import ParallelModel
    from lightning_hotspa.planner.cost.runtime_profile import FP8_RECIPES, hotspa_runtime

    assert "fp8" in _strategy_parameters() and "fp8" in inspect.signature(ParallelModel.__init__).parameters
    assert HOTSPA.fp8_recipe_speedups == () and HOTSPA.fp8_gemm_speedup == 0 and hotspa_runtime(None) is HOTSPA
    assert set(CODE_RECIPES) == set(FP8_RECIPES)
    for recipe in FP8_RECIPES:
        assert check_fp8(recipe) == recipe and hotspa_runtime(recipe).fp8_rate(recipe) > 1
    fp8_runs = [r for r in PUBLISHED_RUNS if r.precision == "fp8"]
    assert fp8_runs and all(matching_options(r).fp8 == "tensorwise" for r in fp8_runs)
    assert all(not matching_options(r).fp8 for r in PUBLISHED_RUNS if r.precision != "fp8")


def test_overlap_flags_have_their_switches():
    """tp overlap: ParallelModel(tp_overlap=), on by default; the kept sequence-parallel input:
    HotSPaStrategy(runtime=RuntimeOptions(tp_regather=False))."""
    from lightning_hotspa.parallel.model import ParallelModel

    tp_overlap = inspect.signature(ParallelModel.__init__).parameters["tp_overlap"]
    assert HOTSPA.tp_comm_overlap and tp_overlap.default is True
    assert "tp_regather" in _strategy_parameters()
