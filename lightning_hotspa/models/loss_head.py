"""The LM head and its cross-entropy in one step that never holds fp32 ``[tokens, vocab]``.

Why (docs/DESIGN.md §11): the head's fp32 logits, their softmax and its gradient cost ~12 B x vocab
per token at the forward/backward turn (1.5 MB per token at Llama-3's 128,256), more than a whole
transformer layer. Here the vocabulary is walked in blocks of ``vocab_block`` rows: the forward keeps
only each token's fp32 log-sum-exp and target logit; the backward recomputes each block's logits
from the saved hidden states and weight, turns them into ``softmax - one_hot`` and folds them into
the hidden gradient (an fp32 sum over blocks) and the weight gradient (one GEMM per block over all
tokens, so each weight row's gradient is one full-precision reduction, as with the plain head). Cost:
one extra head GEMM in backward. Vocab-parallel (``group``: the tp
:class:`~lightning_hotspa.mesh.RankGroup`): each rank walks its own rows and the per-token
log-sum-exps and targets are combined by one all-gather of both over the whole micro-batch, merged on
every rank in shard order (one collective where a MAX and a SUM all-reduce took two; 8 x tp bytes per
token).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..checks import check_int
from ..plan import IGNORE_INDEX
from ..shard_rows import all_gather_rows
from .vocab import check_token_ids

__all__ = ["DEFAULT_VOCAB_BLOCK", "LMHead", "linear_cross_entropy"]

#: vocabulary rows per block: fp32 logits of one block cost 4 x this many bytes per token
DEFAULT_VOCAB_BLOCK = 8192


def _wide(t: Tensor) -> Tensor:
    """``t`` in at least fp32 (fp64 stays fp64)."""
    return t if t.dtype == torch.float64 else t.float()


class _LinearCrossEntropy(torch.autograd.Function):
    """Token-mean CE of ``hidden @ weight.T`` (rows of ``weight``: this rank's vocabulary slice)."""

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, labels: Tensor, block: int, group: Any) -> Tensor:
        rows = weight.shape[0]
        start = group.index * rows if group is not None else 0
        valid = labels != IGNORE_INDEX
        local = labels - start
        mine = valid & (local >= 0) & (local < rows)
        index = local.masked_fill(~mine, 0)
        acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        lse = torch.full(labels.shape, float("-inf"), dtype=acc, device=hidden.device)
        target = torch.zeros(labels.shape, dtype=acc, device=hidden.device)
        for lo in range(0, rows, block):
            hi = min(lo + block, rows)
            z = _wide(F.linear(hidden, weight[lo:hi]))
            inside = mine & (index >= lo) & (index < hi)
            picked = z.gather(-1, (index - lo).clamp(0, hi - lo - 1).unsqueeze(-1)).squeeze(-1)
            target = target + picked.masked_fill(~inside, 0.0)
            top = z.amax(dim=-1)  # the block's log-sum-exp in place (torch.logsumexp holds a second copy)
            block_lse = z.sub_(top.unsqueeze(-1)).exp_().sum(dim=-1).log_().add_(top)
            lse = torch.logaddexp(lse, block_lse)
            del z
        if group is not None and group.size > 1:  # one all-gather of every shard's (lse, target), merged here
            shards = all_gather_rows(torch.stack([lse, target]).unsqueeze(0), group)  # [tp, 2, T]
            top = shards[:, 0].amax(dim=0)
            lse = top + (shards[:, 0] - top).exp().sum(dim=0).log()
            target = shards[:, 1].sum(dim=0)
        per_token = (lse - target).masked_fill(~valid, 0.0)
        count = valid.sum().clamp(min=1)
        ctx.save_for_backward(hidden, weight, index, mine, valid, lse, count)
        ctx.block = block
        return per_token.sum() / count

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        hidden, weight, index, mine, valid, lse, count = ctx.saved_tensors
        rows, block = weight.shape[0], ctx.block
        scale = (grad / count).to(lse.dtype) * valid.to(lse.dtype).unsqueeze(-1)  # [T, 1]
        grad_hidden = torch.zeros(hidden.shape, dtype=lse.dtype, device=hidden.device)
        grad_weight = torch.empty_like(weight)
        for lo in range(0, rows, block):
            hi = min(lo + block, rows)
            w = weight[lo:hi]
            g = _wide(F.linear(hidden, w)).sub_(lse.unsqueeze(-1)).exp_()  # softmax of this block
            inside = mine & (index >= lo) & (index < hi)
            g.scatter_add_(-1, (index - lo).clamp(0, hi - lo - 1).unsqueeze(-1),
                           -inside.to(g.dtype).unsqueeze(-1))
            g = g.mul_(scale).to(hidden.dtype)
            grad_hidden.add_(g @ w)
            torch.mm(g.t(), hidden, out=grad_weight[lo:hi])
            del g
        return grad_hidden.to(hidden.dtype), grad_weight, None, None, None


def linear_cross_entropy(hidden: Tensor, weight: Tensor, labels: Tensor, *, group: Any = None,
                         vocab_block: int = DEFAULT_VOCAB_BLOCK) -> Tensor:
    """Mean fp32 CE over ``labels != -100`` of ``hidden [T, H] @ weight [V, H].T``, never holding more
    than ``vocab_block`` vocabulary columns of logits. ``group``: the tp group ``weight`` is a
    vocab shard over (shard ``group.index`` holds rows ``[index*V, (index+1)*V)``); None: all rows."""
    if hidden.dim() != 2 or labels.shape != hidden.shape[:1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} must be [tokens, hidden] and labels "
                         f"{tuple(labels.shape)} [tokens]")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(f"head weight {tuple(weight.shape)} does not match hidden {tuple(hidden.shape)}")
    check_int(vocab_block, "vocab_block")
    shards = 1 if group is None else group.size
    check_token_ids(labels, weight.shape[0] * shards, "labels", ignore_index=IGNORE_INDEX)
    return _LinearCrossEntropy.apply(hidden, weight, labels, vocab_block, group)


class LMHead(nn.Linear):
    """The LM head: ``head(x)`` gives logits as an ``nn.Linear``; ``head(x, labels)`` gives the
    token-mean loss through :func:`linear_cross_entropy` (no fp32 logits kept).

    ``tp_linear_forward``: the tensor-parallel installer runs this forward on a ``vocab`` shard as it
    runs a plain Linear's (input copied to the tp group, logits gathered unless the loss is
    vocab-parallel) and passes the tp ``group`` when labels are given (parallel/tensor_parallel.py).
    """

    tp_linear_forward = True

    def __init__(self, in_features: int, out_features: int, *, vocab_block: int = DEFAULT_VOCAB_BLOCK,
                 **kwargs: Any) -> None:
        super().__init__(in_features, out_features, bias=False, **kwargs)
        self.vocab_block = vocab_block

    def forward(self, x: Tensor, labels: Tensor | None = None, group: Any = None) -> Tensor:
        """Logits of ``x`` (no ``labels``), else the loss; ``group``: the vocab shards' tp group."""
        if labels is None:
            return F.linear(x, self.weight)
        return linear_cross_entropy(x, self.weight, labels, group=group, vocab_block=self.vocab_block)
