"""FP8 linears via torchao (``strategy.runtime.fp8``, parallel/fp8.py) on CPU: layouts agree, training stays near bf16.

torch runs ``torch._scaled_mm`` on CPU, so the FP8 numerics are checked here (speed is not: no GPU ran any of it).

1. Layouts: one step of a tiny Llama (ffn 128) on 2 gloo ranks in dp2, tp2 with and without sequence
   parallelism, dp2:fsdp, cp2 and a plan switching dp2 -> tp2 -> dp2:fsdp, every layout on the same
   micro-batches (lightning_hotspa/tools/fp8_layouts.py), each against the single process in FP8.
   ``max_rel_diff_between_layouts``: the largest relative difference of the step loss between two layouts;
   ``max_grad_rel_diff_between_layouts``: the same over every gradient tensor (reported, not held to the
   tolerance: a tp layout sums the row-parallel partial products in another order, which flips the FP8
   rounding of a few elements of the next cast, amplified by the e5m2 gradients; tests/distributed/test_fp8_ranks.py
   bounds it at 0.06).
2. Training: ``make train``'s model (the tiny Llama preset, bf16 weights, AdamW) in one process for
   ``--steps`` steps of 1,024 tokens, once in bf16 and once in FP8; ``loss_rel_diff_vs_bf16``: the relative
   difference of the mean loss over the last 5 steps.

``tolerance`` (0.03) bounds both ``max_rel_diff_between_layouts`` and ``loss_rel_diff_vs_bf16``
(``within_tolerance``). ``scaled_mm_calls`` counts ``aten._scaled_mm`` under a TorchDispatchMode (both parts).
The last line printed is ONE JSON object.

    python recipes/benchmark_fp8.py                       # tensorwise, 30 steps, every layout case
    python recipes/benchmark_fp8.py --recipe rowwise
    python recipes/benchmark_fp8.py --smoke               # 3 layout cases, 3 steps
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # a checkout works without installing

import torch  # noqa: E402

from lightning_hotspa.parallel.fp8 import FP8_RECIPES, install_fp8  # noqa: E402
from lightning_hotspa.testing.spawn import run_on_ranks  # noqa: E402
from lightning_hotspa.tools.fp8_layouts import CASES, run_fp8_layouts, scaled_mm_counter  # noqa: E402

TOLERANCE = 0.03
SMOKE_CASES = ("dp2", "tp2-sp", "dp2:fsdp")


def train(recipe: str | None, steps: int) -> tuple[list[float], int]:
    """``make train``'s tiny Llama in bf16, FP8 where ``recipe``: the per-step losses and _scaled_mm calls."""
    from lightning_hotspa.models import Llama, LlamaConfig

    torch.manual_seed(0)
    model = Llama(LlamaConfig.preset("tiny")).to(torch.bfloat16)
    if recipe is not None:
        install_fp8(model, recipe)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(0, 256, (1024,), generator=g) for _ in range(4)]  # revisited: the loss falls
    losses, calls = [], 0
    for step in range(steps):
        ids = batches[step % len(batches)]
        docs = torch.tensor([0, 300, 700, 1024])
        pos = torch.cat([torch.arange(int(b - a)) for a, b in zip(docs[:-1], docs[1:], strict=True)])
        labels = torch.roll(ids, -1)
        labels[docs[1:] - 1] = -100
        with scaled_mm_counter() as n:
            loss = model(ids, pos, docs.to(torch.int32), 400, labels=labels)
            loss.backward()
        calls += n["calls"]
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses, calls


def main(argv: list[str] | None = None) -> dict:
    """Runs both parts, prints a summary and the JSON line; returns the JSON object."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="tensorwise", choices=FP8_RECIPES)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--smoke", action="store_true", help="3 layout cases, 3 training steps")
    args = parser.parse_args(argv)
    steps = 3 if args.smoke else args.steps
    cases = SMOKE_CASES if args.smoke else tuple(c for c in CASES if c != "tp2-no-reduce")
    start = time.perf_counter()
    layouts = run_on_ranks(run_fp8_layouts, 2, args.recipe, cases=cases, timeout_s=600)[0]
    losses = [r["loss"] for r in layouts["cases"].values()]
    between = max(abs(a - b) / abs(b) for a in losses for b in losses)
    bf16, _ = train(None, steps)
    fp8, calls = train(args.recipe, steps)
    tail = min(5, steps)
    ref, got = sum(bf16[-tail:]) / tail, sum(fp8[-tail:]) / tail
    out = {"recipe": args.recipe, "fp8_linears": layouts["fp8_linears"],
           "scaled_mm_calls": layouts["scaled_mm_calls"] + calls, "layouts_run": layouts["layouts_run"],
           "cases": sorted(layouts["cases"]), "max_rel_diff_between_layouts": between,
           "max_grad_rel_diff_between_layouts": layouts["between"],
           "max_loss_rel_diff_vs_single_process": max(r["loss_err"] for r in layouts["cases"].values()),
           "loss_rel_diff_vs_bf16": abs(got - ref) / ref, "train_steps": steps,
           "bf16_first_last": [bf16[0], bf16[-1]], "fp8_first_last": [fp8[0], fp8[-1]],
           "tolerance": TOLERANCE, "seconds": round(time.perf_counter() - start, 1)}
    out["within_tolerance"] = out["max_rel_diff_between_layouts"] <= TOLERANCE and \
        out["loss_rel_diff_vs_bf16"] <= TOLERANCE
    for case, r in sorted(layouts["cases"].items()):
        print(f"{case:10s} loss {r['loss']:.6f}  vs single process: loss {r['loss_err']:.2e}, "
              f"worst gradient {r['max_grad_err']:.2e} ({r['worst']})")
    print(f"training {steps} steps: bf16 {bf16[0]:.4f} -> {bf16[-1]:.4f}, {args.recipe} {fp8[0]:.4f} -> {fp8[-1]:.4f}")
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
