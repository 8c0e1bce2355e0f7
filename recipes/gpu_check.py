"""GPU check: what only a GPU can tell this project, on ONE device, in about four minutes.

    OUT=/some/dir python recipes/gpu_check.py            # CUDA (the lent H200), bf16
    python recipes/gpu_check.py --dry-run                # CPU, tiny shapes, every part in seconds

Parts, each with its own time budget (``--budget-s`` split by ``PART_SHARES``; a part checks it
between cells and reports what it skipped); the full report is rewritten to ``$OUT/gpu_check.json``
after every part (``$OUT`` defaults to ./gpu_check_out), so a run cut short still returns them:

* ``matmul``: the device's bf16 GEMM rate (random 8192^3), the measured ceiling MFU is quoted against,
  besides the profile's data-sheet ``peak_flops`` (989 TFLOP/s for the H200);
* (a) ``train``: HotSPaStrategy under a Lightning Trainer (NCCL, world size 1, bf16-mixed) on the
  stdlib corpus, ~20 steps of the 1b preset: the loss falls and the first steps equal a plain
  PyTorch reference (gpu_check_train.py says the tolerances and why);
* (b) ``backends``: per attention backend (torch varlen, flex with a document mask, SDPA; flash-attn
  only if importable), forward + backward tokens/s and MFU at document lengths 2K-32K, for
  attention alone and for the whole 1b model (gpu_check_speed.py, reusing benchmark_backends.py);
* (c) ``shards`` and (d) memory: one llama7b and one Llama-3 8B decoder layer on the local shapes of
  tp and cp 1/2/4/8, shard efficiency and bytes per token against the memory model (gpu_check_layers.py);
* (e) ``timers``: device events against host clocks of a training step's stages (and, in part (a),
  of the strategy's own stage timers);
* (f) ``hotpath``: host syncs per steady-state step (``torch.cuda.set_sync_debug_mode("warn")``) and
  the KV ring's block kernel against ``torch_varlen`` on one 32K document (gpu_check_hotpath.py);
* (g) ``cpchunks``: attention forward + backward of the local chunks a cp ladder uses (1K-64K query
  rows over 8K-512K keys, GQA 32 / 8, head dim 128) as the KV ring's blocks, against the cost model's
  price of each, and the ring's CUDA block kernel (``sdpa_chunk``) against SDPA's forward and backward
  (``ring_blocks``: fp32 / bf16, GQA, a window's band masks) (gpu_check_cp.py). Never run on a GPU yet
  (2026-12-06): only the dry run has run it.
* (h) ``hopper``: the Hopper-class packed kernels (FA3 / FA4 / cuDNN documents kernels, the packed cp chunk
  kernels): one call against SDPA (output and gradients) and the documents kernels' TFLOP/s at 8K-32K beside
  the profile's efficiency (gpu_check_hopper.py). Never run on a GPU yet (2026-12-06): only the dry run.
* (i) ``compile`` (opt-in: ``--parts compile``, not in the default run): one decoder block compiled with
  inductor, the token dim dynamic, against eager over several length mixes: speedup, error, graphs and
  breaks (gpu_check_compile.py). Never run on a GPU yet (2026-12-06).
* (j) ``fp8`` (opt-in: ``--parts fp8``): one decoder block with its projections in FP8 per torchao recipe
  (``strategy.runtime.fp8``, parallel/fp8.py) against bf16: speedup, error, ``_scaled_mm`` calls (gpu_check_fp8.py).
  Never run on a GPU yet (2026-12-06): only its CPU dry run.

Parts run in the order of ``PARTS``, the backends part (with its flex-attention compile) last.

It writes ``$OUT/h200_profile_update.json`` (dense and attention efficiency, the tp and cp shard
efficiency curves) for ``lightning_hotspa.planner.cost.profile_update``; any ``--hardware`` option takes
that path. The last line printed is one JSON object (a summary; the full report is in the file).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
from gpu_check_common import Budget, measure_matmul_flops  # noqa: E402
from gpu_check_summary import profile_update, summarize  # noqa: E402

from lightning_hotspa.models.config import LlamaConfig  # noqa: E402
from lightning_hotspa.planner.cost.hardware import get_profile  # noqa: E402

# the backends part runs last: its flex-attention compile is the one step that can take minutes
PARTS = ("matmul", "train", "hotpath", "cpchunks", "hopper", "shards", "timers", "backends")
#: parts only ``--parts`` names run (their share comes out of the whole budget)
OPT_IN = ("compile", "fp8")
PART_SHARES = {"matmul": 0.03, "train": 0.28, "hotpath": 0.07, "cpchunks": 0.12, "hopper": 0.05, "backends": 0.23,
               "shards": 0.16, "timers": 0.06, "compile": 0.3,
               "fp8": 0.2}

REAL = {"preset": "1b", "steps": 20, "tokens_per_batch": 16384, "context_length": 8192, "tokens_per_rank": 8192,
        "lr": 3e-4, "lengths": [2048, 4096, 8192, 16384, 32768], "tokens": 32768, "matmul_n": 8192,
        "layer_tokens": 16384, "layer_length": 4096, "timer_tokens": 8192, "timer_length": 2048,
        "kv_tokens": 32768, "hardware": "H200", "budget_s": 265.0, "cp_chunks": "real",
        "compile_mixes": [[4096, 4096], [1024] * 8, [8192], [2048, 512, 3072, 2560]],
        "fp8_lengths": [4096, 4096, 8192]}
DRY = {"preset": "tiny", "steps": 8, "tokens_per_batch": 1024, "context_length": 256, "tokens_per_rank": 512,
       "lr": 3e-3, "lengths": [64, 128], "tokens": 256, "matmul_n": 256,
       "layer_tokens": 256, "layer_length": 64, "timer_tokens": 256, "timer_length": 64,
       "kv_tokens": 256, "hardware": "cpu-gloo", "budget_s": 120.0, "cp_chunks": "dry",
       "compile_mixes": [[32, 32], [16] * 4], "fp8_lengths": [32, 32]}


class Report:
    """The growing result; rewritten (atomically) after every part and cell group."""

    def __init__(self, out_dir: Path, meta: dict[str, Any]) -> None:
        self.out_dir = out_dir
        self.data: dict[str, Any] = {"meta": meta, "parts": {}, "part_seconds": {}}
        out_dir.mkdir(parents=True, exist_ok=True)
        self.lock = threading.Lock()

    def set(self, part: str, value: Any, seconds: float | None = None) -> None:
        with self.lock:
            self.data["parts"][part] = value
            if seconds is not None:
                self.data["part_seconds"][part] = seconds
        self.write()

    def write(self) -> None:
        with self.lock:
            self._dump("gpu_check.json", self.data)
            update = profile_update(self.data)
            self.data["profile_update"] = update
            self._dump("h200_profile_update.json", update["file"])

    def _dump(self, name: str, obj: Any) -> None:
        tmp = self.out_dir / f".{name}.tmp"
        tmp.write_text(json.dumps(obj, indent=1, default=str))
        tmp.replace(self.out_dir / name)


def _watchdog(report: Report, seconds: float) -> None:
    """Past the hard deadline (a kernel or collective that hangs): print what there is and exit."""

    def fire() -> None:
        report.data["meta"]["watchdog"] = f"hard deadline of {seconds:.0f} s hit; parts after it are missing"
        report.write()
        print(json.dumps(summarize(report.data), default=str), flush=True)
        os._exit(3)

    faulthandler.dump_traceback_later(max(seconds - 5, 1), exit=False)  # where it hung, on stderr
    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()


def _run_part(report: Report, name: str, fn: Any, budget: Budget) -> Any:
    t0 = time.perf_counter()
    try:
        value = fn(budget)
    except Exception as err:  # noqa: BLE001 - one failing part must not lose the others
        import traceback

        value = {"status": f"error: {err!r}"[:500], "traceback": traceback.format_exc()[-3000:]}
        print(f"gpu_check: part {name} failed: {err!r}", file=sys.stderr, flush=True)
    seconds = time.perf_counter() - t0
    if isinstance(value, dict):
        value.setdefault("status", "ok")
        value.setdefault("budget_s", budget.seconds)
    try:  # a report that cannot be written (e.g. the profile update fails on a part's figures) must
        report.set(name, value, seconds)  # not abort the parts after it
    except Exception as err:  # noqa: BLE001
        print(f"gpu_check: writing part {name} failed: {err!r}", file=sys.stderr, flush=True)
    print(f"gpu_check: {name} done in {seconds:.1f} s (budget {budget.seconds:.0f} s)", flush=True)
    return value


def run(args: argparse.Namespace) -> dict[str, Any]:
    cfg = dict(DRY if args.dry_run else REAL)
    if args.budget_s is not None:
        cfg["budget_s"] = args.budget_s
    device = torch.device("cpu" if args.dry_run else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA device here; use --dry-run for the CPU check")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    profile = get_profile(cfg["hardware"])
    out_dir = Path(args.out or os.environ.get("OUT") or "gpu_check_out")
    meta = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "dry_run": args.dry_run,
            "command": " ".join(sys.argv), "torch": torch.__version__, "python": sys.version.split()[0],
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "dtype": str(dtype).removeprefix("torch."), "hardware_profile": profile.name,
            "datasheet_peak_flops": profile.peak_flops, "config": cfg, "parts": list(args.parts)}
    report = Report(out_dir, meta)
    # the token cache and Lightning's root stay out of $OUT: only a few files come back from there
    work_dir = tempfile.mkdtemp(prefix="gpu_check_")
    start = time.monotonic()
    deadline = start + cfg["budget_s"]
    _watchdog(report, cfg["budget_s"] + args.grace_s)

    def budget(part: str) -> Budget:
        return Budget(cfg["budget_s"] * PART_SHARES[part], deadline)

    peaks = {"measured": profile.peak_flops, "datasheet": profile.peak_flops}
    if "matmul" in args.parts:
        mm = _run_part(report, "matmul", lambda b: measure_matmul_flops(device, dtype, cfg["matmul_n"]),
                       budget("matmul"))
        peaks["measured"] = mm.get("flops", peaks["measured"])
    report.data["meta"]["peaks"] = peaks
    shared: dict[str, Any] = {}  # part (a)'s reference model, reused by (b) and (e)
    if "train" in args.parts:
        from gpu_check_train import train_check

        _run_part(report, "train", lambda b: train_check(
            preset=cfg["preset"], steps=cfg["steps"], compare_steps=3, tokens_per_batch=cfg["tokens_per_batch"],
            context_length=cfg["context_length"], tokens_per_rank=cfg["tokens_per_rank"], lr=cfg["lr"],
            device=device, work_dir=work_dir, budget=b, reserve_s=0.3 * b.seconds, keep=shared),
            budget("train"))
    config = LlamaConfig.preset(cfg["preset"])

    def model() -> Any:
        """Part (a)'s reference model in ``dtype`` (or a fresh one), built inside the part that first
        needs it, so a failure is that part's error."""
        if shared.get("dtype") != dtype:
            from lightning_hotspa.models import build_llama

            shared["model"] = (shared.get("model") or build_llama(config, seed=0, device=device)).to(dtype)
            shared["dtype"] = dtype
        return shared["model"]

    if "hotpath" in args.parts:
        from gpu_check_hotpath import hotpath_check

        _run_part(report, "hotpath", lambda b: hotpath_check(cfg["kv_tokens"], device, dtype, b), budget("hotpath"))
    if "cpchunks" in args.parts:
        from gpu_check_cp import CHUNK_CELLS, DRY_CHUNK_CELLS, cp_chunk_check

        cells, shape = (DRY_CHUNK_CELLS, {"heads": 4, "kv_heads": 2, "dim": 16}) if cfg["cp_chunks"] == "dry" else \
            (CHUNK_CELLS, {})
        _run_part(report, "cpchunks", lambda b: cp_chunk_check(cells, device, dtype, cfg["hardware"], b, **shape),
                  budget("cpchunks"))
    if "hopper" in args.parts:
        from gpu_check_hopper import hopper_check

        lengths = (1024, 2048, 8192, 32768) if device.type == "cuda" else (64, 128)
        _run_part(report, "hopper", lambda b: hopper_check(device, dtype, cfg["hardware"], b, lengths),
                  budget("hopper"))
    if "shards" in args.parts:
        _run_part(report, "shards", lambda b: _shards(cfg, device, dtype, b, args.dry_run), budget("shards"))
    if "timers" in args.parts:
        from gpu_check_common import working_backend
        from gpu_check_speed import stage_timings

        def timers(b: Budget) -> dict[str, Any]:
            m = model()
            m.set_attention_backend(working_backend(device, dtype)[0])
            return stage_timings(m, config, cfg["timer_tokens"], cfg["timer_length"], device, b)

        _run_part(report, "timers", timers, budget("timers"))
    if "compile" in args.parts:
        from gpu_check_compile import compile_check

        _run_part(report, "compile", lambda b: compile_check(config, cfg["compile_mixes"], device, dtype, b),
                  budget("compile"))
    if "fp8" in args.parts:
        from gpu_check_fp8 import fp8_check

        _run_part(report, "fp8", lambda b: fp8_check(config, cfg["fp8_lengths"], device, dtype, b), budget("fp8"))
    if "backends" in args.parts:  # last: flex attention's compile, behind the part's own budget
        _run_part(report, "backends", lambda b: _backends(config, model(), cfg, device, dtype, peaks, b),
                  budget("backends"))
    report.data["meta"]["total_s"] = time.monotonic() - start
    report.write()
    faulthandler.cancel_dump_traceback_later()
    shutil.rmtree(work_dir, ignore_errors=True)
    return report.data


def _backends(config: LlamaConfig, model: Any, cfg: dict[str, Any], device: torch.device, dtype: torch.dtype,
              peaks: dict[str, float], budget: Budget) -> dict[str, Any]:
    from gpu_check_speed import attention_alone, backends_for, profile_backend, whole_model

    backends = backends_for(device)
    alone_budget = Budget(budget.left() * 0.3, budget.end)
    alone = attention_alone(config, cfg["lengths"], cfg["tokens"], device, dtype, peaks, alone_budget, backends)
    model_results = whole_model(config, model, cfg["lengths"], cfg["tokens"], device, peaks, budget, backends)
    return {"attention_alone": alone, "whole_model": model_results, "preset": cfg["preset"],
            "profile_backend": profile_backend(model_results, device, dtype),
            "flops_convention": "LlamaConfig.flops_per_token: dense 6 x params, attention backward = 2 x forward"}


def _shards(cfg: dict[str, Any], device: torch.device, dtype: torch.dtype, budget: Budget,
            dry_run: bool) -> dict[str, Any]:
    from gpu_check_common import working_backend
    from gpu_check_layers import LLAMA3_8B, TINY_GQA, TINY_MHA, mean_curves, shard_efficiency
    from gpu_check_speed import backends_for

    shapes = ({"llama7b": TINY_MHA, "llama3_8b": TINY_GQA} if dry_run
              else {"llama7b": LlamaConfig.preset("llama7b"), "llama3_8b": LLAMA3_8B})
    name, note = working_backend(device, dtype)
    core = backends_for(device)[name]
    per_shape = shard_efficiency(shapes, [1, 2, 4, 8], cfg["layer_tokens"], cfg["layer_length"], core, device,
                                 dtype, budget)
    return {"attention_backend": name, "attention_backend_note": note, "shapes": per_shape,
            "curves": mean_curves(per_shape),
            "stand_ins": "tp: local weight shards; cp: Ulysses all-to-all replaced by a local reshape"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes: every part in seconds")
    parser.add_argument("--out", default=None, help="output folder (default: $OUT, else ./gpu_check_out)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="total seconds for all parts (default 265 on the GPU, 120 in the dry run)")
    parser.add_argument("--grace-s", type=float, default=45.0,
                        help="seconds past the budget before the watchdog prints what there is and exits")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help=f"comma-separated subset of {list(PARTS)}, or the opt-in {list(OPT_IN)}")
    args = parser.parse_args(argv)
    args.parts = [p for p in args.parts.split(",") if p]
    unknown = sorted(set(args.parts) - set(PARTS) - set(OPT_IN))
    if unknown or not args.parts:
        raise SystemExit(f"--parts: unknown {unknown or 'empty'}; choose from {list(PARTS + OPT_IN)}")
    if args.budget_s is not None and not args.budget_s > 0:
        raise SystemExit(f"--budget-s must be > 0, got {args.budget_s}")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    data = run(parse_args(argv))
    summary = summarize(data)
    print(json.dumps(summary, default=str), flush=True)
    return summary


if __name__ == "__main__":
    main()
