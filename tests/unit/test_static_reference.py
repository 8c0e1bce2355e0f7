"""The guard's promise, visible (issue 54): the static layout a plan is compared with is among the
planner's candidates, and no chosen plan is predicted slower than it, on the grids' own batches."""

import pytest

from lightning_hotspa.tools.long_grid import LONG_GRID, long_cell
from lightning_hotspa.tools.simulate import GRID, simulate_cell


@pytest.mark.parametrize("data", GRID["data"])
@pytest.mark.parametrize("model,gpus", GRID["settings"])
def test_paper_grid_plans_never_slower_than_their_static_reference(model, gpus, data):
    """The paper grid's cells at its longest context, one batch each (the grid's own batch generation)."""
    cell = simulate_cell(model, gpus, max(GRID["contexts"]), data, batches=1)
    assert cell.best_static in cell.layouts, (cell.best_static, cell.layouts)
    for ours, static in zip(cell.ours_batches_s, cell.static_batches_s, strict=True):
        assert ours <= static * (1 + 1e-9), (cell.layouts, cell.best_static, ours, static)
    assert cell.speedup_static >= 1 - 1e-9


@pytest.mark.parametrize("data", LONG_GRID["data"])
@pytest.mark.parametrize("model,gpus,context", [s for s in LONG_GRID["settings"] if s[1] == 8])
def test_long_grid_plans_never_slower_than_their_static_reference(model, gpus, context, data):
    """The long grid's 8-GPU cells (the larger ones take minutes to choose candidates), one batch each."""
    cell = long_cell(model, gpus, context, data, "H100", batches=1)
    assert cell["best_static"] in cell["layouts"], cell
    assert cell["ours_s"] <= cell["static_s"] * (1 + 1e-9), cell
