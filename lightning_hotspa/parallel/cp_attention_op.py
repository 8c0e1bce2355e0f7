"""Context-parallel attention as ONE opaque op pair for compiled blocks (``hotspa::cp_attention``).

Why: every cp kind reads host-side metadata per micro-batch (Ulysses' row order, the KV ring's blocks, the KV
gather's chunks: :mod:`lightning_hotspa.host_facts`), and the KV ring posts point-to-point ops. Traced by dynamo,
each of these is a graph break or a guard on a tensor's identity (a new graph per micro-batch until the recompile
limit). As a custom op the block's graph holds one node whose output has ``q``'s tokens and heads, and the cp
attention runs EAGERLY when the op runs, the same code as an uncompiled block.

Backward: the forward op runs the eager attention with autograd on (re-enabled inside the op: a custom op's body
runs below the autograd dispatch keys) and ties the small autograd graph it records to a one-byte "tape" tensor it
returns; the backward op back-propagates through that graph (``torch.autograd.grad``). Nothing is recomputed and
the graph keeps what eager keeps; it lives exactly as long as the tape, which autograd saves for backward only when
a gradient is needed (activation checkpointing drops and recomputes it like any other saved tensor). The recorded
graph runs on COPIES of q, k, v and returns a copy of its output: inductor reuses a buffer's memory after its last
use in the compiled graph, which would overwrite what the recorded graph saved (seen: KV-ring gradients off by
2.6e-4 in fp32 until copied). The tape holds the graph's edges, not tensors, so what stays for backward is what the
cp kind saves, as in eager; the copies cost memory traffic (q, k, v and the output once per layer), not memory.

The op finds its wrapper (the layer's :class:`~.core_attention.ParallelCoreAttention`: inner attention, state,
active groups) by an integer handle given when the wrapper is created (:mod:`lightning_hotspa.op_handles`), so the
graph holds no Python object.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..op_handles import object_for

__all__ = ["cp_attention_op"]


def _autograd_on() -> Any:
    """A guard under which ops record autograd again inside a custom op's body (its caller excluded the keys)."""
    keys = torch._C.DispatchKey
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in (keys.AutogradFunctionality, keys.AutogradOther, keys.AutogradNestedTensor, keys.ADInplaceOrView):
        exclude = exclude.remove(key)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude)


class _Entry(torch.autograd.Function):
    """q, k, v as they enter the recorded graph: a node that saves nothing, so the tape holding its edges keeps no
    input alive (a leaf's gradient node would hold the leaf). ``anchor``: an empty tensor that requires grad."""

    @staticmethod
    def forward(ctx: Any, anchor: Tensor, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        return q.view_as(q), k.view_as(k), v.view_as(v)

    @staticmethod
    def backward(ctx: Any, dq: Tensor, dk: Tensor, dv: Tensor) -> tuple[None, Tensor, Tensor, Tensor]:
        return None, dq, dk, dv


#: the ops' version, in their names (inductor's FX graph cache keys on the op's name, not its fake kernel)
_VERSION = "v1"


@torch.library.custom_op(f"hotspa::cp_attention_{_VERSION}", mutates_args=())
def _cp_attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, handle: int,
                  needs_grad: bool) -> tuple[Tensor, Tensor]:
    wrapper = object_for(handle, "hotspa::cp_attention's attention wrapper")
    tape = torch.empty(1, dtype=torch.uint8, device=q.device)
    if not needs_grad:
        with torch.no_grad():
            out = wrapper.run_context_parallel(q, k, v, cu_seqlens, max_seqlen)
        return _unaliased([q, k, v], (out,))[0], tape
    # copies: the compiled graph owns its buffers and reuses them after their last use in the graph, so the recorded
    # graph must not share storage with the op's inputs or output (module docstring)
    copies = tuple(t.detach().clone() for t in (q, k, v))
    with _autograd_on(), torch.enable_grad():
        entries = _Entry.apply(torch.empty(0, device=q.device, requires_grad=True), *copies)
        out = wrapper.run_context_parallel(*entries, cu_seqlens, max_seqlen)
    edge = torch.autograd.graph.get_gradient_edge
    # edges, not tensors: the tape keeps the graph's nodes (and what they saved), no input or output data
    tape.hotspa_graph = (edge(out), tuple(edge(t) for t in entries))
    return out.detach().clone(memory_format=torch.contiguous_format), tape


@_cp_attention.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int, handle: int,
      needs_grad: bool) -> tuple[Tensor, Tensor]:
    return q.new_empty(q.shape), torch.empty(1, dtype=torch.uint8, device=q.device)


@torch.library.custom_op(f"hotspa::cp_attention_backward_{_VERSION}", mutates_args=())
def _cp_attention_backward(grad: Tensor, tape: Tensor, kv_shape: list[int]) -> tuple[Tensor, Tensor, Tensor]:
    recorded = getattr(tape, "hotspa_graph", None)
    if recorded is None:
        raise RuntimeError("hotspa::cp_attention: backward found no recorded graph (run twice, or the forward ran "
                           "without a gradient)")
    out, entries = recorded
    tape.hotspa_graph = None  # freed as autograd frees a graph after backward
    with _autograd_on():
        dq, dk, dv = torch.autograd.grad([out], list(entries), [grad], allow_unused=True, materialize_grads=True)
    return _unaliased([grad], (dq, dk, dv))


def _unaliased(inputs: list[Tensor], outs: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """``outs`` contiguous, each copied if it shares storage with an input or an earlier one (a custom op's returns
    may not alias: a cp kind's backward may hand the incoming gradient straight through)."""
    seen = {t.untyped_storage().data_ptr() for t in inputs}
    result = []
    for t in outs:
        t = t.contiguous()
        if t.untyped_storage().data_ptr() in seen:
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        result.append(t)
    return tuple(result)


@_cp_attention_backward.register_fake
def _(grad: Tensor, tape: Tensor, kv_shape: list[int]) -> tuple[Tensor, Tensor, Tensor]:
    return grad.new_empty(grad.shape), grad.new_empty(kv_shape), grad.new_empty(kv_shape)


def _setup(ctx, inputs, output) -> None:  # noqa: ANN001 (torch.library's signature)
    ctx.save_for_backward(output[1])
    ctx.kv_shape = list(inputs[1].shape)


def _backward(ctx, grad_out: Tensor, grad_tape: Tensor | None):  # noqa: ANN001, ANN202
    (tape,) = ctx.saved_tensors
    dq, dk, dv = _cp_attention_backward(grad_out.contiguous(), tape, ctx.kv_shape)
    return dq, dk, dv, None, None, None, None


_cp_attention.register_autograd(_backward, setup_context=_setup)


def cp_attention_op(wrapper: Any, q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int) -> Tensor:
    """The active layout's cp attention around ``wrapper``'s inner attention, as one opaque op (compiled blocks).

    Args:
        wrapper: the layer's :class:`~.core_attention.ParallelCoreAttention` (its ``handle`` set).
        q, k, v: the local rows [T, h, d] / [T, hkv, d], as the wrapper hands them to the cp kind.
        cu_seqlens: this rank's local document boundaries.
        max_seqlen: the local maximum document length.
    """
    if k.shape != v.shape or q.shape[2] != k.shape[2]:
        raise ValueError(f"compiled context-parallel attention needs k {tuple(k.shape)} and v {tuple(v.shape)} of one "
                         f"shape and q's head dim {q.shape[2]} equal to theirs")
    needs_grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    return _cp_attention(q, k, v, cu_seqlens, max_seqlen, wrapper.handle, needs_grad)[0]
