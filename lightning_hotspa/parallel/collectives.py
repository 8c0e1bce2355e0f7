"""Autograd-aware collectives over one :class:`RankGroup`, always in SHARD order.

Why a module of its own: the hot path computes on local tensors with explicit collectives
(docs/DESIGN.md §4), and every one of them must respect two facts:

* Megatron's conjugate pairs: an op that is the identity forward must all-reduce backward (``f``)
  and vice versa (``g``), otherwise tp ranks silently train on partial gradients;
* ``dist.new_group`` orders members by global rank while shard indices nest across mesh dims, so the
  output slot of a member is ``group.slot_of_shard[shard]``, not ``shard``. The all-to-alls here map
  slots to shards with :func:`lightning_hotspa.shard_rows.order`; the row gathers and reduce-scatters
  without autograd are :mod:`lightning_hotspa.shard_rows`' (the ground floor: the loss head uses one).

Every collective goes through the group's collectives object (``group.comm``,
:mod:`lightning_hotspa.group_collectives`), which looks the ``torch.distributed`` functions up at call time, so
:func:`lightning_hotspa.testing.comm_bytes.count_collective_bytes` sees every call.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..collective_names import collective
from ..mesh import RankGroup
from ..shard_rows import order as _order
from ..torch_compat import C10D_DEPRECATION_MESSAGE  # noqa: F401  (installs the warning filter)

__all__ = [
    "all_reduce_sum",
    "collective_pair",
    "copy_to_group",
    "reduce_from_group",
    "gather_last_dim",
    "all_to_all_heads_to_tokens",
    "all_to_all_tokens_to_heads",
    "permute_rows",
]


def all_reduce_sum(x: Tensor, group: RankGroup) -> Tensor:
    """Sum over the group into a fresh contiguous tensor (inputs may be saved or shared; no autograd).

    Args:
        x: this rank's addend.
        group: the group.
    """
    out = x.clone(memory_format=torch.contiguous_format)
    with collective("an all-reduce", group):
        group.comm.all_reduce(out)
    return out


class _CopyToGroup(torch.autograd.Function):
    """Megatron ``f``: identity forward, all-reduce backward (input of a column-parallel op)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: RankGroup) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return all_reduce_sum(grad, ctx.group), None


class _ReduceFromGroup(torch.autograd.Function):
    """Megatron ``g``: all-reduce forward, identity backward (output of a row-parallel op)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: RankGroup) -> Tensor:
        return all_reduce_sum(x, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


def _gather_last(x: Tensor, group: RankGroup) -> Tensor:
    n = group.size
    flat = x.contiguous()
    flat = flat.reshape(-1) if flat.dim() == 0 else flat
    buffer = flat.new_empty((n * flat.shape[0], *flat.shape[1:]))  # gloo wants dim-0 concatenation
    with collective("an all-gather", group):
        group.comm.all_gather_into(buffer, flat)
    buffer = buffer.view(n, *x.shape)
    if not group.in_shard_order:
        buffer = buffer.index_select(0, _order(group, "slot_of_shard", buffer.device))  # row s := shard s's slot
    return buffer.movedim(0, -2).reshape(*x.shape[:-1], n * x.shape[-1])


class _GatherLastDim(torch.autograd.Function):
    """All-gather along the last dim in shard order; backward keeps this rank's own slice."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: RankGroup) -> Tensor:
        ctx.index, ctx.width = group.index, x.shape[-1]
        return _gather_last(x, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        start = ctx.index * ctx.width
        return grad[..., start:start + ctx.width].contiguous(), None


def _exchange(send: Tensor, group: RankGroup) -> Tensor:
    """``send[s]`` goes to shard s; returns ``recv`` with ``recv[s]`` from shard s."""
    if not group.in_shard_order:
        send = send.index_select(0, _order(group, "shard_of_slot", send.device))  # slot k: its shard's block
    send = send.contiguous()
    recv = torch.empty_like(send)
    with collective("an all-to-all", group):
        group.comm.all_to_all_into(recv, send)
    if not group.in_shard_order:
        recv = recv.index_select(0, _order(group, "slot_of_shard", recv.device))
    return recv


def _heads_to_tokens(x: Tensor, group: RankGroup) -> Tensor:
    """[T, H, ...] -> [n*T, H/n, ...]: head block s to shard s, tokens of shard s at rows s*T."""
    n, tokens, heads = group.size, x.shape[0], x.shape[1]
    send = x.reshape(tokens, n, heads // n, *x.shape[2:]).movedim(1, 0)
    return _exchange(send, group).reshape(n * tokens, heads // n, *x.shape[2:])


def _tokens_to_heads(y: Tensor, group: RankGroup) -> Tensor:
    """Inverse of :func:`_heads_to_tokens`: [n*T, h, ...] -> [T, n*h, ...]."""
    n, heads = group.size, y.shape[1]
    tokens = y.shape[0] // n
    recv = _exchange(y.reshape(n, tokens, heads, *y.shape[2:]), group)
    return recv.movedim(0, 1).reshape(tokens, n * heads, *y.shape[2:])


def collective_pair(name: str, forward: Any, adjoint: Any, doc: str) -> type[torch.autograd.Function]:
    """An autograd function that runs ``forward(x, group)`` and, in backward, its adjoint collective
    ``adjoint(grad, group)`` on the same group.

    Args:
        name: the class name (shown in autograd graphs and errors).
        forward: the forward collective, ``(Tensor, RankGroup) -> Tensor``.
        adjoint: the backward collective, same signature.
        doc: the class docstring.
    """

    def run_forward(ctx: Any, x: Tensor, group: RankGroup) -> Tensor:
        ctx.group = group
        return forward(x, group)

    def run_backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return adjoint(grad, ctx.group), None  # each adjoint makes its send buffer contiguous itself

    return type(name, (torch.autograd.Function,), {"__doc__": doc, "__module__": __name__,
                                                  "forward": staticmethod(run_forward),
                                                  "backward": staticmethod(run_backward)})


_HeadsToTokens = collective_pair("_HeadsToTokens", _heads_to_tokens, _tokens_to_heads,
                                 "Ulysses: heads scattered, tokens gathered (backward: the inverse).")
_TokensToHeads = collective_pair("_TokensToHeads", _tokens_to_heads, _heads_to_tokens,
                                 "Ulysses back: tokens scattered, heads gathered (backward: the inverse).")


class _PermuteRows(torch.autograd.Function):
    """``x[perm]`` whose backward is a gather with the inverse permutation (no scatter-add)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, perm: Tensor, inverse: Tensor) -> Tensor:
        ctx.save_for_backward(inverse)
        return x.index_select(0, perm)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def copy_to_group(x: Tensor, group: RankGroup) -> Tensor:
    """``f``: identity forward, all-reduce of the gradient over ``group`` backward."""
    return x if group.size == 1 else _CopyToGroup.apply(x, group)


def reduce_from_group(x: Tensor, group: RankGroup) -> Tensor:
    """``g``: all-reduce forward, identity backward."""
    return x if group.size == 1 else _ReduceFromGroup.apply(x, group)


def gather_last_dim(x: Tensor, group: RankGroup) -> Tensor:
    """Concatenate the members' last dims in shard order (e.g. vocab-sharded logits)."""
    return x if group.size == 1 else _GatherLastDim.apply(x, group)


def all_to_all_heads_to_tokens(x: Tensor, group: RankGroup) -> Tensor:
    """Ulysses forward exchange: scatter heads (dim 1), gather tokens (dim 0) in shard order."""
    return x if group.size == 1 else _HeadsToTokens.apply(x, group)


def all_to_all_tokens_to_heads(y: Tensor, group: RankGroup) -> Tensor:
    """Ulysses backward exchange: scatter tokens (dim 0), gather heads (dim 1) in shard order."""
    return y if group.size == 1 else _TokensToHeads.apply(y, group)


def permute_rows(x: Tensor, perm: Tensor, inverse: Tensor) -> Tensor:
    """Rows of ``x`` in the order ``perm``; ``inverse`` must be its inverse permutation."""
    return _PermuteRows.apply(x, perm, inverse)
