"""Llama-style decoder (RMSNorm, RoPE, SwiGLU, GQA) over packed 1-D token rows.

Written for one device, but shard-agnostic: no forward reads a head count or the FFN width
from the config. Local head counts come from the projection outputs, so the same code runs
when ``wq/wk/wv/w1/w3`` are column-sharded, ``wo/w2`` row-sharded and the embedding / LM head
vocab-sharded (the parallel wrapper adds the collectives around these modules).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from ..activation_checkpointing import Checkpointing
from .attention import CoreAttention, with_sliding_window
from .attention_kernels import select_attention_backend
from .config import LlamaConfig
from .kernels import SwiGLUDown, rms_norm
from .loss_head import LMHead, linear_cross_entropy
from .rope import apply_rotary, rotary_cos_sin
from .tp_plan import LLAMA_TP_REGIONS
from .vocab import check_token_ids

__all__ = ["Attention", "Block", "FeedForward", "Llama", "RMSNorm"]


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in fp32 whatever the working precision; saves only the input
    and the fp32 inverse rms for backward (:func:`.kernels.rms_norm`)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    """Self-attention whose core is the swappable callable ``self.core_attention``.

    ``core_attention(q [T,h,d], k [T,hkv,d], v [T,hkv,d], cu_seqlens, max_seqlen) -> [T,h,d]``;
    a context-parallel wrapper replaces it without touching the projections.
    """

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        hd = config.head_dim
        self.head_dim = hd  # the only shape read in forward: it is never sharded
        bias = config.qkv_bias
        self.wq = nn.Linear(config.hidden, config.n_heads * hd, bias=bias)
        self.wk = nn.Linear(config.hidden, config.n_kv_heads * hd, bias=bias)
        self.wv = nn.Linear(config.hidden, config.n_kv_heads * hd, bias=bias)
        self.wo = nn.Linear(config.n_heads * hd, config.hidden, bias=False)
        self.core_attention: CoreAttention = with_sliding_window(select_attention_backend("auto"),
                                                                 config.sliding_window)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, cu_seqlens: Tensor, max_seqlen: int,
        recompute_core: bool = False,
    ) -> Tensor:
        """``wo(core(x))``; ``recompute_core``: the core (:meth:`core`) runs under non-reentrant
        checkpointing, so backward recomputes it from ``x`` (selective checkpointing)."""
        if recompute_core:
            out = checkpoint(self.core, x, cos, sin, cu_seqlens, max_seqlen, use_reentrant=False)
        else:
            out = self.core(x, cos, sin, cu_seqlens, max_seqlen)
        return self.wo(out)

    def core(self, x: Tensor, cos: Tensor, sin: Tensor, cu_seqlens: Tensor, max_seqlen: int) -> Tensor:
        """The attention output [T, heads x head_dim] before ``wo``: projections, rotary, kernel."""
        # -1: the local head count, whatever share of the heads this rank's weights hold; the token
        # count from the projection, not from x (x is this rank's token share under sequence parallel)
        q = self.wq(x)
        tokens = q.shape[0]
        q = q.view(tokens, -1, self.head_dim)
        k = self.wk(x).view(tokens, -1, self.head_dim)
        v = self.wv(x).view(tokens, -1, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = self.core_attention(q, k, v, cu_seqlens, max_seqlen)
        return out.reshape(tokens, -1)


class FeedForward(nn.Module):
    """SwiGLU MLP: ``w2(silu(w1 x) * w3 x)``; the hidden width is whatever w1 holds locally. ``w2``
    takes both projections and recomputes the gate in backward (:class:`.kernels.SwiGLUDown`)."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.hidden, config.ffn_hidden, bias=False)
        self.w2 = SwiGLUDown(config.ffn_hidden, config.hidden)
        self.w3 = nn.Linear(config.hidden, config.ffn_hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(self.w1(x), self.w3(x))


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(config.hidden, config.norm_eps)
        self.attention = Attention(config)
        self.ffn_norm = RMSNorm(config.hidden, config.norm_eps)
        self.feed_forward = FeedForward(config)

    def forward(
        self, x: Tensor, cos: Tensor, sin: Tensor, cu_seqlens: Tensor, max_seqlen: int,
        recompute_core: bool = False,
    ) -> Tensor:
        """``recompute_core``: selective checkpointing of the attention core (:meth:`Attention.forward`)."""
        x = x + self.attention(self.attention_norm(x), cos, sin, cu_seqlens, max_seqlen, recompute_core)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """Decoder over a packed row: ``forward(input_ids [T], ...) -> logits [T, vocab]``.

    Constructing under ``torch.device("meta")`` allocates nothing; fill weights with
    :func:`lightning_hotspa.models.init_weights` (one parameter at a time, seeded by name).
    """

    #: ``set_activation_checkpointing`` takes a :class:`~lightning_hotspa.activation_checkpointing.Checkpointing`
    #: mode, selective included (parallel/model.py passes other modules a bool)
    selective_checkpointing = True
    #: the column-parallel regions of the tp plan (parallel/tensor_parallel.py reads them)
    tp_regions = LLAMA_TP_REGIONS

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.padded_vocab_size, config.hidden)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = RMSNorm(config.hidden, config.norm_eps)
        if not config.tie_embeddings:  # tied: the head reads tok_embeddings.weight (one parameter)
            self.output = LMHead(config.hidden, config.padded_vocab_size)
        self.activation_checkpointing = Checkpointing.NONE

    def set_activation_checkpointing(self, mode: Checkpointing | str | bool) -> None:
        """What each block recomputes in backward (runtime switch): ``"none"``, ``"selective"`` (the
        attention core), ``"full"`` (the whole block); True / False mean full / none."""
        self.activation_checkpointing = Checkpointing.parse(mode)

    def fsdp_units(self) -> list[str]:
        """The submodules a sharded working copy gathers one at a time, in call order (each
        transformer block; the embedding and the head unless tied: the tied head reads the
        embedding's weight outside its module, so it stays unsharded within the layout)."""
        untied = not self.config.tie_embeddings
        return (["tok_embeddings"] if untied else []) + [f"layers.{i}" for i in range(len(self.layers))] + (
            ["output"] if untied else [])

    def set_attention_backend(self, backend: str | CoreAttention) -> None:
        """Use one core attention (a backend name or a callable) in every layer."""
        fn = select_attention_backend(backend) if isinstance(backend, str) else backend
        fn = with_sliding_window(fn, self.config.sliding_window)
        for layer in self.layers:
            layer.attention.core_attention = fn

    def forward(
        self, input_ids: Tensor, position_ids: Tensor, cu_seqlens: Tensor, max_seqlen: int,
        labels: Tensor | None = None,
    ) -> Tensor:
        """Logits ``[T, vocab]``; with ``labels`` the token-mean cross-entropy instead, through the
        blocked loss head that never holds fp32 logits (:mod:`.loss_head`)."""
        if input_ids.dim() != 1:
            raise ValueError(
                f"Llama expects packed 1-D input_ids, got shape {tuple(input_ids.shape)}"
            )
        check_token_ids(input_ids, self.config.vocab_size)  # the same error in every layout
        x = self.tok_embeddings(input_ids)
        cos, sin = rotary_cos_sin(
            position_ids, self.config.head_dim, self.config.rope_theta, x.dtype, self.config.rope_scaling
        )
        mode = self.activation_checkpointing if torch.is_grad_enabled() else Checkpointing.NONE
        for layer in self.layers:
            if mode is Checkpointing.FULL:
                x = checkpoint(layer, x, cos, sin, cu_seqlens, max_seqlen, use_reentrant=False)
            else:
                x = layer(x, cos, sin, cu_seqlens, max_seqlen, mode is Checkpointing.SELECTIVE)
        x = self.norm(x)
        if self.config.tie_embeddings:
            if labels is not None:
                return linear_cross_entropy(x, self.tok_embeddings.weight, labels)
            return F.linear(x, self.tok_embeddings.weight)
        return self.output(x) if labels is None else self.output(x, labels)
