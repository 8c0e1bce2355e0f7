"""A wrapped Llama's training step set up in a fake world: what the fake-world counts share.

Under ``FakeTensorMode`` in a fake process group of ``world_size`` ranks (rank 0): the model on
meta, its tp roles and home shardings, home parameters (shard-only, empty), the parallel model and
the switch engine in the working dtype, and this rank's micro-batch of ``tokens`` per dp group.
``tools/reduce_exposure.py`` and ``recipes/benchmark_hot_path.py`` run their steps inside it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ..layout import Layout

__all__ = ["FakeLlama", "fake_llama"]


@dataclass
class FakeLlama:
    """What :func:`fake_llama` yields."""

    module: Any
    world: Any
    micro_batch: Any
    home: dict
    parallel: Any
    engine: Any


@contextlib.contextmanager
def fake_llama(config: Any, layout: Layout, world_size: int, tokens: int, *,
               working_dtype: torch.dtype = torch.bfloat16, tp_overlap: bool = True,
               **engine_kwargs: Any) -> Iterator[FakeLlama]:
    """The step's parts, inside the fake world and mode (the engine released and home restored on exit).

    Args:
        config: a ``LlamaConfig``.
        layout: the layout the step runs in.
        world_size: fake ranks.
        tokens: tokens per dp group's micro-batch (one document).
        working_dtype: the working copies' dtype (fp32 main grads either way).
        tp_overlap: ``ParallelModel``'s.
        engine_kwargs: ``SwitchEngine`` keyword arguments (bucket sizes).
    """
    from ..engine.home import build_home_parameters
    from ..engine.switch import SwitchEngine
    from ..host import set_host_reads
    from ..mesh import WorldMesh
    from ..parallel.model import ParallelModel
    from ..testing.fake_world import FakeWorld, fake_mode, host_reads_real
    from .memory import _empty_shard, _micro_batch, _Wrapped, llama_roles_and_shardings

    with FakeWorld(world_size):
        world = WorldMesh([layout])
        mb = _micro_batch(layout, world, tokens)
        with torch.device("meta"):
            module = _Wrapped(config)
        roles, shardings = llama_roles_and_shardings(module, config, layout, world)
        previous = set_host_reads(host_reads_real)
        try:
            with fake_mode():
                module.to_empty(device="cpu")
                home = build_home_parameters(world, shardings, None, init_shard=_empty_shard)
                parallel = ParallelModel(module, roles, world, tp_overlap=tp_overlap)
                parallel.restore(home)
                engine = SwitchEngine(world, shardings, home, working_dtype=working_dtype,
                                      grad_accum_dtype=torch.float32, **engine_kwargs)
                try:
                    yield FakeLlama(module, world, mb, home, parallel, engine)
                finally:
                    parallel.restore(home)
                    engine.release()
        finally:
            set_host_reads(previous)
