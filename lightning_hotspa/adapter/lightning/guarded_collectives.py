"""The strategy's collectives (barrier, broadcast, reduce), each guarded by the step tracker: a
failed or timed-out collective becomes a :class:`~.reliability.CollectiveError` naming where this
rank was. Inside a step, ``reduce`` keeps a logged value local for the step's one metric reduction
(``metric_sync.StepMetricSync``). A mixin of :class:`~.strategy.HotSPaStrategy`, which provides
``tracker``, ``metric_sync`` and ``root_device``."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from ...group_collectives import world_collectives
from .lightning_compat import distributed_is_initialized, sync_ddp_if_available
from .nccl_runtime import objects_to_cpu

__all__ = ["GuardedCollectives"]


class GuardedCollectives:
    tracker: Any
    metric_sync: Any
    root_device: Any

    def barrier(self, name: str | None = None) -> None:
        if not distributed_is_initialized():
            return
        with self.tracker.guard(f"barrier {name!r}" if name else "a barrier"):
            world_collectives().barrier(self.root_device.index)  # NCCL: at the rank's device

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not distributed_is_initialized():
            return obj
        box = [objects_to_cpu(obj)]  # CUDA tensors in a pickle land on cuda:0 of every rank
        with self.tracker.guard("a broadcast"):
            world_collectives().broadcast_object_list(box, src)
        return box[0]

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if isinstance(tensor, Tensor):
            if self.metric_sync.active:  # self.log(sync_dist=True) inside a step: reduced at its end
                return self.metric_sync.intercept(tensor, reduce_op)
            if not tensor.is_floating_point() and isinstance(reduce_op, str) and reduce_op.lower() in ("mean", "avg"):
                tensor = tensor.double()  # Lightning's mean of an int tensor truncates (e.g. summed batch sizes)
            with self.tracker.guard("a reduce"):
                return sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor
