"""Shared pieces of recipes/gpu_check.py: time budgets, device-event timing, the attention backends.

Kept apart from the parts so each part module stays one job. Nothing here needs hydra, wandb or
flash-attn; flex attention and torch's varlen attention are looked up at run time and reported as
unavailable (with why) where this torch lacks them.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from lightning_hotspa.models.attention_kernels import BACKENDS, select_attention_backend

DATASHEET_BF16_FLOPS = 989e12  # NVIDIA H100/H200 SXM dense bf16 (data sheet; the H200 profile's peak_flops)


class Budget:
    """Seconds one part may spend, never past the run's hard deadline; parts check it between cells."""

    def __init__(self, seconds: float, deadline: float) -> None:
        self.start = time.monotonic()
        self.end = min(self.start + seconds, deadline)
        self.seconds = seconds

    def left(self) -> float:
        return self.end - time.monotonic()

    def allows(self, estimate_s: float = 0.0) -> bool:
        return time.monotonic() + estimate_s < self.end

    def spent(self) -> float:
        return time.monotonic() - self.start


class DeviceTimer:
    """CUDA events on a GPU (what the device did, between two points of its stream); on CPU (the dry
    run) there are no device events, so the host clock stands in and ``kind`` says so."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.kind = "cuda-events" if self.cuda else "host-clock (no device events on cpu)"

    def mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def seconds(self, start: Any, end: Any) -> float:
        if self.cuda:
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        return end - start


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_repeated(fn: Callable[[], Any], timer: DeviceTimer, budget: Budget, warmup: int = 1,
                  reps: int = 3) -> dict[str, Any]:
    """Median device seconds of ``fn()`` over up to ``reps`` runs after ``warmup``; at least one timed
    run, fewer than ``reps`` when the budget runs out (``runs`` says how many)."""
    for _ in range(warmup):
        fn()
    samples: list[float] = []
    while len(samples) < reps and (not samples or budget.allows(samples[-1])):
        start = timer.mark()
        fn()
        samples.append(timer.seconds(start, timer.mark()))
    return {"seconds": statistics.median(samples), "runs": len(samples)}


def measure_matmul_flops(device: torch.device, dtype: torch.dtype, n: int, reps: int = 10) -> dict[str, Any]:
    """FLOP/s of an n x n x n product on random data (zeros run faster: METHOD.md), mean of ``reps``
    after 3 warm-ups, timed with device events: the ceiling MFU is also quoted against."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    timer = DeviceTimer(device)
    for _ in range(3):
        a @ b
    start = timer.mark()
    for _ in range(reps):
        a @ b
    seconds = timer.seconds(start, timer.mark()) / reps
    return {"n": n, "dtype": str(dtype).removeprefix("torch."), "seconds": seconds,
            "flops": 2.0 * n**3 / seconds, "timer": timer.kind}


# ------------------------------------------------------------------------------ attention backends
def _flex_parts() -> tuple[Any, Any] | str:
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError as err:
        return f"torch {torch.__version__} has no flex attention ({err})"
    return flex_attention, create_block_mask


def flex_document_attention(device: torch.device) -> Callable[..., Tensor] | str:
    """Flex attention with a causal document mask built from ``cu_seqlens`` (compiled on CUDA, where
    eager flex materializes the scores; eager on CPU), or why it is unavailable."""
    parts = _flex_parts()
    if isinstance(parts, str):
        return parts
    flex, create_block_mask = parts
    kernel = torch.compile(flex, dynamic=False) if device.type == "cuda" else flex
    # keyed by the cu_seqlens object, which the entry keeps alive (so its id is never reused): one
    # mask per packed row, built on its first layer, with no device sync to compare contents
    masks: dict[tuple[int, int], tuple[Tensor, Any]] = {}

    def block_mask(cu_seqlens: Tensor, total: int) -> Any:
        key = (id(cu_seqlens), total)
        if key not in masks:
            positions = torch.arange(total, device=cu_seqlens.device)
            doc = torch.bucketize(positions, cu_seqlens[1:].to(positions.dtype), right=True)

            def causal_document(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
                return (doc[q_idx] == doc[kv_idx]) & (q_idx >= kv_idx)

            masks[key] = (cu_seqlens, create_block_mask(causal_document, None, None, total, total,
                                                        device=cu_seqlens.device))
        return masks[key][1]

    def attention(q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, max_seqlen: int) -> Tensor:
        del max_seqlen
        mask = block_mask(cu_seqlens, q.shape[0])
        q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, heads, T, d]
        out = kernel(q4, k4, v4, block_mask=mask, enable_gqa=k.shape[1] != q.shape[1])
        return out.squeeze(0).transpose(0, 1)

    return attention


def attention_backends(device: torch.device, with_flex: bool = True) -> dict[str, Callable[..., Tensor] | str]:
    """Every backend this check knows: a callable where it runs here, else the reason it does not
    (flash-attn counts only when it is already importable; nothing is installed)."""
    out: dict[str, Callable[..., Tensor] | str] = {}
    for name in ("torch_varlen", "flash_varlen", "sdpa"):
        try:
            out[name] = select_attention_backend(name, device)
        except ValueError as err:
            out[name] = str(err)
    assert set(out) <= set(BACKENDS)
    if with_flex:
        out["flex"] = flex_document_attention(device)
    return out


def working_backend(device: torch.device, dtype: torch.dtype) -> tuple[str, str | None]:
    """The backend the runtime's "auto" picks here, if a small forward + backward runs; else "sdpa",
    with why (so a kernel that fails on this torch costs one part's backend, not the whole check)."""
    from lightning_hotspa.models import auto_backend_name

    name = auto_backend_name(device, dtype)
    if name == "sdpa":
        return name, None
    try:
        x = packed_attention_inputs(256, 128, 4, 2, 64, device, dtype)
        BACKENDS[name](x["q"], x["k"], x["v"], x["cu_seqlens"], 128).backward(x["grad"])
        sync(device)
    except Exception as err:  # noqa: BLE001
        return "sdpa", f"{name} failed a forward + backward here, using sdpa: {err!r}"[:400]
    return name, None


def packed_attention_inputs(tokens: int, length: int, heads: int, kv_heads: int, head_dim: int,
                            device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """Random q [T, h, d], k/v [T, hkv, d] (requiring grad) for ``tokens // length`` documents."""
    docs = tokens // length
    total = docs * length
    g = torch.Generator(device=device).manual_seed(length)  # drawn on the device: fast at 32K tokens

    def rand(h: int) -> Tensor:
        return torch.randn(total, h, head_dim, generator=g, device=device, dtype=dtype)

    q, k, v = (rand(h).requires_grad_() for h in (heads, kv_heads, kv_heads))
    return {"q": q, "k": k, "v": v, "grad": rand(heads),
            "cu_seqlens": (torch.arange(docs + 1, dtype=torch.int32) * length).to(device),
            "max_seqlen": length, "tokens": total, "documents": docs}


def attention_flops(tokens: int, length: int, heads: int, head_dim: int) -> float:
    """Forward + backward FLOPs of causal attention over documents of ``length``, by the project's
    convention (``LlamaConfig.flops_per_token``: backward = 2 x forward; FlashAttention papers count
    2.5 x, so these MFUs are on the low side): 12 * heads * head_dim * (length + 1) / 2 per token."""
    return 6.0 * heads * head_dim * (length + 1) * tokens


def mfu(flops: float, seconds: float, measured_flops: float, datasheet_flops: float) -> dict[str, float]:
    rate = flops / seconds
    return {"tflops": rate / 1e12, "mfu_measured_peak": rate / measured_flops,
            "mfu_datasheet_peak": rate / datasheet_flops}
