"""gpu_check part (h) ``compile``: one decoder block compiled with inductor (``compile_blocks``'s options,
the token dim dynamic) against the same block eager, on the device.

For a few mixes of document lengths (one graph must serve them all): forward + backward seconds eager and
compiled (the compiled block's speedup, what the cost model's compile term stands for), the relative
error of the output and gradients, and dynamo's counts (graphs, graph breaks, recompile-limit hits).
Never run on a GPU yet (2026-12-06): opt-in (``--parts compile``), its CPU dry run only.
"""

from __future__ import annotations

from typing import Any

import torch
from gpu_check_common import Budget, DeviceTimer, time_repeated

from lightning_hotspa.adapter.lightning.compile_blocks import check_compile_spec, compile_counts
from lightning_hotspa.models.config import LlamaConfig
from lightning_hotspa.models.llama import Block
from lightning_hotspa.models.rope import position_ids_from_cu_seqlens, rotary_cos_sin

__all__ = ["compile_check"]


def _inputs(config: LlamaConfig, lengths: list[int], device: torch.device, dtype: torch.dtype) -> tuple[Any, ...]:
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    x = torch.randn(sum(lengths), config.hidden, device=device, dtype=dtype)
    cos, sin = rotary_cos_sin(position_ids_from_cu_seqlens(cu), config.head_dim, config.rope_theta, dtype)
    return x, cos, sin, cu, max(lengths)


def _step(block: Block, inputs: tuple[Any, ...]) -> list[torch.Tensor]:
    x = inputs[0].detach().requires_grad_()
    out = block(x, *inputs[1:])
    out.float().square().mean().backward()
    grads = [out.detach(), x.grad, *(p.grad.clone() for p in block.parameters())]
    block.zero_grad(set_to_none=True)
    return grads


def compile_check(config: LlamaConfig, mixes: list[list[int]], device: torch.device, dtype: torch.dtype,
                  budget: Budget, backend: str = "inductor") -> dict[str, Any]:
    """Eager vs compiled block per length mix: seconds, speedup, worst relative error, dynamo's counts.

    Args:
        config: the model (one of its blocks runs).
        mixes: document lengths per packed row.
        device: where it runs.
        dtype: the working dtype.
        budget: this part's seconds.
        backend: torch.compile's backend.
    """
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    eager = Block(config).to(device=device, dtype=dtype)
    compiled = Block(config).to(device=device, dtype=dtype)
    compiled.load_state_dict(eager.state_dict())
    compiled.compile(**check_compile_spec({"backend": backend}))
    timer, cells = DeviceTimer(device), []
    for lengths in mixes:
        if not budget.allows():
            cells.append({"lengths": lengths, "status": "skipped: budget"})
            continue
        inputs = _inputs(config, lengths, device, dtype)
        pairs = [_step(compiled, inputs), _step(eager, inputs)]  # the compiled call first: it compiles here
        worst = max(float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))
                    for a, b in zip(*pairs, strict=True))
        seconds = {name: time_repeated(lambda b=block, i=inputs: _step(b, i), timer, budget)["seconds"]
                   for name, block in (("eager", eager), ("compiled", compiled))}
        cells.append({"lengths": lengths, "tokens": sum(lengths), "rel_error": worst, **seconds,
                      "speedup": seconds["eager"] / max(seconds["compiled"], 1e-12)})
    return {"backend": backend, "dtype": str(dtype).removeprefix("torch."), "hidden": config.hidden,
            "cells": cells, **compile_counts(), "timer": timer.kind}
