"""gpu_check part (f) ``hotpath``: host syncs per steady-state step, and the KV ring's block kernel
against ``torch_varlen`` on one long document (one device, no collectives).

* ``host_syncs``: on CUDA, ``torch.cuda.set_sync_debug_mode("warn")`` over steady-state forward +
  backward steps of the tiny GQA model (a pinned micro-batch moved with ``.to``), its warnings
  counted; on CPU (the dry run) :func:`lightning_hotspa.testing.host_syncs.count_host_syncs` stands in.
* ``kv_chunks``: one document split for cp4 ``:kv``; every rank's two query chunks run as the KV ring
  runs them (``gpu_check_cp.ring_chunk``: the registry's block kernel per key chunk, merged by
  log-sum-exp, backward from the merged output and log-sum-exp), forward + backward, summed over the 4
  ranks, against one call of the whole document through ``torch_varlen`` (CUDA) or ``sdpa`` (CPU). The
  ring's shifts are not run: one device cannot hold two NCCL ranks, so the collective code stays
  unmeasured on a GPU.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from gpu_check_common import Budget, DeviceTimer, sync, time_repeated

from lightning_hotspa.models import Llama, LlamaConfig, token_mean_cross_entropy
from lightning_hotspa.plan import pack_micro_batch

__all__ = ["hotpath_check"]


def _host_syncs(device: torch.device, dtype: torch.dtype, steps: int = 3) -> dict[str, Any]:
    """Would-be (CPU) or reported (CUDA) host syncs per steady-state step of the tiny model."""
    torch.manual_seed(0)
    model = Llama(LlamaConfig.preset("tiny", sliding_window=64)).to(device=device, dtype=dtype)
    g = torch.Generator().manual_seed(0)

    def batch():
        mb = pack_micro_batch([torch.randint(0, 256, (n,), generator=g) for n in (300, 77, 129)])
        return (mb.pin_memory() if device.type == "cuda" else mb).to(device)

    def step(mb):
        logits = model(mb.input_ids, mb.position_ids, mb.cu_seqlens, mb.max_seqlen)
        token_mean_cross_entropy(logits, mb.labels).backward()

    step(batch())  # warm-up: caches fill
    batches = [batch() for _ in range(steps)]  # built (and validated) before counting, as a loader does
    sync(device)
    if device.type == "cuda":
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                for mb in batches:
                    step(mb)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        messages = [str(w.message)[:200] for w in caught if "synchroniz" in str(w.message).lower()]
        return {"method": "torch.cuda.set_sync_debug_mode('warn')", "per_step": len(messages) / steps,
                "examples": messages[:5]}
    from lightning_hotspa.testing.host_syncs import count_host_syncs

    with count_host_syncs() as log:
        for mb in batches:
            step(mb)
    return {"method": "testing.host_syncs (CPU stand-in)", "per_step": log.count / steps, "ops": dict(log.ops)}


def _kv_chunks(tokens: int, device: torch.device, dtype: torch.dtype, budget: Budget,
               cp: int = 4, heads: int = 32, kv_heads: int = 8, dim: int = 128) -> dict[str, Any]:
    """Sum over cp ranks of the chunk kernel's forward+backward vs the whole document in one call."""
    from gpu_check_cp import ring_chunk
    from gpu_check_speed import backends_for

    from lightning_hotspa.models.attention_kernels import KERNELS, default_chunk_kernel

    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(tokens, h, dim, device=device, dtype=dtype, generator=gen, requires_grad=True)
               for h in (heads, kv_heads, kv_heads))
    c = tokens // (2 * cp)
    cu = torch.tensor([0, tokens], dtype=torch.int32, device=device)
    name = "torch_varlen" if device.type == "cuda" and "torch_varlen" in backends_for(device) else "sdpa"
    whole = backends_for(device)[name]
    timer = DeviceTimer(device)

    kernel = KERNELS[default_chunk_kernel(device, dtype)]

    def chunks() -> None:
        with torch.no_grad():
            for r in range(cp):
                for first in (r * c, (2 * cp - 1 - r) * c):
                    ring_chunk(q[first:first + c], k[:first + c], v[:first + c], torch.ones_like(q[:c]), kernel)

    def single() -> None:
        out = whole(q, k, v, cu, tokens)
        out.backward(torch.ones_like(out))

    half = Budget(budget.left() / 2, budget.end)
    ours = time_repeated(chunks, timer, half)
    ref = time_repeated(single, timer, Budget(budget.left(), budget.end))
    return {"tokens": tokens, "cp": cp, "heads": [heads, kv_heads, dim], "reference": name,
            "chunks_s": ours["seconds"], "single_s": ref["seconds"], "ratio": ours["seconds"] / ref["seconds"],
            "kernel_calls": cp * (2 * cp + 1), "block_kernel": kernel.name, "timer": timer.kind}


def hotpath_check(tokens: int, device: torch.device, dtype: torch.dtype, budget: Budget) -> dict[str, Any]:
    """Part (f): host syncs per step and the chunk kernel's cost against one whole-document call."""
    out: dict[str, Any] = {}
    for key, fn in (("host_syncs", lambda: _host_syncs(device, dtype)),
                    ("kv_chunks", lambda: _kv_chunks(tokens, device, dtype, budget))):
        if not budget.allows():
            out[key] = {"status": "skipped: budget spent"}
            continue
        try:  # one failed check must not lose the other
            out[key] = fn()
        except Exception as err:  # noqa: BLE001
            out[key] = {"status": f"error: {err!r}"[:500]}
    return out
