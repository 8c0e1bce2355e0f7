"""Sequence parallelism's collectives per layer, counted on fake ranks: one all-gather per declared
region forward (q / k / v and w1 / w3 each gathered again before 49c56bc: 19 per layer), and in
backward each region re-gathers its input in the same step as it reduce-scatters its input gradient
(parallel/regions.py): the same schedule on every backend, carried by 4 tp collectives forward and
6 backward on NCCL / fake groups, 4 and 4 on gloo without tp overlap (the pair is one all-to-all
there); with tp overlap (the default) gloo runs rings of point-to-point steps. The results against
the single process are tests/distributed/test_sequence_parallel.py's (gloo)."""

import collections

import pytest
import torch

from lightning_hotspa.layout import Layout
from lightning_hotspa.mesh import RankGroup
from lightning_hotspa.models import LlamaConfig
from lightning_hotspa.testing.comm_bytes import count_collective_bytes
from lightning_hotspa.tools.fake_llama import fake_llama

TOKENS = 256


def _calls(n_layers: int, tp: int, overlap: bool = True) -> dict[str, collections.Counter]:
    """Collective calls in one micro-batch's forward and backward, and the bytes each rank receives
    in each backward call, on tp fake ranks."""
    config = LlamaConfig.preset("tiny", n_layers=n_layers, hidden=128, n_heads=8, n_kv_heads=4, ffn_hidden=256)
    layout = Layout(dp=1, tp=tp)
    out: dict[str, collections.Counter] = {}
    with fake_llama(config, layout, tp, TOKENS, working_dtype=torch.float32, tp_overlap=overlap) as step:
        step.engine.materialize(layout)
        step.parallel.activate(layout, step.engine.working, False)
        with step.parallel.micro_batch(step.micro_batch):
            with count_collective_bytes() as forward:
                loss = step.module(step.micro_batch)
        with count_collective_bytes() as backward:
            loss.backward()
    for phase, log in (("forward", forward), ("backward", backward)):
        out[phase] = collections.Counter(name for name, _ in log.calls)
    out["backward_bytes"] = collections.Counter(b for _, b in backward.calls)
    return out


@pytest.mark.parametrize("tp", [2, 4])
def test_a_layer_makes_four_tp_collectives_forward_and_six_backward(tp):
    one, two = _calls(1, tp), _calls(2, tp)
    per_layer = {phase: two[phase] - one[phase] for phase in ("forward", "backward")}
    assert per_layer["forward"] == {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2}, per_layer
    # the output gradients' gathers, the inputs' re-gathers, the inputs' gradients' reduce-scatters
    assert per_layer["backward"] == {"all_gather_into_tensor": 4, "reduce_scatter_tensor": 2}, per_layer


@pytest.mark.parametrize("tp", [2, 4])
def test_on_gloo_the_overlapped_collectives_are_rings_of_tp_steps(tp, monkeypatch):
    """tp overlap (issue 52, on by default): each of a layer's 4 tp collectives forward (2 regions'
    all-gather + matmul, 2 row outputs' matmul + reduce-scatter) and the 4 backward ones (the
    conjugates) is a ring of tp - 1 send / receive steps on gloo; the 2 re-gathers stay all-to-alls."""
    monkeypatch.setattr(RankGroup, "backend", property(lambda self: "gloo" if self.group is not None else None))
    one, two = _calls(1, tp), _calls(2, tp)
    per_layer = {phase: two[phase] - one[phase] for phase in ("forward", "backward")}
    steps = 4 * (tp - 1)
    assert per_layer["forward"] == {"isend": steps, "irecv": steps}, per_layer
    assert per_layer["backward"] == {"isend": steps, "irecv": steps, "all_to_all_single": 2}, per_layer


@pytest.mark.parametrize("tp", [2, 4])
def test_on_gloo_the_regather_rides_with_the_input_gradients_reduce_scatter(tp, monkeypatch):
    """Without tp overlap (``tp_overlap=False``)."""
    monkeypatch.setattr(RankGroup, "backend", property(lambda self: "gloo" if self.group is not None else None))
    one, two = _calls(1, tp, overlap=False), _calls(2, tp, overlap=False)
    per_layer = {phase: two[phase] - one[phase] for phase in ("forward", "backward")}
    # gloo: row gathers are all-to-alls of n copies, reduce-scatters all-to-alls plus a sum
    assert per_layer["forward"] == {"all_to_all_single": 4}, per_layer
    assert per_layer["backward"] == {"all_to_all_single": 4}, per_layer
    # each region's one all-to-all carries its input gradient and its input (hidden wide each):
    # twice what an output gradient's all-gather receives
    rows = (tp - 1) * (TOKENS // tp) * 128 * 4
    per_layer_bytes = two["backward_bytes"] - one["backward_bytes"]
    assert per_layer_bytes == {2 * rows: 2, rows: 2}, per_layer_bytes


def test_a_region_computes_its_readers_once_per_input_and_holds_nothing_after_the_last():
    """The declared region (parallel/regions.py): the first reader computes every reader's output
    from one gather, the others take theirs; nothing is kept once all have read (a recomputation
    under selective checkpointing reruns the same readers), and another input computes anew."""
    from torch import nn

    from lightning_hotspa.parallel.regions import ColumnRegion

    group = RankGroup(dims=(0,), ranks=(0,), index=0, group=None)
    readers = {name: nn.Linear(8, 4) for name in ("wq", "wk", "wv")}
    region = ColumnRegion("attention", readers, sequence_parallel=False)
    x = torch.randn(5, 8, requires_grad=True)
    outs = [region.output(name, x, group) for name in readers]
    assert outs[0].grad_fn is outs[1].grad_fn is outs[2].grad_fn  # one autograd node for the region
    assert region._input is None and region._pending == {}
    for out, m in zip(outs, readers.values(), strict=True):
        torch.testing.assert_close(out, m(x))
    again = region.output("wk", x, group)  # out of order, on the same input: computed anew
    assert again.grad_fn is not outs[1].grad_fn and set(region._pending) == {"wq", "wv"}
    sum(o.sum() for o in outs).backward()
    expected = sum(m.weight.sum(0) for m in readers.values())
    torch.testing.assert_close(x.grad, expected.expand(5, 8))


def test_the_plan_declares_llamas_regions_and_a_typo_is_refused():
    from lightning_hotspa.layout import LayoutError
    from lightning_hotspa.models import Llama, llama_tp_plan, param_roles
    from lightning_hotspa.parallel.state import ParallelState
    from lightning_hotspa.parallel.tensor_parallel import declared_regions, install_tensor_parallel

    config = LlamaConfig.preset("tiny", n_layers=1)
    with torch.device("meta"):
        model = Llama(config)
    assert declared_regions(model) == {"layers.*.attention": ("wq", "wk", "wv"),
                                       "layers.*.feed_forward": ("w1", "w3")}
    roles = param_roles(model, llama_tp_plan(config, 2))
    with pytest.raises(LayoutError, match="'layers.\\*.atention' .* matches no module"):
        install_tensor_parallel(model, roles, ParallelState(), regions={"layers.*.atention": ("wq",)})
    with pytest.raises(LayoutError, match="layers.0.attention.wo is not a plain column-parallel"):
        install_tensor_parallel(model, roles, ParallelState(), regions={"layers.*.attention": ("wq", "wo")})


def test_the_sequence_parallel_flag_of_the_plan():
    from lightning_hotspa.models import llama_tp_plan

    config = LlamaConfig.preset("tiny")
    assert llama_tp_plan(config, 2)["layers.*.ffn_norm"] == "sequence"
    assert "sequence" not in llama_tp_plan(config, 2, sequence_parallel=False).values()
