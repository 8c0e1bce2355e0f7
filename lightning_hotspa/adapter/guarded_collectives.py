"""The strategy's collectives (barrier, broadcast, reduce), each guarded by the step tracker: a
failed or timed-out collective becomes a :class:`~.reliability.CollectiveError` naming where this
rank was. A mixin of :class:`~.strategy.HotSPaStrategy`, which provides ``tracker`` and ``root_device``."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _sync_ddp_if_available,
)
from torch import Tensor

from .nccl_runtime import objects_to_cpu

__all__ = ["GuardedCollectives"]


class GuardedCollectives:
    tracker: Any
    root_device: Any

    def barrier(self, name: str | None = None) -> None:
        if not _distributed_is_initialized():
            return
        with self.tracker.guard(f"barrier {name!r}" if name else "a barrier"):
            if dist.get_backend() == "nccl":
                dist.barrier(device_ids=[self.root_device.index])
            else:
                dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [objects_to_cpu(obj)]  # CUDA tensors in a pickle land on cuda:0 of every rank
        with self.tracker.guard("a broadcast"):
            dist.broadcast_object_list(box, src)
        return box[0]

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if isinstance(tensor, Tensor):
            if not tensor.is_floating_point() and isinstance(reduce_op, str) and reduce_op.lower() in ("mean", "avg"):
                tensor = tensor.double()  # Lightning's mean of an int tensor truncates (e.g. summed batch sizes)
            with self.tracker.guard("a reduce"):
                return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor
