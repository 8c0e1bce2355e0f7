"""Sequence parallelism (Megatron-LM, Korthikanti et al. 2022): the token-split collectives at the
edges of the tp regions.

Between a row-parallel layer and the next column-parallel one (norms, the residual stream) every
tp rank holds only its share of the tokens: rows ``[index*T/tp, (index+1)*T/tp)`` of the packed row
(the token dim is the second to last). Where plain tp all-reduces a row-parallel output (``g``) it
reduce-scatters along the tokens (:func:`scatter_tokens`); where it copies a column-parallel input
(``f``) it all-gathers them (:func:`gather_tokens`, or a region's own gather:
:mod:`.regions`). Same bytes per rank as the one all-reduce, 1/tp of the residual stream and norm
activations per rank (docs/DESIGN.md §11).
"""

from __future__ import annotations

from torch import Tensor

from ..layout import LayoutError
from ..mesh import RankGroup
from ..shard_rows import all_gather_rows, reduce_scatter_rows
from .collectives import collective_pair

__all__ = ["all_gather_tokens", "check_token_split", "gather_tokens", "reduce_scatter_tokens", "scatter_tokens"]


def all_gather_tokens(x: Tensor, group: RankGroup) -> Tensor:
    """All-gather along the token dim (-2) in shard order (no autograd: :func:`gather_tokens` has it).

    Args:
        x: this rank's tokens ``[..., T/tp, H]``.
        group: the tp group.
    """
    rows = x.movedim(-2, 0)
    return all_gather_rows(rows, group).movedim(0, -2)


def reduce_scatter_tokens(x: Tensor, group: RankGroup) -> Tensor:
    """Sum over the group, keeping this rank's block of tokens (dim -2; no autograd).

    Args:
        x: partial sums ``[..., T, H]``.
        group: the tp group.
    """
    check_token_split(x.shape[-2], group)
    rows = x.movedim(-2, 0).contiguous()
    return reduce_scatter_rows(rows, group).movedim(0, -2)


_GatherTokens = collective_pair("_GatherTokens", all_gather_tokens, reduce_scatter_tokens,
                                "All-gather forward, reduce-scatter backward (input of column-parallel ops).")
_ScatterTokens = collective_pair("_ScatterTokens", reduce_scatter_tokens, all_gather_tokens,
                                 "Reduce-scatter forward, all-gather backward (output of a row-parallel op).")


def scatter_tokens(x: Tensor, group: RankGroup) -> Tensor:
    """Partial sums ``[..., T, H]`` -> this rank's summed tokens ``[..., T/tp, H]`` (backward: all-gather)."""
    return x if group.size == 1 else _ScatterTokens.apply(x, group)


def gather_tokens(x: Tensor, group: RankGroup) -> Tensor:
    """This rank's tokens ``[..., T/tp, H]`` -> all of them in shard order (backward: reduce-scatter)."""
    return x if group.size == 1 else _GatherTokens.apply(x, group)


def check_token_split(tokens: int, group: RankGroup) -> None:
    """Raises a :class:`LayoutError` unless ``tokens`` split evenly over the tp ``group``.

    Args:
        tokens: the token count on this rank.
        group: the tp group.
    """
    if tokens % group.size:
        raise LayoutError(f"sequence parallelism: {tokens} tokens on this rank are not divisible by tp="
                          f"{group.size}; build micro-batches with pack_micro_batch(..., tp_size={group.size}) "
                          f"(slice_plan does), which pads the last document (labels -100)")
