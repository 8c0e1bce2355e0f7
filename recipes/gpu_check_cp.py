"""gpu_check part (g) ``cpchunks``: attention forward + backward per local chunk of a cp ladder against the
cost model's price of it (one device, no collectives).

Under all-gather-KV context parallelism a rank's attention is a few query chunks, each over every key
before it; the costliest is the last chunk of a document: ``rows`` queries at the end of ``keys`` keys.
For the chunk shapes a cp ladder of 8K-512K documents uses (1K-64K rows, rows = keys / 8: cp4's
2 x 4 chunks), one Llama-3-8B layer's heads (GQA 32 / 8, head dim 128) run through
:func:`lightning_hotspa.models.chunk_attention.chunk_attention`, and the measured seconds are set beside
``AnalyticCostModel.attention_seconds_per_pair`` x the chunk's visible pairs (our runtime's kernel on
the device's hardware profile). The K / V exchange itself is not run: one device has no peer.
"""

from __future__ import annotations

from typing import Any

import torch
from gpu_check_common import Budget, DeviceTimer, time_repeated

from lightning_hotspa.models.config import LlamaConfig
from lightning_hotspa.planner.cost.cost_model import AnalyticCostModel

__all__ = ["CHUNK_CELLS", "DRY_CHUNK_CELLS", "cp_chunk_check", "visible_pairs"]

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


def cp_chunk_check(cells: tuple[tuple[int, int], ...], device: torch.device, dtype: torch.dtype, hardware: str,
                   budget: Budget, heads: int = 32, kv_heads: int = 8, dim: int = 128) -> dict[str, Any]:
    """Part (g): measured vs predicted forward + backward seconds of each chunk cell, within ``budget``
    (a cell that would not fit the time left is skipped and says so)."""
    from lightning_hotspa.models.chunk_attention import chunk_attention

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

            def step(q: torch.Tensor = q, k: torch.Tensor = k, v: torch.Tensor = v, first: int = keys - rows) -> None:
                o = chunk_attention(q, k, v, first)
                o.backward(torch.ones_like(o))

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
            "kernel": "models/chunk_attention.chunk_attention (SDPA, bottom-right causal, GQA native)",
            "measured_over_predicted": {"min": min(ok), "max": max(ok)} if ok else None}
