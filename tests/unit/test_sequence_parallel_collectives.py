"""Sequence parallelism's collectives per layer, counted on fake ranks: the backward re-gather of a
region's input travels in the all-gather of its output gradient (parallel/sequence_parallel.py), so a
layer makes 4 tp collectives forward and 4 backward, not 4 and 6. The results against the single
process are tests/distributed/test_sequence_parallel.py's."""

import collections

import pytest
import torch

from lightning_hotspa.engine.home import build_home_parameters
from lightning_hotspa.engine.switch import SwitchEngine
from lightning_hotspa.host import set_host_reads
from lightning_hotspa.layout import Layout
from lightning_hotspa.mesh import WorldMesh
from lightning_hotspa.models import LlamaConfig
from lightning_hotspa.parallel.model import ParallelModel
from lightning_hotspa.testing.comm_bytes import count_collective_bytes
from lightning_hotspa.testing.fake_world import FakeWorld, fake_mode, host_reads_real
from lightning_hotspa.tools.memory import _empty_shard, _micro_batch, _Wrapped, llama_roles_and_shardings

TOKENS = 256


def _calls(n_layers: int, tp: int) -> dict[str, collections.Counter]:
    """Collective calls by name in one micro-batch's forward and backward, with the bytes of each
    backward all-gather's input, on tp fake ranks."""
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
    out["gather_bytes"] = collections.Counter(b for name, b in backward.calls if name == "all_gather_into_tensor")
    return out


@pytest.mark.parametrize("tp", [2, 4])
def test_a_layer_makes_four_tp_collectives_each_way_and_the_regather_rides_on_the_gradient(tp):
    one, two = _calls(1, tp), _calls(2, tp)
    per_layer = {phase: two[phase] - one[phase] for phase in ("forward", "backward")}
    assert per_layer["forward"] == {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2}, per_layer
    assert per_layer["backward"] == {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2}, per_layer
    # each backward all-gather of a layer carries the output gradient and the region's input (hidden
    # wide each): twice the bytes of the embedding's, which carries a gradient only
    hidden_rows = (tp - 1) * TOKENS // tp * 128 * 4
    assert two["gather_bytes"][2 * hidden_rows] == 4 and two["gather_bytes"][hidden_rows] == 1, two["gather_bytes"]
