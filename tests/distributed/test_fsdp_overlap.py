"""``:fsdp`` gradient reduce-scatters: asynchronous with one unit in flight, optionally in bf16."""

import torch
from helpers import TinyLlama, setup_runner, uneven_plan

from lightning_hotspa.engine.step_runner import StepRunner


def run_fsdp_reduce(reduce_dtype) -> tuple:
    """Gradients of one plan in dp4:fsdp and in dp4, the units in flight whenever one more starts,
    and the reduce-scatter bytes."""
    layouts = ["dp4:fsdp", "dp4"]
    module, world, home, parallel, engine = setup_runner(layouts, TinyLlama())
    runner = StepRunner(engine, parallel, fsdp_reduce_dtype=reduce_dtype)
    units, in_flight = runner.units, []
    for unit in units.units:  # reduce-scatters still pending when each unit's own start

        def spy(names, grads, start=unit.reduce_scatter):
            in_flight.append(len({id(p) for _, p in units.reducing}))
            start(names, grads)

        unit.reduce_scatter = spy
    grads = []
    for names in (layouts[:1], layouts[1:]):
        runner.run(uneven_plan(world, names), module)
        engine.assign_home_grads()
        grads.append({n: p.grad.full_tensor() for n, p in home.items()})
        engine.clear_grad_store()
    return grads, in_flight, units.bytes["reduce_scatter"]


def run_both() -> list:
    return [run_fsdp_reduce(None), run_fsdp_reduce(torch.bfloat16)]


def test_fsdp_reduce_scatter_is_async_one_unit_in_flight_and_bf16_halves_bytes(ranks) -> None:
    for (fp32, bf16) in ranks(4).run(run_both):
        (sharded, replicated), in_flight, nbytes = fp32
        for name, g in replicated.items():
            assert float((sharded[name] - g).norm() / g.norm()) <= 1e-6, name
        # a unit's reduce-scatters were still in flight when the next unit's started, never more
        assert max(in_flight) >= 1 and all(n <= 2 for n in in_flight), in_flight
        (sharded16, _), _, nbytes16 = bf16
        assert nbytes16 * 2 == nbytes
        for name, g in replicated.items():
            assert float((sharded16[name] - g).norm() / g.norm()) <= 2e-2, name
