"""Sequence parallelism's collectives per layer, counted on fake ranks: one all-gather per shared
input forward (q / k / v and w1 / w3 each gathered again before 49c56bc: 19 per layer), and on a
gloo group the backward re-gather of a region's input travels in the all-gather of its output
gradient (parallel/sequence_parallel.py): 4 tp collectives forward and 4 backward there, 4 and 6
elsewhere. The results against the single process are tests/distributed/test_sequence_parallel.py's
(gloo)."""

import collections

import pytest
import torch

from lightning_hotspa.engine.home import build_home_parameters
from lightning_hotspa.engine.switch import SwitchEngine
from lightning_hotspa.host import set_host_reads
from lightning_hotspa.layout import Layout
from lightning_hotspa.mesh import RankGroup, WorldMesh
from lightning_hotspa.models import LlamaConfig
from lightning_hotspa.parallel.model import ParallelModel
from lightning_hotspa.testing.comm_bytes import count_collective_bytes
from lightning_hotspa.testing.fake_world import FakeWorld, fake_mode, host_reads_real
from lightning_hotspa.tools.memory import _empty_shard, _micro_batch, _Wrapped, llama_roles_and_shardings

TOKENS = 256


def _calls(n_layers: int, tp: int) -> dict[str, collections.Counter]:
    """Collective calls in one micro-batch's forward and backward, and the bytes each rank receives
    in each backward call, on tp fake ranks."""
    config = LlamaConfig.preset("tiny", n_layers=n_layers, hidden=128, n_heads=8, n_kv_heads=4, ffn_hidden=256)
    layout = Layout(dp=1, tp=tp)
    out: dict[str, collections.Counter] = {}
    with FakeWorld(tp):
        world = WorldMesh([layout])
        mb = _micro_batch(layout, world, TOKENS)
        with torch.device("meta"):
            module = _Wrapped(config)
        roles, shardings = llama_roles_and_shardings(module, config, layout, world)
        previous = set_host_reads(host_reads_real)
        try:
            with fake_mode():
                module.to_empty(device="cpu")
                home = build_home_parameters(world, shardings, None, init_shard=_empty_shard)
                parallel = ParallelModel(module, roles, world)
                parallel.restore(home)
                engine = SwitchEngine(world, shardings, home, working_dtype=torch.float32,
                                      grad_accum_dtype=torch.float32)
                engine.materialize(layout)
                parallel.activate(layout, engine.working, False)
                with parallel.micro_batch(mb):
                    with count_collective_bytes() as forward:
                        loss = module(mb)
                with count_collective_bytes() as backward:
                    loss.backward()
                parallel.restore(home)
                engine.release()
        finally:
            set_host_reads(previous)
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
def test_on_gloo_the_regather_rides_on_the_output_gradients_all_gather(tp, monkeypatch):
    monkeypatch.setattr(RankGroup, "backend", property(lambda self: "gloo" if self.group is not None else None))
    one, two = _calls(1, tp), _calls(2, tp)
    per_layer = {phase: two[phase] - one[phase] for phase in ("forward", "backward")}
    # gloo: row gathers are all-to-alls of n copies, reduce-scatters all-to-alls plus a sum
    assert per_layer["forward"] == {"all_to_all_single": 4}, per_layer
    assert per_layer["backward"] == {"all_to_all_single": 4}, per_layer
    # each layer's two gathers carry the output gradient and the region's input (hidden wide each):
    # twice what the embedding's gradient gather or a reduce-scatter receives
    rows = (tp - 1) * (TOKENS // tp) * 128 * 4
    per_layer_bytes = two["backward_bytes"] - one["backward_bytes"]
    assert per_layer_bytes == {2 * rows: 2, rows: 2}, per_layer_bytes


def test_the_shared_input_copy_is_let_go_after_its_last_reader_even_without_a_closing_layer():
    """A recomputation under selective checkpointing reruns q / k / v but not wo: the memo learns at
    the first close how many layers read a region and lets the copy go after the last of them."""
    from lightning_hotspa.parallel.tensor_parallel import _SharedInputCopy

    group = RankGroup(dims=(0,), ranks=(0,), index=0, group=None)
    memo = _SharedInputCopy(sequence_parallel=True)
    q, k, v = object(), object(), object()
    x = torch.randn(4, 8)
    first, regather = memo(x, group, q)
    assert memo(x, group, k) == (first, regather) and memo(x, group, v) == (first, regather)
    assert memo._copy is not None  # the first time, held until the region closes
    assert memo.close_region() is regather and memo._copy is None
    y = torch.randn(4, 8)  # the recomputation: three readers, no close
    for reader in (q, k, v):
        memo(y, group, reader)
    assert memo._copy is None and memo._source is None
