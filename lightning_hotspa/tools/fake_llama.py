"""A wrapped Llama's training step set up in a fake world: what the fake-world counts share.

Under ``FakeTensorMode`` in a fake process group of ``world_size`` ranks (as rank 0 or a chosen one): the model on
meta, its tp roles and home shardings, home parameters (shard-only, empty), the parallel model and
the switch engine in the working dtype, and this rank's micro-batch of ``tokens`` per dp group.
``tools/reduce_exposure.py``, ``tools/memory_pipeline.py`` and ``recipes/benchmark_hot_path.py`` run their
steps inside it.
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
def fake_llama(config: Any, layout: Layout, world_size: int, tokens: int, *, rank: int = 0,
               working_dtype: torch.dtype = torch.bfloat16, grad_accum_dtype: torch.dtype | None = torch.float32,
               tp_overlap: bool = True, **engine_kwargs: Any) -> Iterator[FakeLlama]:
    """The step's parts, inside the fake world and mode (the engine released and home restored on exit).

    Args:
        config: a ``LlamaConfig``.
        layout: the layout the step runs in (``pp > 1``: torch's pipeline shape votes made static).
        world_size: fake ranks.
        tokens: tokens per dp group's micro-batch (one document).
        rank: the fake rank this process is.
        working_dtype: the working copies' dtype.
        grad_accum_dtype: the working gradients' accumulation dtype (fp32 main grads by default).
        tp_overlap: ``ParallelModel``'s.
        engine_kwargs: ``SwitchEngine`` keyword arguments (bucket sizes).
    """
    from ..engine.home import build_home_parameters
    from ..engine.switch import SwitchEngine
    from ..host import set_host_reads
    from ..mesh import WorldMesh
    from ..parallel.model import ParallelModel
    from ..testing.fake_world import FakeWorld, fake_mode, host_reads_real, static_pipeline_votes
    from .memory_parts import Wrapped, empty_shard, llama_roles_and_shardings, one_document_micro_batch

    votes = static_pipeline_votes() if layout.pp > 1 else contextlib.nullcontext()
    with FakeWorld(world_size, rank), votes:
        world = WorldMesh([layout])
        mb = one_document_micro_batch(layout, world, tokens, rank)
        with torch.device("meta"):
            module = Wrapped(config)
        roles, shardings = llama_roles_and_shardings(module, config, layout, world)
        previous = set_host_reads(host_reads_real)
        try:
            with fake_mode():
                module.to_empty(device="cpu")
                home = build_home_parameters(world, shardings, None, init_shard=empty_shard)
                parallel = ParallelModel(module, roles, world, tp_overlap=tp_overlap)
                parallel.restore(home)
                engine = SwitchEngine(world, shardings, home, working_dtype=working_dtype,
                                      grad_accum_dtype=grad_accum_dtype, **engine_kwargs)
                try:
                    yield FakeLlama(module, world, mb, home, parallel, engine)
                finally:
                    parallel.restore(home)
                    engine.release()
        finally:
            set_host_reads(previous)
