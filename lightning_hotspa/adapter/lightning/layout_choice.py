"""Which layouts a run uses: the candidate set, the default layout and activation checkpointing.

``HotSPaStrategy(layouts="auto")`` takes :func:`default_layouts` of the world size (the one place
that decides it), or for a module without a tensor-parallel plan the layouts it supports; plain
batches, validation and prediction run in the default layout (the most data-parallel candidate
unless chosen).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from ...activation_checkpointing import Checkpointing, parse_checkpointing_spec
from ...layout import Layout, LayoutError, parse_layouts
from .module_layouts import supported_layouts

__all__ = ["checkpointing_for", "check_checkpointing_layouts", "check_checkpointing_spec", "choose_default_layout",
           "default_layouts", "parse_layout_spec", "resolve_layouts"]


def default_layouts(world_size: int) -> list[Layout]:
    """A nesting candidate set: pure data parallel, then tp2 with growing cp for longer documents."""
    if world_size & (world_size - 1):
        return [Layout(dp=world_size)]
    layouts, cp = [Layout(dp=world_size)], 1
    while 2 * cp <= world_size:
        layouts.append(Layout(dp=world_size // (2 * cp), tp=2, cp=cp))
        cp *= 2
    return layouts


def parse_layout_spec(layouts: Any) -> list[Layout] | str:
    """``HotSPaStrategy(layouts=...)``: ``"auto"`` or a non-empty list of layouts."""
    if (isinstance(layouts, str) and layouts != "auto") or not isinstance(layouts, (str, Sequence)):
        raise LayoutError(f"layouts must be 'auto' or a list of layouts, got {layouts!r}")
    spec = layouts if layouts == "auto" else [Layout.parse(x) for x in layouts]
    if spec != "auto" and not spec:
        raise LayoutError("HotSPaStrategy(layouts=[]) is empty; give at least one layout or 'auto'")
    return spec


def resolve_layouts(spec: Sequence[Layout] | str, world_size: int, owner: str,
                    module: nn.Module | None = None) -> tuple[Layout, ...]:
    """The candidate layouts of a run on ``world_size`` ranks (``spec``: a list or ``"auto"``);
    ``"auto"`` gives ``module`` only layouts it supports (:mod:`.module_layouts`), saying so."""
    auto = default_layouts(world_size)
    supported = supported_layouts(module, world_size) if module is not None and spec == "auto" else None
    if supported is not None:
        auto = supported[0]
        rank_zero_info(supported[1])
    specs = auto if spec == "auto" else list(spec)
    try:
        return parse_layouts(specs, world_size)
    except LayoutError as exc:
        raise LayoutError(f"{owner}(layouts={[str(x) for x in specs]}): {exc} (devices x num_nodes; "
                          f"a run resumed on another number of ranks needs layouts for it, e.g. "
                          f"{[str(x) for x in auto]} or 'auto')") from None


def choose_default_layout(spec: Layout | None, layouts: Sequence[Layout]) -> Layout:
    """``spec`` if given (it must be a candidate), else the most data-parallel candidate."""
    if spec is not None:
        if spec not in layouts:
            raise LayoutError(f"default_layout {spec} is not among the layouts {[str(x) for x in layouts]}")
        return spec
    return max(layouts, key=lambda x: (x.dp, x.cp))


def check_checkpointing_spec(spec: Any) -> Any:
    """The strategy's ``activation_checkpointing`` argument, parsed once
    (:func:`~lightning_hotspa.activation_checkpointing.parse_checkpointing_spec`, the one grammar).

    Args:
        spec: ``"none"``, ``"selective"``, ``"full"`` (or True / False: full / none) for every layout,
            ``"auto"``, or a list of layouts (names, mappings or Layouts) that checkpoint fully;
            a mode comes back as a :class:`Checkpointing`, a list as a tuple of :class:`Layout`.
    """
    return parse_checkpointing_spec(spec)


def check_checkpointing_layouts(spec: Any, layouts: Sequence[Layout], owner: str) -> None:
    """Every layout an ``activation_checkpointing`` list names is one of ``layouts`` (else a LayoutError
    naming it and the candidates: a typo would otherwise checkpoint nothing, without a word).

    Args:
        spec: what :func:`check_checkpointing_spec` returned.
        layouts: the run's candidate layouts.
        owner: named in the error.
    """
    if not isinstance(spec, tuple):
        return
    unknown = [str(x) for x in spec if x not in layouts]
    if unknown:
        raise LayoutError(f"{owner}(activation_checkpointing={[str(x) for x in spec]}): {unknown} "
                          f"{'is' if len(unknown) == 1 else 'are'} not among the layouts {[str(x) for x in layouts]}; "
                          f"name candidate layouts only")


def checkpointing_for(spec: Any, layout: Layout) -> Checkpointing:
    """What ``layout`` recomputes under ``activation_checkpointing=spec`` (as :func:`check_checkpointing_spec`
    returns it; ``"auto"`` without a planner that decides: full where tp * cp > 1)."""
    if isinstance(spec, (bool, Checkpointing)):
        return Checkpointing.parse(spec)
    if spec == "auto":
        return Checkpointing.FULL if layout.tp * layout.cp > 1 else Checkpointing.NONE
    return Checkpointing.FULL if layout in spec else Checkpointing.NONE
