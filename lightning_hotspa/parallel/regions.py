"""Megatron's column-parallel regions, declared by the plan: the layers reading one input share one
``f`` (plain tp: identity forward, one all-reduce of the summed input gradient backward) or, under
sequence parallelism, one all-gather of the tokens forward.

A region (e.g. ``layers.3.attention`` with readers ``wq``, ``wk``, ``wv``; ``feed_forward`` with
``w1``, ``w3``) is declared in the model's tp plan (``tp_regions``, lightning_hotspa/models/tp_plan.py)
and is ONE autograd node (:class:`_ColumnRegion`): the first reader called with an input computes
every reader's output from it; the others take theirs. Its backward owns the region's collectives:

- under sequence parallelism it saves only this rank's token SHARD (1/tp of the gathered rows) and
  re-gathers the input for the weight gradients in the same step as it reduce-scatters the summed
  input gradient (``reduce_scatter_and_gather_rows``: one all-to-all on gloo, the two native
  collectives elsewhere), after the attention kernel's backward, so the gathered rows never live
  through it (docs/DESIGN.md §11: the peak of all-gather-KV and fsdp layouts);
- under plain tp it all-reduces the summed input gradient once (Megatron's fused QKV);
- with tp overlap (``overlap``, the default) the forward gathers the input WITH the readers' GEMMs and
  the backward reduce-scatters the input gradient with its GEMMs (``group.comm``'s
  ``all_gather_matmul`` / ``matmul_reduce_scatter``: fused on NCCL, a ring on gloo); the re-gather
  for the weight gradients is then an all-gather of its own.

FP8 readers (:mod:`.fp8`) take another path: the input goes through ``f`` as plain autograd
functions once (one all-reduce / one reduce-scatter of the summed input gradient, as above), then
each reader's FP8 GEMM runs on it; under sequence parallelism the gathered input is then kept for
backward (no re-gather) and nothing overlaps.

No state is shared with other autograd nodes: the row-parallel layer that closes the region
reduce-scatters (or all-reduces) its own output and all-gathers its own gradient.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..mesh import RankGroup
from ..shard_rows import all_gather_matmul_rows, matmul_reduce_scatter_rows, reduce_scatter_and_gather_rows
from .collectives import all_reduce_sum, copy_to_group
from .fp8 import Fp8Axes, fp8_linear, tokens_group
from .sequence_parallel import all_gather_tokens, check_token_split, gather_tokens, reduce_scatter_tokens

__all__ = ["ColumnRegion"]


def _rows(t: Tensor) -> Tensor:
    """``[..., T, F]`` -> ``[T, ..., F]`` (tokens first, as the row collectives want)."""
    return t.movedim(-2, 0).contiguous()


class _ColumnRegion(torch.autograd.Function):
    """``F.linear(f(x), w_i, b_i)`` for every reader i; ``f``: the tp copy or the token all-gather."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: RankGroup, sequence_parallel: bool, overlap: bool, regather: bool,
                *params: Tensor | None) -> tuple[Tensor, ...]:
        ctx.set_materialize_grads(False)
        weights, biases = params[0::2], params[1::2]
        if sequence_parallel and overlap:  # the GEMMs on each gathered chunk as it arrives (group.comm)
            gathered, outs = all_gather_matmul_rows(_rows(x), [w.t() for w in weights], group)
            full = gathered.movedim(0, -2)
            outs = tuple(o.movedim(0, -2) if b is None else o.movedim(0, -2) + b for o, b in zip(outs, biases,
                                                                                                  strict=True))
        else:
            full = all_gather_tokens(x, group) if sequence_parallel else x
            outs = tuple(F.linear(full, w, b) for w, b in zip(weights, biases, strict=True))
        # under sequence parallelism x is the shard; without the re-gather the gathered rows are kept instead
        keep = sequence_parallel and not regather
        ctx.save_for_backward(full if keep else x, *weights)
        ctx.group, ctx.sequence_parallel, ctx.overlap, ctx.kept = group, sequence_parallel, overlap, keep
        ctx.has_bias = tuple(b is not None for b in biases)
        return outs

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        x, *weights = ctx.saved_tensors
        group, sp = ctx.group, ctx.sequence_parallel
        need_input = ctx.needs_input_grad[0]
        need_weight = any(ctx.needs_input_grad[5 + 2 * i] or ctx.needs_input_grad[6 + 2 * i]
                          for i in range(len(weights)))
        grad_x, full, regather = None, x, need_weight and not ctx.kept
        pairs = [(g, w) for g, w in zip(grads, weights, strict=True) if g is not None] if need_input else []
        if sp and ctx.overlap:  # the input gradient: each chunk's GEMM while the partial sums travel
            if pairs:
                check_token_split(pairs[0][0].shape[-2], group)
                grad_x = matmul_reduce_scatter_rows([_rows(g) for g, _ in pairs], [w for _, w in pairs],
                                                    group).movedim(0, -2)
            if regather:
                full = all_gather_tokens(x, group)
        else:
            grad_full = None
            for g, w in pairs:
                grad_full = g.matmul(w) if grad_full is None else grad_full.add_(g.matmul(w))
            if not sp:
                if grad_full is not None:
                    grad_x = all_reduce_sum(grad_full, group) if group.size > 1 else grad_full
            elif grad_full is not None and regather:
                check_token_split(grad_full.shape[-2], group)
                summed, gathered = reduce_scatter_and_gather_rows(_rows(grad_full), _rows(x), group)
                grad_x, full = summed.movedim(0, -2), gathered.movedim(0, -2)
            elif grad_full is not None:
                grad_x = reduce_scatter_tokens(grad_full, group)
            elif regather:
                full = all_gather_tokens(x, group)
            del grad_full
        out: list[Tensor | None] = [grad_x, None, None, None, None]
        full_rows = full.reshape(-1, full.shape[-1]) if need_weight else None
        for i, g in enumerate(grads):
            rows = g.reshape(-1, g.shape[-1]) if g is not None else None
            grad_w = rows.t().mm(full_rows) if rows is not None and ctx.needs_input_grad[5 + 2 * i] else None
            grad_b = rows.sum(0) if rows is not None and ctx.has_bias[i] and ctx.needs_input_grad[6 + 2 * i] \
                else None
            out += [grad_w, grad_b]
        return tuple(out)


class ColumnRegion:
    """One region instance (say ``layers.0.attention``): its readers' outputs from one input.

    Holds the input and the outputs not yet taken by their readers (strong references, dropped
    when the last reader takes its output or the next input arrives); a reader called again on the
    same input, or on another one, computes the region anew.

    Args:
        name: the owner module's name (errors).
        readers: the reader modules by name, in declared order (plain ``nn.Linear``).
        sequence_parallel: gather tokens (True) or copy (False) on the way in.
        overlap: under sequence parallelism, run the gather with the readers' GEMMs (forward) and the
            input gradient's reduce-scatter with its GEMMs (backward) through ``group.comm``'s fused
            operations (tp overlap); False: the collective, then the GEMMs.
        regather: under sequence parallelism, save only this rank's token shard and gather it again in
            backward (less memory); False: save the gathered input (2 x hidden bytes per token and
            layer more, one all-gather less: ``RuntimeProfile.tp_regather``, priced by the planner).
        kinds: each reader's tensor-parallel kind (``colwise`` splits N over tp; ``partial_input``
            holds the whole weight), read by FP8 readers for their amax groups.
        state: the shared ``ParallelState`` (FP8 readers reduce the tokens' amax over its cp).
    """

    def __init__(self, name: str, readers: dict[str, nn.Linear], sequence_parallel: bool,
                 overlap: bool = True, regather: bool = True, kinds: dict[str, str] | None = None,
                 state: Any = None) -> None:
        self.name = name
        self.kinds = kinds or {}
        self.state = state
        self.fp8 = [getattr(m, "_hotspa_fp8", None) for m in readers.values()]
        self.readers = readers
        self.sequence_parallel = sequence_parallel
        self.overlap = overlap
        self.regather = regather
        self._input: Tensor | None = None
        self._pending: dict[str, Tensor] = {}

    def output(self, reader: str, x: Tensor, group: RankGroup) -> Tensor:
        """The output of the reader ``reader`` on ``x`` over the tp ``group``."""
        if x is self._input and reader in self._pending:
            out = self._pending.pop(reader)
        else:
            params: list[Tensor | None] = []
            for m in self.readers.values():
                params += [m.weight, m.bias]
            sp = self.sequence_parallel and group.size > 1
            outs: Sequence[Tensor]
            if any(s is not None for s in self.fp8):
                outs = self._fp8_outputs(x, group, sp)
            else:
                outs = _ColumnRegion.apply(x, group, sp, self.overlap, self.regather, *params)
            self._input, self._pending = x, dict(zip(self.readers, outs, strict=True))
            out = self._pending.pop(reader)
        if not self._pending:
            self._input = None
        return out

    def _fp8_outputs(self, x: Tensor, group: RankGroup, sp: bool) -> list[Tensor]:
        """Every reader's output from ONE ``f`` of ``x``, FP8 readers through :func:`~.fp8.fp8_linear`."""
        full = gather_tokens(x, group) if sp else copy_to_group(x, group)
        tokens = tokens_group(self.state)
        outs = []
        for (reader, m), spec in zip(self.readers.items(), self.fp8, strict=True):
            if spec is None:
                outs.append(F.linear(full, m.weight, m.bias))
                continue
            n = group if self.kinds.get(reader, "colwise") == "colwise" else None
            outs.append(fp8_linear(full, m.weight, m.bias, spec, Fp8Axes(t=tokens, n=n)))
        return outs
