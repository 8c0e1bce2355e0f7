"""Vocab-parallel cross entropy: the token-mean CE of vocab-sharded logits without gathering them.

Why: gathering the LM head's logits makes every tp rank hold (and back-propagate through) the full
``[T, vocab]`` fp32 tensor, which dominates activation memory for real vocabularies (30K-150K) and
moves ``(tp-1)/tp`` of it per rank. Megatron's alternative needs only three ``[T]`` reductions: the
row max (MAX), and the sum of exponentials with the target logit (one fused SUM). The result and
its gradient equal :func:`lightning_hotspa.models.token_mean_cross_entropy` on the gathered logits.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ..collective_names import collective
from ..mesh import RankGroup
from ..models.vocab import check_token_ids
from ..plan import IGNORE_INDEX
from .state import ParallelState

__all__ = ["IGNORE_INDEX", "vocab_parallel_cross_entropy", "VocabParallelLoss"]


class _VocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: Tensor, labels: Tensor, group: RankGroup) -> Tensor:
        z = logits if logits.dtype == torch.float64 else logits.float()  # at least fp32
        width = z.shape[-1]
        start = group.index * width
        row_max = z.detach().amax(dim=-1)
        with collective("the vocab-parallel loss's max all-reduce", group):
            group.comm.all_reduce(row_max, op="max")
        exp = (z - row_max.unsqueeze(-1)).exp_()  # fresh tensor: kept for backward as softmax
        valid = labels != IGNORE_INDEX
        local = labels - start
        mine = valid & (local >= 0) & (local < width)
        index = local.masked_fill(~mine, 0)
        target = z.gather(-1, index.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        sums = torch.stack([exp.sum(dim=-1), target])
        with collective("the vocab-parallel loss's sum all-reduce", group):
            group.comm.all_reduce(sums)
        sum_exp, target = sums[0], sums[1]
        per_token = (sum_exp.log() + row_max - target).masked_fill(~valid, 0.0)
        count = valid.sum().clamp(min=1)
        exp.div_(sum_exp.unsqueeze(-1))  # softmax over the whole vocabulary, own slice
        ctx.save_for_backward(exp, index, mine, valid, count)
        ctx.input_dtype = logits.dtype
        return per_token.sum() / count

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        softmax, index, mine, valid, count = ctx.saved_tensors
        g = softmax  # reused in place: backward runs once
        g.scatter_add_(-1, index.unsqueeze(-1), -mine.to(g.dtype).unsqueeze(-1))
        g.mul_((grad / count) * valid.to(g.dtype).unsqueeze(-1))
        return g.to(ctx.input_dtype), None, None


def vocab_parallel_cross_entropy(logits: Tensor, labels: Tensor, group: RankGroup) -> Tensor:
    """Mean fp32 CE over ``labels != -100`` of logits sharded on the last dim over ``group``
    (shard ``group.index`` holds vocab rows ``[index*V_local, (index+1)*V_local)``)."""
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree")
    # a label outside every shard would find its target logit on no rank: refuse it
    check_token_ids(labels, logits.shape[-1] * group.size, "labels", ignore_index=IGNORE_INDEX)
    return _VocabParallelCE.apply(logits, labels, group)


class VocabParallelLoss:
    """A drop-in ``loss_fn(logits, labels)``: vocab-parallel CE on the head's sharded logits while
    tp > 1, the original function otherwise (also for full-width logits from anywhere else)."""

    def __init__(self, state: ParallelState, original: Any, head: nn.Linear) -> None:
        self.state = state
        self.original = original
        self.head = head

    def __call__(self, logits: Tensor, labels: Tensor) -> Tensor:
        groups = self.state.groups
        if groups is None or groups.tp.size == 1 or logits.shape[-1] != self.head.weight.shape[0]:
            return self.original(logits, labels)
        return vocab_parallel_cross_entropy(logits, labels, groups.tp)
