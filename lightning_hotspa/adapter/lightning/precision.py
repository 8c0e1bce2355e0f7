"""The strategy's own precision handling.

Lightning maps ``bf16-true`` to ``HalfPrecision`` (casting every parameter, home state included) and
``bf16-mixed`` to autocast. Neither fits a strategy whose optimizer sees fp32 home shards while
compute runs on separate working copies, so the strategy converts Lightning's plugin into this one:

* ``32-true``: fp32 home, fp32 working copies;
* ``bf16-mixed``: fp32 home and optimizer state, bf16 working copies and compute, gradients reduced
  in fp32 (the HotSPa artifact's arrangement);
* ``bf16-true``: everything bf16, home state and optimizer state included;
* ``64-true``: everything fp64 — for equivalence tests, where fp32 reduction-order noise would
  otherwise be amplified by Adam over several steps.

Gradient-norm clipping uses the true global norm over the home gradients (DTensors sharded over
the world), counting each replicated shard once, with one all-reduce.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import Precision
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from ...group_collectives import world_collectives
from .nccl_runtime import collective_device

__all__ = ["HotSPaPrecision", "SUPPORTED_PRECISION", "as_hotspa_precision", "clip_grad_norm_global", "global_grad_norm"]

SUPPORTED_PRECISION = ("32-true", "bf16-mixed", "bf16-true", "64-true")


GRAD_ACCUMULATION = ("fp32", "bf16")


class HotSPaPrecision(Precision):
    """``grad_accumulation``: how bf16 working gradients are summed across micro-batches: ``"fp32"``
    (default; an fp32 main grad per working param, +4 bytes each) or ``"bf16"`` (autograd's own
    bf16 ``.grad``, for memory-tight runs). Pass ``plugins=[HotSPaPrecision("bf16-mixed",
    grad_accumulation="bf16")]`` to the Trainer."""

    def __init__(self, precision: str = "32-true", grad_accumulation: str = "fp32") -> None:
        if precision not in SUPPORTED_PRECISION:
            raise ValueError(f"HotSPaStrategy supports precision {', '.join(map(repr, SUPPORTED_PRECISION))}; "
                             f"got {precision!r}")
        if grad_accumulation not in GRAD_ACCUMULATION:
            raise ValueError(f"grad_accumulation must be one of {GRAD_ACCUMULATION}, got {grad_accumulation!r}")
        self.precision = precision
        self.grad_accumulation = grad_accumulation
        self.autocast_device: str | None = None  # set by the strategy for modules it does not own

    def enable_autocast(self, device_type: str | None) -> None:
        """Under ``bf16-mixed``, compute inside ``torch.autocast(device_type, bfloat16)``, as DDP does:
        for a module the strategy does not own (no ``tp_plan``), whose inputs and losses are fp32.
        Our own models run on their bf16 working copies without it. None turns it off.

        Args:
            device_type: the device type (``"cpu"``, ``"cuda"``) or None.
        """
        self.autocast_device = device_type if self.precision == "bf16-mixed" else None

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        """Every training / evaluation micro-batch's compute (autocast where enabled)."""
        if self.autocast_device is None:
            yield
        else:
            with torch.autocast(self.autocast_device, dtype=torch.bfloat16, cache_enabled=False):
                yield

    @property
    def grad_accum_dtype(self) -> torch.dtype | None:
        """The engine's accumulation dtype for working gradients (None: autograd's ``.grad``)."""
        return torch.float32 if self.grad_accumulation == "fp32" else None

    @property
    def working_dtype(self) -> torch.dtype:
        return {"32-true": torch.float32, "64-true": torch.float64}.get(self.precision, torch.bfloat16)

    @property
    def home_dtype(self) -> torch.dtype:
        return {"bf16-true": torch.bfloat16, "64-true": torch.float64}.get(self.precision, torch.float32)

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        return module  # the strategy builds home and working copies in the right dtypes itself

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        clip_grad_norm_global(self.main_params(optimizer), float(clip_val))


def global_grad_norm(params: Iterable[torch.Tensor]) -> torch.Tensor:
    """L2 norm of all gradients across the world; every rank gets the same value."""
    total = torch.zeros((), dtype=torch.float64)
    device = None
    rank = dist.get_rank() if dist.is_initialized() else 0
    for p in params:
        g = p.grad
        if g is None:
            continue
        if isinstance(g, DTensor):
            coords = g.device_mesh.get_coordinate()
            if coords is None or any(pl.is_replicate() and c != 0 for pl, c in zip(g.placements, coords)):
                continue  # a replica another rank already counts
            local = g.to_local()
        else:
            if rank != 0:
                continue  # a plain tensor is the same on every rank
            local = g
        device = local.device
        total = total.to(device) + local.detach().double().pow(2).sum()
    if device is not None:
        total = total.to(device)
    if dist.is_initialized():
        total = total.to(collective_device())  # NCCL refuses a CPU tensor (a rank with no local grads)
        world_collectives().all_reduce(total)
    return total.sqrt()


def clip_grad_norm_global(params: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
    params = [p for p in params if p.grad is not None]
    norm = global_grad_norm(params)
    scale = max_norm / (float(norm) + 1e-6)
    if scale < 1.0:
        for p in params:
            p.grad.mul_(scale)
    return norm


def as_hotspa_precision(plugin: Precision) -> HotSPaPrecision:
    """Lightning's precision plugin as the strategy's own (a clear error for anything unsupported)."""
    if isinstance(plugin, HotSPaPrecision):
        return plugin
    name = "32-true" if type(plugin) is Precision else getattr(plugin, "precision", None)
    return HotSPaPrecision(name)
