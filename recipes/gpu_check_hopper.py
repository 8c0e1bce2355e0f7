"""gpu_check part (h) ``hopper``: the Hopper-class packed attention kernels (issue 51), correctness and speed.

Per ``documents`` kernel (``fa3_varlen``, ``fa4_varlen``, ``cudnn_varlen``) that runs here: ONE packed call over
documents of mixed lengths against per-document SDPA (output and q / k / v gradients, bf16 tolerance), then
forward + backward TFLOP/s at 1K-32K tokens per document beside the hardware profile's efficiency of the
kernel family it is priced as at that length, and the saturating curve those lengths give (long-sequence rate,
half length) beside the profile's (planner/cost/attention_curves.py). Per packed ``chunks`` kernel
(``fa3_chunks``, ``fa4_chunks``, ``torch_flash_chunks``): a cp4 rank's all-gather-KV chunks of three documents in
one call against ``sdpa_chunk`` per chunk (output and gradients). A kernel that cannot run here reports why (the
dry run: all of them). Never run on a GPU yet (2026-12-07): only the dry run has run it.
"""

from __future__ import annotations

from typing import Any

import torch
from gpu_check_common import Budget, DeviceTimer, attention_flops, packed_attention_inputs, time_repeated

from lightning_hotspa.models.attention import sdpa_attention
from lightning_hotspa.models.attention_kernels import KERNELS
from lightning_hotspa.planner.cost.attention_curves import fit_saturating
from lightning_hotspa.planner.cost.hardware import get_profile

__all__ = ["DOCUMENT_KERNELS", "CHUNK_KERNELS", "hopper_check"]

DOCUMENT_KERNELS = ("fa3_varlen", "fa4_varlen", "cudnn_varlen")
CHUNK_KERNELS = ("fa3_chunks", "fa4_chunks", "torch_flash_chunks")
#: bf16 forward + backward against SDPA's kernel: relative Frobenius error bound (fp32: much tighter)
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-4}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def _documents(name: str, device: torch.device, dtype: torch.dtype, lengths: list[int], hardware: str,
               budget: Budget) -> dict[str, Any]:
    record = KERNELS[name]
    reason = record.reason(device, dtype)
    if reason is not None:
        return {"status": "unavailable", "reason": reason}
    x = packed_attention_inputs(2048, 512, 8, 2, 128, device, dtype)
    cu = torch.tensor([0, 300, 301, 1200, x["tokens"]], dtype=torch.int32, device=device)  # mixed lengths
    outs, grads = [], []
    for fn in (record.call, sdpa_attention):
        q, k, v = (t.detach().requires_grad_() for t in (x["q"], x["k"], x["v"]))
        o = fn(q, k, v, cu, 1024)
        o.backward(x["grad"])
        outs.append(o)
        grads.append((q.grad, k.grad, v.grad))
    errors = [_rel(outs[0], outs[1])] + [_rel(a, b) for a, b in zip(grads[0], grads[1])]
    out: dict[str, Any] = {"status": "ok", "rel_errors_out_dq_dk_dv": errors,
                           "match": max(errors) <= TOLERANCE.get(dtype, 2e-2), "speed": []}
    profile = get_profile(hardware)
    priced = record.priced_as or name
    long_rate, half = profile.attention_efficiency_for(priced, 128), profile.attention_half_length_for(priced)
    timer = DeviceTimer(device)
    for length in lengths:
        if not budget.allows():
            out["speed"].append({"length": length, "status": "skipped: budget spent"})
            continue
        y = packed_attention_inputs(max(length, 32768), length, 32, 8, 128, device, dtype)

        def step(y: dict[str, Any] = y) -> None:
            record.call(y["q"], y["k"], y["v"], y["cu_seqlens"], y["max_seqlen"]).backward(y["grad"])

        timed = time_repeated(step, timer, budget)
        tflops = attention_flops(y["tokens"], length, 32, 128) / timed["seconds"] / 1e12
        out["speed"].append({"length": length, "seconds": timed["seconds"], "tflops": tflops,
                             "efficiency": tflops * 1e12 / profile.peak_flops,
                             "profile_efficiency": long_rate * length / (length + half), "priced_as": priced})
    points = [(p["length"], p["tflops"]) for p in out["speed"] if "tflops" in p]
    if len({n for n, _ in points}) >= 2:  # the priced curve against the one these lengths give
        fit = fit_saturating(name, [n for n, _ in points], [t for _, t in points])
        out["curve"] = {"efficiency_long": fit.e_inf_tflops * 1e12 / profile.peak_flops,
                        "half_length": fit.half_length, "max_residual": fit.max_residual,
                        "profile_efficiency_long": long_rate, "profile_half_length": half}
    return out


def _chunks(name: str, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    from lightning_hotspa.models.chunk_attention import sdpa_chunks_forward
    from lightning_hotspa.parallel.kv_gather import kv_geometry
    from lightning_hotspa.plan import pack_micro_batch

    record = KERNELS[name]
    reason = record.reason(device, dtype)
    if reason is not None:
        return {"status": "unavailable", "reason": reason}
    cu = pack_micro_batch([torch.zeros(n, dtype=torch.long) for n in (1000, 64, 3000)], cp_size=4,
                          cp_rank=1).cu_seqlens
    g = kv_geometry(cu, 4, 1, 4, 1)
    gen = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(g.blocks[-1][1], 8, 128, device=device, dtype=dtype, generator=gen)
    k, v = (torch.randn(g.full_tokens, 2, 128, device=device, dtype=dtype, generator=gen) for _ in range(2))
    grad = torch.randn_like(q)
    out, kept = record.call(q, k, v, g.blocks, None)
    got = record.backward(grad, q, k, v, kept, g.blocks, None)
    qr, kr, vr = (t.detach().requires_grad_() for t in (q, k, v))
    ref, _ = sdpa_chunks_forward(qr, kr, vr, g.blocks, None)
    want = torch.autograd.grad(ref, (qr, kr, vr), grad)
    errors = [_rel(out, ref)] + [_rel(a, b) for a, b in zip(got, want)]
    return {"status": "ok", "calls_forward": 1, "chunks": len(g.blocks), "rel_errors_out_dq_dk_dv": errors,
            "match": max(errors) <= TOLERANCE.get(dtype, 2e-2)}


def hopper_check(device: torch.device, dtype: torch.dtype, hardware: str, budget: Budget,
                 lengths: tuple[int, ...] = (1024, 2048, 8192, 32768)) -> dict[str, Any]:
    """Part (h): every Hopper-class kernel's correctness against SDPA and its speed, or why it cannot run."""
    out: dict[str, Any] = {"documents": {}, "chunks": {}, "hardware_profile": hardware,
                           "capability": list(torch.cuda.get_device_capability(device)) if device.type == "cuda"
                           else None}
    for name in DOCUMENT_KERNELS:
        try:
            out["documents"][name] = _documents(name, device, dtype, list(lengths), hardware, budget)
        except Exception as err:  # noqa: BLE001 - one kernel failing must not lose the others
            out["documents"][name] = {"status": f"error: {err!r}"[:300]}
    for name in CHUNK_KERNELS:
        try:
            out["chunks"][name] = _chunks(name, device, dtype)
        except Exception as err:  # noqa: BLE001
            out["chunks"][name] = {"status": f"error: {err!r}"[:300]}
    return out
