"""gpu_check parts (b) and (e): speed per attention backend, and device-event vs host timings.

(b) For each attention backend that runs here: forward + backward tokens/s and MFU at each document
length, for core attention alone (the 1b preset's heads) and for the whole model; the whole-model
cells reuse recipes/benchmark_backends.py (``packed_row``, ``time_cell``, ``fit_efficiencies``). Its
peak memory is set against the cost model's memory model (part (d)). (e) One training step's stages
(forward, backward, optimizer step) timed three ways: device events, the host clock without a
synchronize (what a launch-only host timer sees) and the host clock with one.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn.functional as F
from benchmark_backends import fit_efficiencies, packed_row, time_cell
from gpu_check_common import (
    Budget,
    DeviceTimer,
    attention_backends,
    attention_flops,
    mfu,
    packed_attention_inputs,
    sync,
    time_repeated,
)

from lightning_hotspa.layout import Layout
from lightning_hotspa.models import auto_backend_name, sdpa_attention
from lightning_hotspa.models.config import LlamaConfig
from lightning_hotspa.models.llama import Llama
from lightning_hotspa.planner.cost.cost_model import AnalyticCostModel


def _is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()


@torch.no_grad()
def _rel_error_vs_sdpa(fn: Any, x: dict[str, Any]) -> float:
    """||out - sdpa_out|| / ||sdpa_out|| of one forward (the per-document SDPA loop is the reference)."""
    args = (x["q"].detach(), x["k"].detach(), x["v"].detach(), x["cu_seqlens"], x["max_seqlen"])
    out, ref = fn(*args).float(), sdpa_attention(*args).float()
    return float((out - ref).norm() / ref.norm())


def attention_alone(config: LlamaConfig, lengths: list[int], tokens: int, device: torch.device,
                    dtype: torch.dtype, peaks: dict[str, float], budget: Budget,
                    backends: dict[str, Any]) -> dict[str, Any]:
    """Core attention forward + backward of one layer's q/k/v, per backend and document length."""
    timer = DeviceTimer(device)
    out: dict[str, Any] = {}
    for name, fn in backends.items():
        if isinstance(fn, str):
            out[name] = {"status": "unavailable", "reason": fn}
            continue
        cells = []
        for length in lengths:
            cell: dict[str, Any] = {"length": length}
            if not budget.allows():
                cells.append({**cell, "status": "skipped: time budget spent"})
                continue
            x = packed_attention_inputs(tokens, length, config.n_heads, config.n_kv_heads, config.head_dim,
                                        device, dtype)

            def step(x: dict[str, Any] = x, fn: Any = fn) -> None:
                o = fn(x["q"], x["k"], x["v"], x["cu_seqlens"], x["max_seqlen"])
                o.backward(x["grad"])
                for t in ("q", "k", "v"):
                    x[t].grad = None

            if length == lengths[0]:  # the same function as the universal fallback?
                try:
                    cell["rel_error_vs_sdpa"] = _rel_error_vs_sdpa(fn, x)
                except Exception as err:  # noqa: BLE001
                    cell["rel_error_vs_sdpa"] = f"error: {err!r}"[:300]
            try:
                t0 = time.perf_counter()
                step()  # the first call pays compilation (flex) and kernel selection
                sync(device)
                cell["first_call_s"] = time.perf_counter() - t0
                cell.update(time_repeated(step, timer, budget, warmup=1, reps=5))
            except Exception as err:  # noqa: BLE001 - one failing kernel must not end the check
                cells.append({**cell, "status": "out of memory" if _is_oom(err) else f"error: {err!r}"[:300]})
                del x
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                continue
            flops = attention_flops(x["tokens"], length, config.n_heads, config.head_dim)
            cell.update(status="ok", tokens=x["tokens"], tokens_per_s=x["tokens"] / cell["seconds"],
                        **mfu(flops, cell["seconds"], peaks["measured"], peaks["datasheet"]))
            cells.append(cell)
            del x
        out[name] = {"status": "ok", "cells": cells}
    return out


def whole_model(config: LlamaConfig, model: Llama, lengths: list[int], tokens: int, device: torch.device,
                peaks: dict[str, float], budget: Budget, backends: dict[str, Any]) -> dict[str, Any]:
    """The whole model forward + backward (no optimizer) per backend and length, via benchmark_backends;
    MFU by ``LlamaConfig.flops_per_token``; the efficiency fit; peak memory against the memory model."""
    memory_model = AnalyticCostModel(config, "H200", 1).memory(Layout(), activation_checkpointing=False)
    out: dict[str, Any] = {}
    for name, fn in backends.items():
        if isinstance(fn, str):
            out[name] = {"status": "unavailable", "reason": fn}
            continue
        model.set_attention_backend(fn)
        cells = []
        for length in lengths:
            if not budget.allows():
                cells.append({"length": length, "status": "skipped: time budget spent"})
                continue
            row = packed_row(tokens, length, config.vocab_size, device)
            n = row["documents"] * length
            cell: dict[str, Any] = {"length": length, "tokens": n}
            try:
                cell.update(time_cell(model, row, steps=2, warmup=1, device=device))
            except Exception as err:  # noqa: BLE001
                model.zero_grad(set_to_none=True)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                cells.append({**cell, "status": "out of memory" if _is_oom(err) else f"error: {err!r}"[:300]})
                continue
            flops = config.flops_per_token(length) * n
            cell.update(status="ok", tokens_per_s=n / cell["seconds"],
                        **mfu(flops, cell["seconds"], peaks["measured"], peaks["datasheet"]))
            predicted = memory_model.working + memory_model.activation_per_token * n
            measured = cell.pop("peak_memory_gib", None)
            cell["memory"] = {"predicted_bytes": predicted,
                              "measured_peak_bytes": None if measured is None else measured * 2**30,
                              "measured_over_predicted": None if measured is None else measured * 2**30 / predicted}
            cells.append(cell)
        ok = [c for c in cells if c.get("status") == "ok"]
        out[name] = {"status": "ok", "cells": cells,
                     "fit_vs_datasheet": fit_efficiencies(config, ok, peaks["datasheet"]),
                     "fit_vs_measured": fit_efficiencies(config, ok, peaks["measured"])}
    model.set_attention_backend("auto")
    return out


def profile_backend(results: dict[str, Any], device: torch.device, dtype: torch.dtype) -> str | None:
    """The backend whose fit goes into the profile: what the runtime's "auto" picks, else the fastest."""
    usable = {n: r for n, r in results.items() if r.get("fit_vs_datasheet")}
    auto = auto_backend_name(device, dtype)
    if auto in usable:
        return auto
    if not usable:
        return None

    def best_rate(r: dict[str, Any]) -> float:
        return max((c["tokens_per_s"] for c in r["cells"] if c.get("status") == "ok"), default=0.0)

    return max(usable, key=lambda n: best_rate(usable[n]))


def stage_timings(model: Llama, config: LlamaConfig, tokens: int, length: int, device: torch.device,
                  budget: Budget, steps: int = 3) -> dict[str, Any]:
    """Forward, backward and AdamW step of ``model`` timed by device events, by the host clock with no
    synchronize (launch time only, what an unsynchronized stage timer records) and by the host clock
    around a synchronize; medians over ``steps`` after one warm-up."""
    timer = DeviceTimer(device)
    row = packed_row(tokens, length, config.vocab_size, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    stages = ("forward", "backward", "optimizer")
    records: dict[str, dict[str, list[float]]] = {s: {"device": [], "host_nosync": [], "host_sync": []}
                                                   for s in stages}

    def run(record: bool, synchronize: bool) -> None:
        state: dict[str, Any] = {}
        events: list[tuple[str, Any, Any]] = []

        def forward() -> None:
            logits = model(row["input_ids"], row["position_ids"], row["cu_seqlens"], row["max_seqlen"])
            state["loss"] = F.cross_entropy(logits.float(), row["targets"])

        work = {"forward": forward, "backward": lambda: state["loss"].backward(),
                "optimizer": lambda: (optimizer.step(), optimizer.zero_grad(set_to_none=True))}
        for stage in stages:
            if synchronize:
                sync(device)
            h0 = time.perf_counter()
            e0 = timer.mark()
            work[stage]()
            e1 = timer.mark()
            h1 = time.perf_counter()
            if synchronize:
                sync(device)
            h2 = time.perf_counter()
            if record:
                key = "host_sync" if synchronize else "host_nosync"
                records[stage][key].append((h2 if synchronize else h1) - h0)
                events.append((stage, e0, e1))
        sync(device)
        for stage, e0, e1 in events:  # read after the step: reading an event waits for it
            records[stage]["device"].append(timer.seconds(e0, e1))

    run(record=False, synchronize=True)  # warm-up
    done = 0
    while done < steps and budget.allows():
        run(record=True, synchronize=False)
        run(record=True, synchronize=True)
        done += 1
    model.zero_grad(set_to_none=True)

    def median(xs: list[float]) -> float | None:
        return sorted(xs)[len(xs) // 2] if xs else None

    out: dict[str, Any] = {"timer": timer.kind, "tokens": row["documents"] * length, "length": length,
                           "steps": done, "stages": {}}
    for stage in stages:
        r = {k: median(v) for k, v in records[stage].items()}
        dev = r["device"]
        r["host_sync_over_device"] = r["host_sync"] / dev if dev and r["host_sync"] is not None else None
        r["host_nosync_over_device"] = r["host_nosync"] / dev if dev and r["host_nosync"] is not None else None
        out["stages"][stage] = r
    return out


def backends_for(device: torch.device) -> dict[str, Any]:
    """The attention backends of part (b), in the order they run: the cheap-to-start ones first."""
    found = attention_backends(device)
    order = ["torch_varlen", "flash_varlen", "sdpa", "flex"]
    return {name: found[name] for name in order if name in found}
