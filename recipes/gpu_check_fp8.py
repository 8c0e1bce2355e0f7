"""gpu_check part (j) ``fp8``: one decoder block with its projections in FP8 (torchao recipes, parallel/fp8.py)
against the same block in the working precision, on the device.

Per recipe: forward + backward seconds of the block (eager) in bf16 and in FP8, the speedup (what the cost
model's ``TORCHAO_FP8_RATES`` stand for, there measured compiled on the GEMMs), the relative error of the
output and gradients against bf16, and the ``torch._scaled_mm`` calls of one step (a TorchDispatchMode).
Never run on a GPU yet (2026-12-06): opt-in (``--parts fp8``), its CPU dry run only.
"""

from __future__ import annotations

from typing import Any

import torch
from gpu_check_common import Budget, DeviceTimer, time_repeated

from lightning_hotspa.models.config import LlamaConfig
from lightning_hotspa.models.llama import Block
from lightning_hotspa.models.rope import position_ids_from_cu_seqlens, rotary_cos_sin
from lightning_hotspa.parallel.fp8 import FP8_RECIPES, install_fp8
from lightning_hotspa.tools.fp8_layouts import scaled_mm_counter

__all__ = ["fp8_check"]


def _step(block: torch.nn.Module, x: torch.Tensor, rest: tuple[Any, ...]) -> list[torch.Tensor]:
    x = x.detach().requires_grad_()
    out = block(x, *rest)
    out.float().square().mean().backward()
    grads = [out.detach(), x.grad, *(p.grad.clone() for p in block.parameters())]
    block.zero_grad(set_to_none=True)
    return grads


def fp8_check(config: LlamaConfig, lengths: list[int], device: torch.device, dtype: torch.dtype,
              budget: Budget) -> dict[str, Any]:
    """bf16 vs each FP8 recipe on one block: seconds, speedup, worst relative error, _scaled_mm calls.

    Args:
        config: the model (one of its blocks runs; its dims must be divisible by 16).
        lengths: the document lengths of the packed row.
        device: where it runs.
        dtype: the working dtype.
        budget: this part's seconds.
    """
    torch.manual_seed(0)
    base = Block(config).to(device=device, dtype=dtype)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    x = torch.randn(sum(lengths), config.hidden, device=device, dtype=dtype)
    cos, sin = rotary_cos_sin(position_ids_from_cu_seqlens(cu), config.head_dim, config.rope_theta, dtype)
    rest = (cos, sin, cu, max(lengths))
    timer = DeviceTimer(device)
    reference = _step(base, x, rest)
    bf16_s = time_repeated(lambda: _step(base, x, rest), timer, budget)["seconds"]
    cells: dict[str, Any] = {}
    for recipe in FP8_RECIPES:
        if not budget.allows(3 * bf16_s):
            cells[recipe] = {"status": "skipped: budget"}
            continue
        block = Block(config).to(device=device, dtype=dtype)
        block.load_state_dict(base.state_dict())
        converted = install_fp8(torch.nn.ModuleList([block]), recipe)  # a block: a child of a ModuleList
        with scaled_mm_counter() as calls:
            got = _step(block, x, rest)
        worst = max(float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))
                    for a, b in zip(got, reference, strict=True))
        seconds = time_repeated(lambda b=block: _step(b, x, rest), timer, budget)["seconds"]
        cells[recipe] = {"fp8_linears": len(converted), "scaled_mm_calls": calls["calls"], "rel_error": worst,
                         "seconds": seconds, "speedup": bf16_s / max(seconds, 1e-12)}
    return {"dtype": str(dtype).removeprefix("torch."), "hidden": config.hidden, "tokens": sum(lengths),
            "bf16_seconds": bf16_s, "recipes": cells, "timer": timer.kind,
            "note": "eager blocks (no torch.compile): torchao's published rates are compiled"}
