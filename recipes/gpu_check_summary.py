"""gpu_check: the profile update fitted from the parts, and the one-line summary printed last.

The update sets only what was measured and is in range: ``dense_efficiency`` and
``attention_efficiency`` from part (b)'s whole-model fit of the backend the runtime's "auto" uses
(against the profile's data-sheet ``peak_flops``, the rate those efficiencies multiply), and the tp
and cp shard efficiency curves from part (c) (mean over the two layer shapes). It is checked by
applying it (``lightning_hotspa.planner.cost.profile_update``) and pricing llama7b layouts on 8 devices
before and after.
"""

from __future__ import annotations

from typing import Any

from lightning_hotspa.layout import Layout
from lightning_hotspa.planner.cost.cost_model import AnalyticCostModel
from lightning_hotspa.planner.cost.profile_update import apply_profile_update


def _fitted(data: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(fields to set, fields measured but left out with why)."""
    parts = data["parts"]
    fields: dict[str, Any] = {}
    rejected: dict[str, Any] = {}
    backends = parts.get("backends") or {}
    chosen = backends.get("profile_backend")
    fit = ((backends.get("whole_model") or {}).get(chosen) or {}).get("fit_vs_datasheet") if chosen else None
    for key, value in (fit or {}).items():
        if 0 < value <= 1.5:
            fields[key] = value
        else:
            rejected[key] = {"value": value, "why": "outside (0, 1.5]: the fit does not describe these times"}
    curves = (parts.get("shards") or {}).get("curves") or {}
    for kind in ("tp", "cp"):
        good = [[int(d), e] for d, e in curves.get(kind, []) if 0 < e <= 2]
        bad = [[d, e] for d, e in curves.get(kind, []) if not 0 < e <= 2]
        if good:
            fields[f"{kind}_efficiency"] = good
        if bad:
            rejected[f"{kind}_efficiency"] = {"value": bad, "why": "outside (0, 2]"}
    return fields, rejected


def profile_update(data: dict[str, Any]) -> dict[str, Any]:
    meta = data["meta"]
    fields, rejected = _fitted(data)
    peaks = meta.get("peaks") or {}
    file = {"profile": meta["hardware_profile"], "set": fields,
            "measured": {"date": meta["date"], "device": meta["device"], "torch": meta["torch"],
                         "command": "recipes/gpu_check.py" + (" --dry-run" if meta["dry_run"] else ""),
                         "matmul_flops": peaks.get("measured")},
            "rejected": rejected, "dry_run": meta["dry_run"]}
    check: dict[str, Any] = {"fields": sorted(fields)}
    try:
        updated = apply_profile_update(meta["hardware_profile"], file)
    except ValueError as err:
        check["applies"] = f"error: {err}"
        return {"file": file, "check": check}
    check["applies"] = True
    effect = {}
    for layout in ("dp8", "dp4xtp2", "dp2xtp4", "tp8", "dp4xcp2", "dp2xcp4", "cp8"):
        par = Layout.parse(layout)
        before = AnalyticCostModel("llama7b", meta["hardware_profile"], 8).option(par, False).linear
        after = AnalyticCostModel("llama7b", updated, 8).option(par, False).linear
        effect[layout] = after / before
    check["llama7b_world8_seconds_per_token_after_over_before"] = effect
    return {"file": file, "check": check}


def _best(cells: list[dict[str, Any]], key: str, min_length: int = 0) -> float | None:
    values = [c[key] for c in cells if c.get("status") == "ok" and c["length"] >= min_length]
    return max(values) if values else None


def summarize(data: dict[str, Any]) -> dict[str, Any]:
    """The figures a reader needs first; every number is in the full report as well."""
    parts, meta = data["parts"], data["meta"]
    out: dict[str, Any] = {"gpu_check": "summary", "dry_run": meta["dry_run"], "device": meta["device"],
                           "torch": meta["torch"], "total_s": meta.get("total_s"), "watchdog": meta.get("watchdog"),
                           "part_seconds": data["part_seconds"], "report": "gpu_check.json",
                           "profile_update": "h200_profile_update.json"}
    if "matmul" in parts:
        out["matmul_tflops"] = (parts["matmul"].get("flops") or 0) / 1e12
    train = parts.get("train")
    if train:
        ref = train.get("reference") if isinstance(train.get("reference"), dict) else {}
        out["train"] = {k: train.get(k) for k in ("status", "pass", "loss_fell", "match", "steps",
                                                  "loss_first_mean", "loss_last_mean", "process_group_backend")}
        out["train"].update(loss_rel_errors=ref.get("loss_rel_errors"),
                            weight_rel_error_worst=ref.get("weight_rel_error_worst"),
                            memory_measured_over_predicted=(train.get("memory") or {}).get("measured_over_predicted"))
    backends = parts.get("backends")
    if backends:
        b: dict[str, Any] = {"status": backends.get("status", "ok"), "profile_backend": backends.get("profile_backend")}
        for kind in ("attention_alone", "whole_model"):
            for name, r in (backends.get(kind) or {}).items():
                entry = b.setdefault(name, {})
                if r.get("status") != "ok":
                    entry[kind] = r.get("reason") or r.get("status")
                    continue
                entry[kind] = {"mfu_datasheet_ge4k": _best(r["cells"], "mfu_datasheet_peak", 4096),
                               "mfu_measured_ge4k": _best(r["cells"], "mfu_measured_peak", 4096),
                               "cells": [[c["length"], round(c["mfu_datasheet_peak"], 4), round(c["tokens_per_s"])]
                                         if c.get("status") == "ok" else [c["length"], str(c.get("status"))[:80]]
                                         for c in r["cells"]]}
                if kind == "attention_alone" and r["cells"]:
                    entry["rel_error_vs_sdpa"] = r["cells"][0].get("rel_error_vs_sdpa")
                if kind == "whole_model":
                    entry["fit"] = r.get("fit_vs_datasheet")
                    entry["memory_measured_over_predicted"] = [
                        (c.get("memory") or {}).get("measured_over_predicted") for c in r["cells"] if "memory" in c]
        out["backends"] = b
    chunks = parts.get("cpchunks")
    if chunks:
        out["cpchunks"] = {"status": chunks.get("status", "ok"),
                           "measured_over_predicted": chunks.get("measured_over_predicted"),
                           "cells": [[c["rows"], c["keys"], round(c["measured_over_predicted"], 3)
                                      if c.get("status") == "ok" else str(c.get("status"))[:60]]
                                     for c in chunks.get("cells", [])]}
    shards = parts.get("shards")
    if shards:
        out["shards"] = {"status": shards.get("status", "ok"), "curves": shards.get("curves"),
                         "memory_saved_over_model": {
                             shape: {f"tp{c['tp']}cp{c['cp']}": round(c["memory"]["saved_over_model"], 3)
                                     for c in r["cells"] if c.get("status") == "ok"}
                             for shape, r in (shards.get("shapes") or {}).items()}}
        out["shards"]["memory_peak_over_model"] = {
            shape: {f"tp{c['tp']}cp{c['cp']}": c["memory"]["peak_over_model"] for c in r["cells"]
                    if c.get("status") == "ok"} for shape, r in (shards.get("shapes") or {}).items()}
    timers = parts.get("timers")
    if timers:
        out["timers"] = {"status": timers.get("status", "ok"), "timer": timers.get("timer"),
                         "stages": timers.get("stages")}
        if train and train.get("timings"):
            t = train["timings"]
            out["timers"]["strategy_steps"] = {
                "device_s": [x["device_s"] for x in t], "host_s": [x["host_s"] for x in t],
                "strategy_stage_s": [x["strategy_stage_s"] for x in t]}
    update = data.get("profile_update") or {}
    out["profile_update_set"] = (update.get("file") or {}).get("set")
    out["profile_update_check"] = update.get("check")
    return out
