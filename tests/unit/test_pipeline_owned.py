"""Which parameters a rank's pipeline stages hold: named from the decoder's structure, not identity."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from lightning_hotspa.layout import Layout
from lightning_hotspa.models import LlamaConfig, LlamaLM
from lightning_hotspa.parallel.pipeline import PipelineRunner, _Part, layer_split


def _runner(schedule: str = "1f1b", virtual: int | None = None) -> PipelineRunner:
    model = LlamaLM(LlamaConfig.preset("tiny", n_layers=4), seed=3)
    return PipelineRunner(SimpleNamespace(module=model, state=None), schedule, virtual)


def _part_names(runner: PipelineRunner, layout: Layout, slot: int) -> set[str]:
    """The names of the parameters the stages' modules hold now, looked up by identity at this instant."""
    by_id = {id(p): runner.prefix + n for n, p in runner.decoder.named_parameters()}
    n = runner.virtual * layout.pp
    split = layer_split(len(runner.decoder.layers), n, layout, runner.head_layers)
    return {by_id[id(p)] for s in runner.stage_ids(layout, slot)
            for p in _Part(runner.decoder, split[s], s == 0, s == n - 1, None).parameters()}


def test_owned_names_are_the_stage_modules_parameters_for_every_slot():
    for schedule, layouts in (("1f1b", ["pp2", "pp4", "dp2xpp2"]), ("interleaved_1f1b", ["pp2"])):
        runner = _runner(schedule)
        for name in layouts:
            layout = Layout.parse(name)
            owned = [runner.owned(layout, slot) for slot in range(layout.pp)]
            for slot, names in enumerate(owned):
                assert names == _part_names(runner, layout, slot), (schedule, name, slot)
            every = {runner.prefix + n for n, _ in runner.decoder.named_parameters()}
            assert set().union(*owned) == every and sum(map(len, owned)) == len(every), (schedule, name)


def test_owned_follows_the_modules_when_parameter_objects_are_replaced():
    """The switch engine installs new parameter objects at every switch; a new one can reuse a dead
    one's ``id()``. Here two layers' norm weights trade objects (each id now sits at the other's name):
    a lookup by identity cached before would name the wrong layer and free a weight the stage uses."""
    runner = _runner()
    layout = Layout.parse("pp4")
    before = [runner.owned(layout, slot) for slot in range(4)]
    a, b = runner.decoder.layers[0].attention_norm, runner.decoder.layers[3].attention_norm
    a.weight, b.weight = b.weight, a.weight
    runner.decoder.layers[1].ffn_norm.weight = nn.Parameter(torch.ones_like(runner.decoder.layers[1].ffn_norm.weight))
    after = [runner.owned(layout, slot) for slot in range(4)]
    assert after == before
    for slot in range(4):
        assert after[slot] == _part_names(runner, layout, slot), slot


def test_the_runtime_runs_the_layer_split_the_planner_prices():
    """One rule (pipeline_split.py): the stages the runner builds hold the layers the cost model prices."""
    from lightning_hotspa.model_shape import describe_model
    from lightning_hotspa.planner.cost.cost_model import AnalyticCostModel

    for n_layers, pp in ((4, 2), (7, 3), (4, 4)):
        model = LlamaLM(LlamaConfig.preset("tiny", n_layers=n_layers), seed=3)
        runner = PipelineRunner(SimpleNamespace(module=model, state=None), "1f1b")
        assert runner.head_layers > 0
        cm = AnalyticCostModel(describe_model(model.config), "H100", pp)
        ran = [len(r) for r in layer_split(n_layers, pp, "", runner.head_layers)]
        assert tuple(ran) == cm.stage_layers(Layout(pp=pp)), (n_layers, pp, ran)
