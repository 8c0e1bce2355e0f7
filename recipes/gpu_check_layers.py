"""gpu_check parts (c) and (d): per-layout shard efficiency and memory per token of one decoder layer.

One ``models.Block`` forward + backward on exactly the local shapes a rank computes (communication
left out: the cost model prices it separately), for tp and cp degrees 1, 2, 4, 8 of a micro-batch of
``tokens`` tokens (documents of ``length``):

* tp = t (Megatron, no sequence parallelism, as parallel/tensor_parallel.py): q/kv heads and the FFN
  width divided by t, all ``tokens`` tokens;
* cp = c (Ulysses, as parallel/ulysses.py): ``tokens / c`` tokens through the norms and projections
  with all heads, then core attention over all ``tokens`` tokens with ``1/c`` of the heads. The
  all-to-all is stood in for by a local reshape of the same shape (a copy, no communication).

Shard efficiency at degree d = (unsharded time / d) / local time (1.0: work divides perfectly).
Memory (part (d)): the bytes autograd saves for backward (``saved_tensors_hooks``, storages counted
once, parameters excluded; works on any device) and, on CUDA, the ``max_memory_allocated`` peak
over forward + backward, per micro-batch token, against the cost model's per-layer activation bytes
(``AnalyticCostModel.activation_bytes_per_token``) divided by tp * cp.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from gpu_check_common import Budget, DeviceTimer, time_repeated
from torch import Tensor, nn

from lightning_hotspa.models import Block, rotary_cos_sin
from lightning_hotspa.models.config import LlamaConfig
from lightning_hotspa.planner.cost.cost_model import AnalyticCostModel

#: Llama-3 8B (Meta's model card: 32 layers, hidden 4096, 32 heads over 8 kv heads, FFN 14336,
#: 128256 vocab, rope theta 500000); not a preset of the project, which keeps the paper's shapes.
LLAMA3_8B = LlamaConfig(vocab_size=128256, hidden=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                        ffn_hidden=14336, rope_theta=500000.0, max_seq_len=32768)
#: dry-run stand-ins with the same head structure, small enough for a CPU
TINY_MHA = LlamaConfig(vocab_size=256, hidden=128, n_layers=2, n_heads=8, n_kv_heads=8, ffn_hidden=352)
TINY_GQA = LlamaConfig(vocab_size=256, hidden=128, n_layers=2, n_heads=16, n_kv_heads=8, ffn_hidden=448)


def layer_activation_bytes_per_token(config: LlamaConfig) -> float:
    """The memory model's saved bytes of ONE layer per token (no checkpointing, no parallelism): the
    difference between the whole-model figure with 2 layers and with 1 (the head term cancels)."""
    def whole(n_layers: int) -> float:
        cm = AnalyticCostModel(dataclasses.replace(config, n_layers=n_layers), "H200", 1)
        return cm.activation_bytes_per_token(activation_checkpointing=False)

    return whole(2) - whole(1)


def _local_linear(full: nn.Linear, out_div: int = 1, in_div: int = 1) -> nn.Linear:
    """A meta Linear of ``full``'s type (SwiGLU's gated down projection stays one) with one tp shard's shape.

    Args:
        full: the unsharded projection.
        out_div, in_div: by how much its output / input features are split.
    """
    shape = (full.in_features // in_div, full.out_features // out_div)
    if type(full) is nn.Linear:
        return nn.Linear(*shape, bias=False, device="meta")
    return type(full)(*shape, device="meta")


def local_block(config: LlamaConfig, tp: int, device: torch.device, dtype: torch.dtype) -> Block:
    """A decoder layer holding the weight shards one tp rank holds (column-parallel q/k/v/w1/w3 split on
    their outputs, row-parallel wo/w2 on their inputs); Block's forward reads no head count."""
    with torch.device("meta"):
        block = Block(config)
    if tp > 1:
        att, ffn = block.attention, block.feed_forward
        att.wq, att.wk, att.wv = (_local_linear(m, out_div=tp) for m in (att.wq, att.wk, att.wv))
        att.wo = _local_linear(att.wo, in_div=tp)
        ffn.w1, ffn.w3 = (_local_linear(m, out_div=tp) for m in (ffn.w1, ffn.w3))
        ffn.w2 = _local_linear(ffn.w2, in_div=tp)
    block = block.to_empty(device=device).to(dtype)
    g = torch.Generator(device=device).manual_seed(tp)  # on the device: a 7B layer has 200M weights
    with torch.no_grad():
        for name, p in block.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
    return block


def ulysses_stand_in(core: Any, cp: int, cu_seqlens: Tensor, max_seqlen: int) -> Any:
    """Core attention as a Ulysses cp rank runs it: [T/cp, h, d] -> [T, h/cp, d] (a local reshape in
    place of the all-to-all), attention over the whole micro-batch's documents, and back."""

    def scatter_heads(t: Tensor) -> Tensor:
        local, heads, d = t.shape
        return t.reshape(local, cp, heads // cp, d).transpose(0, 1).reshape(local * cp, heads // cp, d)

    def gather_heads(t: Tensor) -> Tensor:
        total, heads, d = t.shape
        return t.reshape(cp, total // cp, heads, d).transpose(0, 1).reshape(total // cp, heads * cp, d)

    def attention(q: Tensor, k: Tensor, v: Tensor, _cu: Tensor, _max: int) -> Tensor:
        out = core(scatter_heads(q), scatter_heads(k), scatter_heads(v), cu_seqlens, max_seqlen)
        return gather_heads(out)

    return attention


def _saved_bytes(block: Block, run: Any) -> tuple[int, Tensor]:
    """Bytes autograd keeps for backward while ``run()`` builds the graph (each storage once)."""
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    seen: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return sum(seen.values()), out


def layer_cell(config: LlamaConfig, tp: int, cp: int, tokens: int, length: int, core: Any,
               device: torch.device, dtype: torch.dtype, budget: Budget) -> dict[str, Any]:
    """Time and memory of one layer forward + backward on one rank's local shapes."""
    if tokens % length or tokens % cp:
        raise ValueError(f"tokens={tokens} must be a multiple of the document length {length} and of cp={cp}")
    local_tokens = tokens // cp
    block = local_block(config, tp, device, dtype)
    cu = (torch.arange(tokens // length + 1, dtype=torch.int32) * length).to(device)
    if cp > 1:
        block.attention.core_attention = ulysses_stand_in(core, cp, cu, length)
        # rotary positions only need the right shape: this rank's tokens/cp of them
        positions = torch.arange(tokens, device=device).remainder(length)[:local_tokens]
    else:
        block.attention.core_attention = core
        positions = torch.arange(tokens, device=device).remainder(length)
    cos, sin = rotary_cos_sin(positions, config.head_dim, config.rope_theta, dtype)
    g = torch.Generator(device=device).manual_seed(7)
    x = torch.randn(local_tokens, config.hidden, generator=g, device=device, dtype=dtype).requires_grad_()
    grad = torch.randn(local_tokens, config.hidden, generator=g, device=device, dtype=dtype)
    local_cu = cu if cp == 1 else torch.tensor([0, local_tokens], dtype=torch.int32, device=device)

    def forward() -> Tensor:
        return block(x, cos, sin, local_cu, length)

    def step() -> None:
        forward().backward(grad)
        x.grad = None
        block.zero_grad(set_to_none=True)

    timing = time_repeated(step, DeviceTimer(device), budget, warmup=2, reps=5)
    # memory: one more forward + backward, measured
    param_bytes = sum(p.numel() * p.element_size() for p in block.parameters())
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    saved, out = _saved_bytes(block, forward)
    out_bytes = out.numel() * out.element_size()
    out.backward(grad)
    peak = None
    if cuda:
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base - param_bytes  # grads: one per parameter
    del out
    x.grad = None
    model_per_token = layer_activation_bytes_per_token(config) / (tp * cp)
    return {"tp": tp, "cp": cp, "tokens": tokens, "local_tokens": local_tokens, "length": length,
            **timing, "seconds_per_token": timing["seconds"] / tokens,
            "memory": {"saved_bytes_per_token": saved / tokens,
                       "peak_bytes_per_token": None if peak is None else (peak - out_bytes) / tokens,
                       "model_bytes_per_token": model_per_token,
                       "saved_over_model": saved / tokens / model_per_token,
                       "peak_over_model": None if peak is None else (peak - out_bytes) / tokens / model_per_token}}


def shard_efficiency(shapes: dict[str, LlamaConfig], degrees: list[int], tokens: int, length: int, core: Any,
                     device: torch.device, dtype: torch.dtype, budget: Budget) -> dict[str, Any]:
    """Per shape: the unsharded layer, then each tp and cp degree; efficiency = (t1 / d) / t_d."""
    out: dict[str, Any] = {}
    for shape_name, config in shapes.items():
        cells: list[dict[str, Any]] = []
        kinds = [("tp", 1)] + [(kind, d) for kind in ("tp", "cp") for d in degrees if d > 1]
        for kind, d in kinds:
            tp, cp = (d, 1) if kind == "tp" else (1, d)
            if not budget.allows():
                cells.append({"tp": tp, "cp": cp, "status": "skipped: time budget spent"})
                continue
            heads_ok = config.n_heads % d == 0 and config.n_kv_heads % d == 0 and config.ffn_hidden % d == 0
            if not heads_ok or tokens % d:
                cells.append({"tp": tp, "cp": cp, "status": f"skipped: degree {d} does not divide the shape"})
                continue
            try:
                cells.append({"status": "ok", **layer_cell(config, tp, cp, tokens, length, core, device, dtype,
                                                            budget)})
            except Exception as err:  # noqa: BLE001 - report and go on
                oom = isinstance(err, torch.OutOfMemoryError)
                cells.append({"tp": tp, "cp": cp, "status": "out of memory" if oom else f"error: {err!r}"[:300]})
            if device.type == "cuda":
                torch.cuda.empty_cache()
        base = next((c for c in cells if c.get("status") == "ok" and c["tp"] == c["cp"] == 1), None)
        curves: dict[str, list[list[float]]] = {"tp": [], "cp": []}
        for c in cells:
            if base is None or c.get("status") != "ok" or c["tp"] * c["cp"] == 1:
                continue
            d = c["tp"] * c["cp"]
            c["efficiency"] = base["seconds"] / d / c["seconds"]
            curves["tp" if c["tp"] > 1 else "cp"].append([d, c["efficiency"]])
        out[shape_name] = {"config": {k: getattr(config, k) for k in ("hidden", "n_heads", "n_kv_heads",
                                                                      "ffn_hidden")},
                           "cells": cells, "curves": curves}
    return out


def mean_curves(per_shape: dict[str, Any]) -> dict[str, list[list[float]]]:
    """The profile's curves: at each degree, the mean efficiency over the shapes that measured it."""
    out: dict[str, list[list[float]]] = {}
    for kind in ("tp", "cp"):
        by_degree: dict[int, list[float]] = {}
        for shape in per_shape.values():
            for d, e in shape["curves"][kind]:
                by_degree.setdefault(int(d), []).append(e)
        out[kind] = [[d, sum(v) / len(v)] for d, v in sorted(by_degree.items())]
    return out
