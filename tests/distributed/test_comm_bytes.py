"""The byte counter itself: DTensor's functional collectives are counted, its bookkeeping ops are not."""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor

from lightning_hotspa.testing.comm_bytes import count_collective_bytes


def full_tensor_counted():
    """A sharded DTensor's ``full_tensor()`` (which reaches ``_wrap_tensor_autograd`` on torch 2.13)."""
    world = dist.get_world_size()
    mesh = DeviceMesh("cpu", torch.arange(world))
    full = torch.arange(8 * world * 3, dtype=torch.float32).reshape(8 * world, 3)
    sharded = distribute_tensor(full, mesh, [Shard(0)])
    with count_collective_bytes() as log:
        gathered = sharded.full_tensor()
    assert torch.equal(gathered, full)
    return log.calls, log.ranks


def test_full_tensor_counts_one_all_gather(ranks):
    for calls, members in ranks(2).run(full_tensor_counted):
        # one all-gather receiving the other rank's 8 x 3 fp32 rows; nothing else logged
        assert calls == [("all_gather_into_tensor", 8 * 3 * 4)], calls
        assert members == [(0, 1)]
