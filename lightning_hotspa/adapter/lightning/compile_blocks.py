"""Per-block ``torch.compile`` (``HotSPaStrategy(compile_blocks=...)``), as torchtitan applies it.

Lightning refuses ``torch.compile(model)`` for strategies other than single-device, DDP and FSDP
(the strategy must own the module's forward); compiling each transformer block (every child of an
``nn.ModuleList``) in place, AFTER the strategy has installed its tensor- and context-parallel
forwards, leaves the strategy's hooks and parameter swaps outside the compiled regions' ownership
and traces what the block really runs. A layout switch swaps the block's parameters, which dynamo
guards on: each layout compiles once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

__all__ = ["check_compile_spec", "compile_blocks"]


def check_compile_spec(spec: Any) -> dict[str, Any] | None:
    """``compile_blocks`` as torch.compile's keyword arguments (None: off).

    Args:
        spec: False / None (off), True (torch.compile's defaults) or a mapping of its keyword arguments.
    """
    if spec is None or spec is False:
        return None
    if spec is True:
        return {}
    if isinstance(spec, Mapping) and all(isinstance(k, str) for k in spec):
        return dict(spec)
    raise ValueError(f"compile_blocks must be True, False or a dict of torch.compile arguments, got {spec!r}")


def compile_blocks(module: nn.Module, options: Mapping[str, Any]) -> int:
    """Compiles every block of ``module`` in place; returns how many.

    Args:
        module: the LightningModule, its parallel forwards already installed.
        options: torch.compile's keyword arguments (``backend``, ``mode``, ``fullgraph``, ...).
    """
    blocks = [block for child in module.modules() if isinstance(child, nn.ModuleList) for block in child]
    if not blocks:
        raise ValueError(f"compile_blocks needs the blocks in an nn.ModuleList; {type(module).__name__} has none")
    for block in blocks:
        block.compile(**options)
    return len(blocks)
