"""Single-device model speed per attention backend: tokens/s and MFU at each document length.

For calibrating a GPU hardware profile (``planner/cost/hardware.py``): one device, no
parallelism, forward + backward (no optimizer) of a Llama preset on packed rows of ``--tokens``
tokens cut into documents of one length each, for every backend in ``--backends`` and length in
``--lengths``. Each cell is the median over ``--steps`` timed steps after ``--warmup``, with a device
synchronize around each step. MFU = model FLOPs (``LlamaConfig.flops_per_token``: dense + causal
attention) / time / the profile's ``peak_flops``.

Per backend, a least-squares fit of seconds per token = dense / (peak * e_dense) + attention(L) /
(peak * e_attention) over the lengths gives the two efficiencies the cost model uses
(``dense_efficiency``, ``attention_efficiency``); they are printed next to the profile's current
values, not written anywhere. A cell that runs out of memory is reported as such. The last line is
one JSON object.

    python recipes/benchmark_backends.py                       # CUDA: 1b preset, bf16, 2K-32K
    python recipes/benchmark_backends.py --device cpu --preset tiny --lengths 64,256 --tokens 512
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lightning_hotspa.models.attention_kernels import BACKENDS, select_attention_backend  # noqa: E402
from lightning_hotspa.models.config import LlamaConfig  # noqa: E402
from lightning_hotspa.models.init import build_llama  # noqa: E402
from lightning_hotspa.models.llama import Llama  # noqa: E402
from lightning_hotspa.planner.cost.hardware import get_profile  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def available_backends(device: torch.device) -> list[str]:
    """The backends that can run on ``device`` here (the others are reported as skipped, with why)."""
    out = []
    for name in BACKENDS:
        try:
            select_attention_backend(name, device)
        except ValueError:
            continue
        out.append(name)
    return out


def packed_row(tokens: int, length: int, vocab: int, device: torch.device) -> dict[str, Any]:
    """``tokens // length`` documents of ``length`` tokens in one packed row (plus its targets)."""
    if length < 2 or tokens < length:
        raise SystemExit(f"each length must be in [2, --tokens={tokens}], got {length}")
    docs = tokens // length
    g = torch.Generator().manual_seed(length)
    ids = torch.randint(0, vocab, (docs * length + 1,), generator=g)
    return {"input_ids": ids[:-1].to(device), "targets": ids[1:].to(device),
            "position_ids": torch.arange(length).repeat(docs).to(device),
            "cu_seqlens": (torch.arange(docs + 1, dtype=torch.int32) * length).to(device),
            "max_seqlen": length, "documents": docs}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_cell(model: Llama, row: dict[str, Any], steps: int, warmup: int, device: torch.device) -> dict[str, Any]:
    """Median seconds of forward + backward over ``steps`` (after ``warmup``), peak memory."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    seconds = []
    for i in range(warmup + steps):
        _sync(device)
        t0 = time.perf_counter()
        logits = model(row["input_ids"], row["position_ids"], row["cu_seqlens"], row["max_seqlen"])
        loss = F.cross_entropy(logits.float(), row["targets"])
        loss.backward()
        _sync(device)
        if i >= warmup:
            seconds.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
        del logits, loss
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return {"seconds": statistics.median(seconds), "peak_memory_gib": None if peak is None else peak / 2**30}


def fit_efficiencies(config: LlamaConfig, cells: list[dict[str, Any]], peak_flops: float) -> dict[str, float] | None:
    """Least squares of seconds/token = dense/(peak*e_d) + attention(L)/(peak*e_a) over the lengths;
    None with fewer than two lengths or a non-positive coefficient (the model does not fit)."""
    ok = [c for c in cells if "seconds" in c]
    if len({c["length"] for c in ok}) < 2:
        return None
    dense = 6.0 * config.num_params(include_embedding=False)  # flops_per_token's dense part
    a = np.array([[dense, config.flops_per_token(c["length"]) - dense] for c in ok])
    y = np.array([c["seconds"] / c["tokens"] for c in ok])
    (x_dense, x_attn), *_ = np.linalg.lstsq(a, y, rcond=None)
    if x_dense <= 0 or x_attn <= 0:
        return None
    return {"dense_efficiency": 1.0 / (x_dense * peak_flops), "attention_efficiency": 1.0 / (x_attn * peak_flops)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    config = LlamaConfig.preset(args.preset)
    profile = get_profile(args.hardware)
    here = available_backends(device)
    wanted = here if args.backends == "all" else [b for b in args.backends.split(",") if b]
    unknown = sorted(set(wanted) - set(BACKENDS))
    if unknown:
        raise SystemExit(f"--backends: unknown {unknown}; choose from {sorted(BACKENDS)} or 'all'")
    skipped = {b: "unavailable on this machine" for b in wanted if b not in here}
    model = build_llama(config, seed=0, device=device).to(dtype)  # meta first: no default init of 1B params
    results: dict[str, Any] = {}
    for backend in (b for b in wanted if b in here):
        model.set_attention_backend(backend)
        cells = []
        for length in args.lengths:
            row = packed_row(args.tokens, length, config.vocab_size, device)
            tokens = row["documents"] * length
            cell: dict[str, Any] = {"length": length, "tokens": tokens}
            try:
                cell.update(time_cell(model, row, args.steps, args.warmup, device))
            except torch.OutOfMemoryError:
                model.zero_grad(set_to_none=True)
                torch.cuda.empty_cache()
                cell["error"] = "out of memory"
            if "seconds" in cell:
                flops = config.flops_per_token(length) * tokens
                cell["tokens_per_s"] = tokens / cell["seconds"]
                cell["tflops"] = flops / cell["seconds"] / 1e12
                cell["mfu"] = flops / cell["seconds"] / profile.peak_flops
            cells.append(cell)
            print(f"{backend:>13} L={length:>6}: " + (f"{cell['tokens_per_s']:10.0f} tok/s  MFU {cell['mfu']:.3f}"
                                                      if "seconds" in cell else cell["error"]), flush=True)
        results[backend] = {"cells": cells, "fit": fit_efficiencies(config, cells, profile.peak_flops)}
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "preset": args.preset, "dtype": args.dtype, "tokens": args.tokens,
            "hardware_profile": profile.name, "peak_flops": profile.peak_flops,
            "profile_efficiencies": {"dense_efficiency": profile.dense_efficiency,
                                     "attention_efficiency": profile.attention_efficiency},
            "skipped": skipped, "backends": results}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if cuda else "cpu")
    parser.add_argument("--preset", default="1b" if cuda else "tiny")
    parser.add_argument("--dtype", default="bf16" if cuda else "fp32", choices=sorted(DTYPES))
    parser.add_argument("--hardware", default="H200" if cuda else "cpu-gloo", help="profile for peak FLOP/s")
    parser.add_argument("--lengths", default="2048,4096,8192,16384,32768" if cuda else "64,256")
    parser.add_argument("--tokens", type=int, default=32768 if cuda else 512, help="tokens per packed row")
    parser.add_argument("--backends", default="all", help="comma-separated subset of the backends, or all")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args(argv)
    try:
        args.lengths = [int(x) for x in args.lengths.split(",") if x]
    except ValueError:
        raise SystemExit(f"--lengths must be comma-separated integers, got {args.lengths!r}") from None
    if not args.lengths:
        raise SystemExit("--lengths is empty")
    for key in ("steps", "tokens"):
        if getattr(args, key) < 1:
            raise SystemExit(f"--{key} must be >= 1, got {getattr(args, key)}")
    if args.warmup < 0:
        raise SystemExit(f"--warmup must be >= 0, got {args.warmup}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"--device {args.device}: no CUDA device here")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    out = run(parse_args(argv))
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
