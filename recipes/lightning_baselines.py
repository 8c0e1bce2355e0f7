"""Lightning's own ``ModelParallelStrategy`` recipe for our Llama: the baseline the benchmarks compare to,
and the process-group clean-up between the many ``Trainer.fit`` runs a benchmark makes in one process.

torch tensor parallelism (``parallelize_module`` with Colwise/Rowwise on the ``tensor_parallel``
sub-mesh, no sequence parallelism) and FSDP2 ``fully_shard`` per block on ``data_parallel``, applied in
``configure_model`` as Lightning's docs show. Shared by ``benchmark_overhead.py`` and
``benchmark_e2e.py`` (``e2e_mixed.py``: :func:`as_launched_ranks`).

Our FFN's down projection is fused with the SwiGLU gate (``models.kernels.SwiGLUDown``:
``w2(a, b) = silu(a) * b @ W.T``, two inputs): torch's ``RowwiseParallel`` reads one input and fails on
it, so ``w2`` gets :class:`SwiGLUDownRowwise`, the same sharding for a two-input forward (weight
``Shard(1)``, both column-parallel inputs read as ``Shard(-1)``, the partial output summed to
``Replicate``): the math and the collectives of a rowwise ``w2`` on the unfused FFN. The loss goes
through full logits (``ColwiseParallel(output_layouts=Replicate())`` on the head, as Lightning's tensor
parallel example does): our fused blocked loss head takes the labels as a second input, which torch's
``ColwiseParallel`` drops; so the baseline keeps a ``[T, vocab]`` logits tensor that our runtime does not.
"""

from __future__ import annotations

import contextlib
import gc
import os
from typing import Any

import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle


class SwiGLUDownRowwise(ParallelStyle):
    """``RowwiseParallel`` for a module whose forward takes SEVERAL column-parallel inputs (our fused
    ``SwiGLUDown``): its weight sharded on the input dim, every input wrapped as ``Shard(-1)``, the
    ``Partial`` output reduced to a replicated local tensor."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        def partition(name: str, mod: nn.Module, mesh) -> None:
            if name == "":
                mod.register_parameter("weight", nn.Parameter(distribute_tensor(mod.weight, mesh, [Shard(1)])))

        def inputs(mod: nn.Module, args: tuple, mesh) -> tuple:
            return tuple(DTensor.from_local(t, mesh, [Shard(-1)], run_check=False) for t in args)

        def output(mod: nn.Module, out: DTensor, mesh) -> Tensor:
            return out.redistribute(placements=[Replicate()]).to_local()

        return distribute_module(module, device_mesh, partition, inputs, output)


def as_launched_ranks() -> None:
    """Tells Lightning that this pool rank's processes already exist (the variables torchrun sets), so a
    ``Trainer(devices=N)`` joins the running process group instead of re-running ``sys.argv`` N-1 times
    per rank (a cascade of processes)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update({"LOCAL_RANK": str(rank), "NODE_RANK": "0", "WORLD_SIZE": str(world), "RANK": str(rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"})


def model_parallel_llama(config: Any, seed: int, lr: float = 1e-3):
    """A ``LlamaLM`` that parallelizes itself for ``ModelParallelStrategy``.

    A batch is one ``MicroBatch`` or a list of ``(MicroBatch, weight)`` pairs: the weighted sum of
    their token-mean losses is one optimizer step's loss (a whole step plan's share of one rank).
    """
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from lightning_hotspa.models import LlamaLM

    class ModelParallelLlamaLM(LlamaLM):
        fused_loss_head = False  # logits, then the loss: ColwiseParallel passes the head one input

        def configure_model(self) -> None:
            tp_mesh = self.device_mesh["tensor_parallel"]
            plan = {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
                    "output": ColwiseParallel(output_layouts=Replicate())}
            for i in range(len(self.model.layers)):
                p = f"layers.{i}."
                plan.update({p + "attention.wq": ColwiseParallel(), p + "attention.wk": ColwiseParallel(),
                             p + "attention.wv": ColwiseParallel(), p + "attention.wo": RowwiseParallel(),
                             p + "feed_forward.w1": ColwiseParallel(), p + "feed_forward.w3": ColwiseParallel(),
                             p + "feed_forward.w2": SwiGLUDownRowwise()})
            parallelize_module(self.model, tp_mesh, plan)
            dp_mesh = self.device_mesh["data_parallel"]
            for layer in self.model.layers:
                fully_shard(layer, mesh=dp_mesh)
            fully_shard(self.model, mesh=dp_mesh)

        def training_step(self, batch: Any, batch_idx: int = 0) -> Tensor:
            if not isinstance(batch, list):
                return super().training_step(batch, batch_idx)
            return sum(weight * super(ModelParallelLlamaLM, self).training_step(mb, batch_idx) for mb, weight in batch)

    return ModelParallelLlamaLM(config, seed=seed, lr=lr)


@contextlib.contextmanager
def own_process_groups():
    """Destroys the process groups a run creates (our WorldMesh's, the DeviceMesh's, Lightning's) when
    it ends: gloo keeps threads per group, and the runs of one benchmark process piled up 581 threads
    per rank polling sockets (top: 43 % system CPU), slowing every later configuration.

    Limit: a later Lightning ``ModelParallelStrategy`` run on a multi-dim mesh (dp2 x tp2, as in
    ``benchmark_overhead.py``, which therefore does not use this) fails with "Could not resolve the
    process group registered under the name ...": something still holds an earlier, equal mesh
    (``DeviceMesh`` equality ignores its groups); clearing DTensor's sharding-propagation caches did not
    help. Its 1-D tp4 mesh over the whole world (``benchmark_e2e.py``) uses the default group and runs;
    so do our strategy's runs (5 repeats of every configuration)."""
    from torch.distributed import distributed_c10d

    before = set(distributed_c10d._world.pg_map)
    try:
        yield
    finally:
        dist.barrier()
        for group in [g for g in distributed_c10d._world.pg_map if g not in before]:
            dist.destroy_process_group(group)
        gc.collect()  # a group's threads end when the last reference to it goes

