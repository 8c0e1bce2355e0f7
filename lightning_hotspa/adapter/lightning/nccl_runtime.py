"""What NCCL and the CUDA allocator need that gloo on CPU does not (docs/gpu-runtime.md).

* ``collective_device``: NCCL takes only tensors on the rank's CUDA device; gloo takes CPU tensors.
  A small tensor built on the host for a collective goes to this device first.
* ``objects_to_cpu``: object collectives pickle their payload; a CUDA tensor inside it is
  unpickled onto the same device index on every receiver (cuda:0 of every rank when it came from
  rank 0), so payloads are moved to the CPU before the collective (``group_collectives``' function,
  which the checkpoint code uses too; re-exported here).
* ``apply_allocator_settings``: every switch frees working copies and allocates others of other
  shapes, and micro-batches vary in size: the caching allocator's ``expandable_segments`` keeps
  that from fragmenting memory the memory model cannot see. It must be set before the first CUDA
  allocation; a value the user set (``PYTORCH_CUDA_ALLOC_CONF`` / ``PYTORCH_ALLOC_CONF``) wins.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from typing import Any

import torch
import torch.distributed as dist

from ...group_collectives import objects_to_cpu

__all__ = ["ALLOCATOR_SETTINGS", "apply_allocator_settings", "collective_device", "objects_to_cpu"]

#: what the strategy sets on CUDA unless the user set the allocator's configuration
ALLOCATOR_SETTINGS = "expandable_segments:True"
_ALLOC_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def collective_device(group: Any = None) -> torch.device:
    """The device tensors of ``group``'s collectives must live on (the default group: None).

    Args:
        group: a process group, or None for the default one.
    """
    if dist.is_available() and dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def apply_allocator_settings(environ: MutableMapping[str, str] | None = None) -> str | None:
    """Sets :data:`ALLOCATOR_SETTINGS` for the CUDA caching allocator unless the user set one; returns
    what was set (None: the user's value stands).

    Args:
        environ: the environment to change (default ``os.environ``); call before the first CUDA allocation.
    """
    environ = os.environ if environ is None else environ
    if any(name in environ for name in _ALLOC_VARS):
        return None
    environ["PYTORCH_CUDA_ALLOC_CONF"] = ALLOCATOR_SETTINGS
    return ALLOCATOR_SETTINGS
