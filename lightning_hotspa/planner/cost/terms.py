"""Small terms the cost model shares: its error, the model preset, and which layouts share gradients."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ...layout import Layout
from ...model_shape import ModelShape, describe_model

__all__ = ["CostModelError", "gradient_kind", "resolve_model", "shares_gradients"]


class CostModelError(ValueError):
    """A model / world / layout combination the cost model cannot price; the message names it."""


def resolve_model(model: ModelShape | str | Any) -> ModelShape:
    """The :class:`ModelShape` the cost model prices (:func:`describe_model`: a shape, a preset name such
    as ``llama7b``, a ``LlamaConfig`` or a Hugging Face config), its errors as :class:`CostModelError`.

    Args:
        model: what to price.
    """
    try:
        return describe_model(model)
    except (ValueError, TypeError) as err:
        raise CostModelError(str(err)) from None


def shares_gradients(a: Layout, b: Layout) -> bool:
    """Stages in ``a`` then ``b`` share working shards and gradient states (same tp, and pp), so the
    runtime reduces once after both (``SwitchEngine.shares_gradients``); their ``stage_fixed`` agree.
    A sharded working copy (``fsdp``) keeps its gradients at its own shard (reduce-scattered every
    micro-batch), a replicated one at the tp shard: they share only with their own kind, as in the
    runtime (a plain fsdp stage's ``stage_fixed`` is 0; an HSDP one, ``:fsdp8``, sums its replicas)."""
    return gradient_kind(a) == gradient_kind(b)


def gradient_kind(par: Layout) -> tuple[int, int, int]:
    """(tp, pp, fsdp shard: 0 when replicated): stages of one kind share gradients
    (:func:`shares_gradients`)."""
    return (par.tp, par.pp, par.fsdp_shard if par.fsdp else 0)


def cheapest_per_kind(reductions: Iterable[tuple[tuple[int, int, int], float]]) -> float:
    """The reductions a plan pays: one per gradient kind (:func:`gradient_kind`), the cheapest of that kind.

    Args:
        reductions: (gradient kind, stage reduction seconds) per layout the plan uses, in stage order.
    """
    cheapest: dict[tuple[int, int, int], float] = {}
    for kind, seconds in reductions:
        cheapest[kind] = min(seconds, cheapest.get(kind, seconds))
    return sum(cheapest.values())
