"""gpu_check part (g) ``cpchunks``: attention forward + backward per local chunk of a cp ladder against the
cost model's price of it, and the KV ring's block kernel against SDPA (one device, no collectives).

Under the KV ring a rank's attention is a few query chunks, each over every key block before it (one
block per ring step, ``parallel/kv_ring.py``); the costliest is the last chunk of a document: ``rows``
queries at the end of ``keys`` keys. For the chunk shapes a cp ladder of 8K-512K documents uses (1K-64K
rows, rows = keys / 8: cp4's 2 x 4 chunks), one Llama-3-8B layer's heads (GQA 32 / 8, head dim 128) run
as the ring runs them: the registry's block kernel per key block (``sdpa_chunk`` on CUDA: SDPA's
memory-efficient kernel with its log-sum-exp), merged by log-sum-exp, each block's backward from the
merged output and log-sum-exp; the measured seconds are set beside
``AnalyticCostModel.attention_seconds_per_pair`` x the chunk's visible pairs (our runtime's kernel on
the device's hardware profile). ``ring_blocks``: the same composition on small shapes (GQA, a sliding
window's band masks) against SDPA's own forward and autograd backward, fp32 and bf16 (never run on a
GPU yet). The K / V exchange itself is not run: one device has no peer.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from gpu_check_common import Budget, DeviceTimer, time_repeated

from lightning_hotspa.models.config import LlamaConfig
from lightning_hotspa.planner.cost.cost_model import AnalyticCostModel

__all__ = ["CHUNK_CELLS", "DRY_CHUNK_CELLS", "cp_chunk_check", "ring_blocks_check", "ring_chunk", "visible_pairs"]

#: (query rows, keys): the last chunk of a 8K-512K document under cp4 all-gather-KV
CHUNK_CELLS = tuple((keys // 8, keys) for keys in (8192, 16384, 32768, 65536, 131072, 262144, 524288))
#: the dry run's tiny stand-ins (CPU)
DRY_CHUNK_CELLS = ((16, 128), (32, 256))


def visible_pairs(rows: int, keys: int) -> int:
    """(query, key) pairs a causal chunk of the last ``rows`` queries over ``keys`` keys computes."""
    if not 0 < rows <= keys:
        raise ValueError(f"a chunk needs 0 < rows <= keys, got rows={rows}, keys={keys}")
    first = keys - rows
    return rows * first + rows * (rows + 1) // 2


def ring_chunk(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor | None, kernel: Any,
               window: int | None = None) -> tuple[torch.Tensor, tuple[torch.Tensor, ...] | None]:
    """The last ``rows`` queries of a document (q [rows, h, d]) over its ``keys`` keys (k / v, a multiple of
    rows) as the KV ring computes them: one block per key chunk of ``rows`` by the block ``kernel``, the
    diagonal first, merged by log-sum-exp; with ``grad``, each block's backward from the merged output and
    log-sum-exp. Returns ``(out, (dq, dk, dv) or None)``.

    Args:
        q, k, v: the query chunk and every key / value of its document up to it.
        grad: the output's gradient (None: forward only).
        kernel: a ``chunks`` record of ``models/attention_kernels.py``.
        window: the sliding window (None: full causal).
    """
    from lightning_hotspa.parallel.kv_ring import RingGeometry, _block, _merge

    rows, n = q.shape[0], k.shape[0] // q.shape[0]
    blocks = [b for j in range(n) if (b := _block((0, rows, n - 1), (j * rows, rows, j), window)) is not None]
    blocks = [dataclasses.replace(blocks[-1], first=True), *blocks[:-1]]  # the diagonal starts the merge
    geometry = RingGeometry((tuple(blocks),), window)
    acc = torch.promote_types(q.dtype, torch.float32)
    out = torch.empty(q.shape, dtype=acc, device=q.device)
    lse = torch.empty((q.shape[1], rows), dtype=acc, device=q.device)
    for b in blocks:
        o, m = kernel.call(q, k[b.k0:b.k1], v[b.k0:b.k1], b.causal, geometry.mask(b, q.dtype, q.device))
        _merge(out, lse, b, o, m)
    out = out.to(q.dtype)
    if grad is None:
        return out, None
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk, dv = (torch.zeros(t.shape, dtype=acc, device=t.device) for t in (k, v))
    for b in blocks:
        gq, gk, gv = kernel.backward(grad, q, k[b.k0:b.k1], v[b.k0:b.k1], out, lse, b.causal,
                                     geometry.mask(b, q.dtype, q.device))
        dq += gq
        dk[b.k0:b.k1] += gk
        dv[b.k0:b.k1] += gv
    return out, (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype))


def ring_blocks_check(device: torch.device, heads: int = 8, kv_heads: int = 2, dim: int = 64) -> dict[str, Any]:
    """The ring's block kernel on ``device`` (the registry's for it) against SDPA's forward and autograd
    backward of the whole document: worst relative error of out, dq, dk, dv per (dtype, window)."""
    from lightning_hotspa.models.attention import sdpa_attention
    from lightning_hotspa.models.attention_kernels import KERNELS, default_chunk_kernel

    out: dict[str, Any] = {}
    rows, n = 64, 4
    for dtype in (torch.float32, torch.bfloat16):
        for window in (None, 100):
            name = default_chunk_kernel(device, dtype, window)
            gen = torch.Generator(device=device).manual_seed(1)
            q, k, v = (torch.randn(rows * n, h, dim, device=device, dtype=dtype, generator=gen, requires_grad=True)
                       for h in (heads, kv_heads, kv_heads))
            grad = torch.randn(rows, heads, dim, device=device, dtype=dtype, generator=gen)
            cu = torch.tensor([0, rows * n], dtype=torch.int32, device=device)
            extra = {} if window is None else {"window": window}
            ref = sdpa_attention(q, k, v, cu, rows * n, **extra)[-rows:]
            want = torch.autograd.grad(ref, (q, k, v), grad)
            with torch.no_grad():
                got, grads = ring_chunk(q[-rows:], k, v, grad, KERNELS[name], window)
            pairs = [(got, ref.detach()), (grads[0], want[0][-rows:]), (grads[1], want[1]), (grads[2], want[2])]
            errs = [float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))
                    for a, b in pairs]
            out[f"{str(dtype).removeprefix('torch.')} window {window}"] = {"kernel": name, "out": errs[0],
                                                                           "dq": errs[1], "dk": errs[2],
                                                                           "dv": errs[3]}
    return out


def cp_chunk_check(cells: tuple[tuple[int, int], ...], device: torch.device, dtype: torch.dtype, hardware: str,
                   budget: Budget, heads: int = 32, kv_heads: int = 8, dim: int = 128) -> dict[str, Any]:
    """Part (g): measured vs predicted forward + backward seconds of each chunk cell, within ``budget``
    (a cell that would not fit the time left is skipped and says so)."""
    from lightning_hotspa.models.attention_kernels import KERNELS, default_chunk_kernel

    kernel = KERNELS[default_chunk_kernel(device, dtype)]
    layer = LlamaConfig(vocab_size=256, hidden=heads * dim, n_layers=1, n_heads=heads, n_kv_heads=kv_heads,
                        ffn_hidden=4 * dim, max_seq_len=max(k for _, k in cells))
    per_pair = AnalyticCostModel(layer, hardware, 1).attention_seconds_per_pair()
    timer = DeviceTimer(device)
    out: list[dict[str, Any]] = []
    last_s = 0.0
    for rows, keys in cells:
        pairs = visible_pairs(rows, keys)
        predicted = per_pair * pairs
        cell: dict[str, Any] = {"rows": rows, "keys": keys, "pairs": pairs, "predicted_s": predicted}
        if out and not budget.allows(4 * last_s * pairs / max(out[-1]["pairs"], 1)):
            cell["status"] = "skipped: budget spent"
            out.append(cell)
            continue
        try:
            gen = torch.Generator(device=device).manual_seed(0)
            q = torch.randn(rows, heads, dim, device=device, dtype=dtype, generator=gen, requires_grad=True)
            k, v = (torch.randn(keys, kv_heads, dim, device=device, dtype=dtype, generator=gen, requires_grad=True)
                    for _ in range(2))

            def step(q: torch.Tensor = q, k: torch.Tensor = k, v: torch.Tensor = v) -> None:
                with torch.no_grad():
                    ring_chunk(q, k, v, torch.ones_like(q), kernel)

            timed = time_repeated(step, timer, budget)
            last_s = timed["seconds"]
            flops = 12.0 * heads * dim * pairs  # forward 4 per pair and head dim, backward 2 x forward
            cell.update(status="ok", measured_s=last_s, runs=timed["runs"], tflops=flops / last_s / 1e12,
                        measured_over_predicted=last_s / predicted)
        except torch.OutOfMemoryError as err:
            cell["status"] = f"oom: {err!s}"[:200]
        finally:
            q = k = v = None  # noqa: F841 - free the cell's tensors before the next, larger one
            if device.type == "cuda":
                torch.cuda.empty_cache()
        out.append(cell)
    ok = [c["measured_over_predicted"] for c in out if c.get("status") == "ok"]
    return {"cells": out, "heads": [heads, kv_heads, dim], "hardware_profile": hardware, "timer": timer.kind,
            "kernel": f"the KV ring's blocks by {kernel.name} (models/chunk_attention.py), merged by log-sum-exp",
            "measured_over_predicted": {"min": min(ok), "max": max(ok)} if ok else None,
            "ring_blocks": ring_blocks_check(device)}
