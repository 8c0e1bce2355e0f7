"""Which candidate layouts ``layouts="auto"`` may give a module, and why.

The default candidate set (pure data parallel, then tp2 with growing cp) needs a tensor-parallel
plan for its tp layouts, and context parallelism needs an attention core the strategy can split
(a callable ``core_attention(q, k, v, cu_seqlens, max_seqlen)``: every other op of a transformer is
token-wise). An ordinary LightningModule has neither, so "auto" must not hand it layouts that fail
at setup: it gets what the module supports, and one info line says which and why.
"""

from __future__ import annotations

from torch import nn

from ...layout import Layout

__all__ = ["supported_layouts"]


def _tp_plan_problem(module: nn.Module) -> str | None:
    """None if ``module.tp_plan(2)`` gives a plan, else why not (for the info line)."""
    tp_plan = getattr(module, "tp_plan", None)
    if not callable(tp_plan):
        return f"{type(module).__name__} defines no tp_plan(tp) method"
    try:
        tp_plan(2)
    except Exception as exc:  # noqa: BLE001 - any failure means: no tensor parallel for this module
        return f"{type(module).__name__}.tp_plan(2) fails ({exc})"
    return None


def supported_layouts(module: nn.Module, world_size: int) -> tuple[list[Layout], str] | None:
    """``None`` where the module supports the default candidates (it has a tp plan); otherwise the
    layouts it supports — data parallel, plus ``dp x cp`` for cp = 2, 4, ... up to the world size
    where its attention core is one context parallel can split — and the reason, for the log."""
    no_tp = _tp_plan_problem(module)
    if no_tp is None:
        return None
    layouts = [Layout(dp=world_size)]
    has_core = any(callable(getattr(m, "core_attention", None)) for m in module.modules())
    if has_core and not world_size & (world_size - 1):
        cp = 2
        while cp <= world_size:
            layouts.append(Layout(dp=world_size // cp, cp=cp))
            cp *= 2
        why_cp = "context parallel splits its core_attention"
    else:
        why_cp = ("no context parallel: it exposes no core_attention(q, k, v, cu_seqlens, max_seqlen)"
                  if not has_core else f"no context parallel: world size {world_size} is not a power of 2")
    reason = (f"hotspa: layouts='auto' for {type(module).__name__}: {[str(x) for x in layouts]} "
              f"(no tensor parallel: {no_tp}; {why_cp})")
    return layouts, reason
