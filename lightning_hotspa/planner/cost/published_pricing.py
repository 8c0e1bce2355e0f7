"""Prices a published run (:mod:`.published_runs`) through the planner's own path.

A run's step is one stage of its layout: every dp group runs ``grad_accum`` micro-batches of
``micro_batch`` sequences of ``seq_len`` tokens, priced by :meth:`AnalyticCostModel.option` and
:meth:`OptionCost.stage_seconds` (lockstep rounds for a sharded copy, as the planner prices them),
plus the stage's gradient reduction. The capacity is the source's own micro-batch; whether it would
fit OUR runtime's memory is reported beside it (``fits_ours``).

Two terms the planner does not price are added here, both from the SOURCE runtime's description
(:mod:`.runtime_profile`): what its "selective" checkpointing recomputes (:func:`selective_extra`),
and its optimizer step, ``optimizer_bytes_per_param`` x the parameters a rank holds at the
device's HBM bandwidth (:func:`optimizer_seconds`; the published figures are end-to-end steps, and
a small global batch, as Megatron's 22B run of 4 sequences, pays it over few tokens). The planner
leaves the optimizer out because it is the same for every plan of a step.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ...layout import Layout
from .cost_model import AnalyticCostModel
from .hardware import HardwareProfile, get_profile
from .published_runs import PublishedRun
from .runtime_profile import RuntimeProfile, get_runtime

__all__ = ["PricedRun", "at_precision", "attention_bands", "between_layout_error", "compiled", "derive_fp8_speedup",
           "derive_rate",
           "guard_margin_from", "layout_key", "optimizer_seconds", "price_run", "selective_extra", "source_model",
           "summarize"]

#: attention share bands for ``by_attention_share`` (the issue's "attention-heavy": share > 0.5)
attention_bands = ((0.0, 0.25), (0.25, 0.5), (0.5, 1.0))


@dataclass(frozen=True)
class PricedRun:
    """One run's prediction: ``predicted`` tokens/s/GPU; the step's seconds split into ``dense_s``
    (GEMMs), ``attention_s`` and ``other_s`` (exposed communication, overheads) per micro-batch
    round of one dp group; ``fits_ours``: OUR memory model holds its micro-batch."""

    run: PublishedRun
    predicted: float
    step_s: float
    dense_s: float
    attention_s: float
    other_s: float
    fits_ours: bool

    @property
    def ratio(self) -> float:
        return self.predicted / self.run.tokens_per_s_per_gpu

    @property
    def attention_share(self) -> float:
        return self.attention_s / self.step_s


def parallelism_of(run: PublishedRun) -> Layout:
    """The run's layout as the cost model's :class:`Layout` (ZeRO-2 priced as a sharded copy)."""
    return Layout(dp=run.dp, tp=run.tp, cp=run.cp, pp=run.pp, fsdp=run.sharding != "none", cp_kv=run.cp_kv)


def at_precision(profile: HardwareProfile, runtime: RuntimeProfile, precision: str,
                 speedup: float | None = None, recipe: str = "") -> HardwareProfile:
    """``profile`` with its GEMM ceiling raised by the runtime's FP8 rate (``fp8_gemm_speedup``, or its rate
    for the torchao ``recipe``; or ``speedup``) for an ``"fp8"`` row, unchanged for ``"bf16"``. Only the
    GEMMs: attention, communication and the optimizer step are priced as before."""
    if precision == "bf16":
        return profile
    if precision != "fp8":
        raise ValueError(f"published run precision must be 'bf16' or 'fp8', got {precision!r}")
    s = runtime.fp8_rate(recipe) if speedup is None else speedup
    return dataclasses.replace(profile, dense_efficiency=profile.dense_efficiency * s,
                               source=profile.source + f" [fp8 linears: GEMM rate x {s:.3f}]")


def compiled(profile: HardwareProfile, runtime: RuntimeProfile, speedup: float | None = None) -> HardwareProfile:
    """``profile`` as a torch.compile'd run of ``runtime`` sees it: its GEMM-side rate x the runtime's
    ``compile_speedup`` (or ``speedup``). Attention kernels, communication and the optimizer are unchanged
    (inductor fuses the elementwise work around the GEMMs, not the attention kernel)."""
    s = runtime.compile_speedup if speedup is None else speedup
    if not s:
        raise ValueError(f"runtime {runtime.name!r} states no compile_speedup: its compiled runs cannot be priced")
    return dataclasses.replace(profile, dense_efficiency=profile.dense_efficiency * s,
                               source=profile.source + f" [compiled: GEMM-side rate x {s:.3f}]")


def source_model(run: PublishedRun, profile: HardwareProfile | str | None = None) -> AnalyticCostModel:
    """The cost model the planner would build for ``run``'s GPU and world with its SOURCE system's runtime (an
    FP8 row's linears at its runtime's FP8 rate for its recipe, a compiled row's GEMM side at its runtime's
    ``compile_speedup``, unless ``profile`` already says that rate): how the published-runs benchmark and
    ``recipes/benchmark_peers.py``'s ``peer_model_ratio`` price a peer's row."""
    prof = get_profile(run.gpu if profile is None else profile)
    if run.precision == "fp8" and "fp8 linears" not in prof.source:
        prof = at_precision(prof, get_runtime(run.system), "fp8", recipe=run.fp8_recipe)
    if run.compiled and "[compiled" not in prof.source:
        prof = compiled(prof, get_runtime(run.system))
    return AnalyticCostModel(run.model, prof, run.world, runtime=run.system, pipeline=run.pipeline)


def derive_rate(base_run: PublishedRun, run: PublishedRun, model_for: Callable[..., AnalyticCostModel],
                apply: Callable[[HardwareProfile, float], HardwareProfile]) -> float:
    """The rate ``s`` under which the predicted ``run / base_run`` throughput ratio equals the published
    one (one configuration with and without one feature): ``apply(profile, s)`` prices ``run`` with the
    feature at rate ``s``; bisection on ``s`` in [1, 4]. ``model_for(run, profile)`` builds a run's model."""
    want = run.tokens_per_s_per_gpu / base_run.tokens_per_s_per_gpu
    base = price_run(base_run, lambda r: model_for(r, get_profile(r.gpu))).predicted

    def ratio(s: float) -> float:
        return price_run(run, lambda r: model_for(r, apply(get_profile(r.gpu), s))).predicted / base

    lo, hi = 1.0, 4.0
    if not ratio(lo) <= want <= ratio(hi):
        raise ValueError(f"derive_rate: the published ratio {want:.3f} of {run.id!r} / {base_run.id!r} "
                         f"is outside what a rate in [1, 4] gives ({ratio(lo):.3f}..{ratio(hi):.3f})")
    for _ in range(50):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if ratio(mid) < want else (lo, mid)
    return 0.5 * (lo + hi)


def derive_fp8_speedup(bf16_run: PublishedRun, fp8_run: PublishedRun,
                       model_for: Callable[..., AnalyticCostModel]) -> float:
    """The GEMM speed-up ``s`` under which the predicted ``fp8_run / bf16_run`` throughput ratio equals the
    published one (one configuration in both precisions; :func:`derive_rate`)."""
    rt = get_runtime(fp8_run.system)
    return derive_rate(bf16_run, fp8_run, model_for, lambda prof, s: at_precision(prof, rt, "fp8", s))


def price_run(run: PublishedRun, model_for: Callable[[PublishedRun], AnalyticCostModel]) -> PricedRun:
    """Predicted tokens/s/GPU of ``run`` with the cost model ``model_for(run)`` builds."""
    cm = model_for(run)
    par, ac = parallelism_of(run), run.checkpointing == "full"
    tokens = run.micro_batch * run.seq_len
    opt = cm.option(par, ac, capacity=tokens)
    doc = opt.doc_seconds(opt.padded([run.seq_len] * run.micro_batch))
    groups = [[list(range(run.micro_batch))] * run.grad_accum] * run.dp
    step = opt.stage_seconds(doc, groups) + opt.stage_fixed
    dense = cm._dense_seconds_per_token(par, ac) * tokens * run.grad_accum
    padded = np.asarray(opt.padded([run.seq_len] * run.micro_batch), float)
    attention = opt.quadratic * float(np.sum(padded ** 2 + padded)) + opt.attention_linear * float(np.sum(padded))
    attention *= run.grad_accum
    extra_dense, extra_attention = selective_extra(run, cm, dense, attention)
    dense, attention = dense + extra_dense, attention + extra_attention
    step += extra_dense + extra_attention + optimizer_seconds(run, cm)
    predicted = run.dp * run.grad_accum * tokens / (step * run.world)
    fits = cm.capacity(par, ac) >= tokens
    return PricedRun(run, predicted, step, dense, attention, step - dense - attention, fits)


def selective_extra(
    run: PublishedRun, cm: AnalyticCostModel, dense_s: float, attention_s: float
) -> tuple[float, float]:
    """(GEMM, attention) seconds a ``"selective"`` run's recomputation adds, by its runtime's policy:
    ``core-attention`` re-runs the attention forward (1/3 of its forward + backward FLOPs);
    ``every-other-mm`` re-runs the forward of every second matmul of a block (Llama order wq wk wv
    wo w1 w3 w2: wk, wo, w3), priced as that share of the blocks' GEMM seconds ``dense_s`` covers."""
    if run.checkpointing != "selective":
        return 0.0, 0.0
    policy = cm.runtime.selective_recompute
    if policy == "core-attention":
        return 0.0, attention_s / 3.0
    if policy == "every-other-mm":
        m = cm.model
        recomputed = m.hidden * cm.kv_width + cm.attn_width * m.hidden + m.hidden * m.ffn_hidden
        return dense_s * (2.0 * recomputed * m.n_layers) / (6.0 * cm.dense_params), 0.0
    raise ValueError(f"published run {run.id!r} uses selective checkpointing, but runtime "
                     f"{cm.runtime.name!r} describes none (selective_recompute={policy!r})")


def optimizer_seconds(run: PublishedRun, cm: AnalyticCostModel) -> float:
    """Seconds of the run's optimizer step: the runtime's ``optimizer_bytes_per_param`` over the
    parameters a rank holds (split by tp and pp, and by dp when the state is sharded) at the
    hardware's ``hbm_bandwidth``."""
    per_param = cm.runtime.optimizer_bytes_per_param
    if per_param == 0:
        return 0.0
    if cm.hardware.hbm_bandwidth <= 0:
        raise ValueError(f"published run {run.id!r}: {cm.hardware.name} has no hbm_bandwidth to price "
                         f"{cm.runtime.name!r}'s optimizer step")
    shards = run.tp * run.pp * (run.dp * run.cp if run.sharding != "none" else 1)
    return cm.params / shards * per_param / cm.hardware.hbm_bandwidth


def _geomean(ratios: Sequence[float]) -> float:
    return math.exp(sum(math.log(r) for r in ratios) / len(ratios)) if ratios else float("nan")


def summarize(priced: Sequence[PricedRun], held_out: set[str] | None = None) -> dict:
    """The recipe's statistics over ``priced`` (held-out rows only when ``held_out`` is given)."""
    rows = [p for p in priced if held_out is None or p.run.id in held_out]
    logs = [abs(math.log(p.ratio)) for p in rows]
    bands = {}
    for lo, hi in attention_bands:
        band = [p.ratio for p in rows if lo < p.attention_share <= hi or (lo == 0 and p.attention_share == 0)]
        bands[f"({lo}, {hi}]"] = {"rows": len(band), "geomean_ratio": _geomean(band)}
    return {"count": len(rows), "geomean_ratio": _geomean([p.ratio for p in rows]),
            "max_abs_log_ratio": max(logs) if logs else float("nan"), "by_attention_share": bands}


def layout_key(run: PublishedRun) -> tuple:
    """What makes two rows of one model on one GPU different layouts: world, dp, tp, cp (and its kind),
    pp and the working copy's sharding (not the batch, the sequence length or the precision)."""
    return (run.world, run.dp, run.tp, run.cp, run.cp_kv, run.pp, run.sharding)


def between_layout_error(priced: Sequence[PricedRun]) -> dict:
    """The error BETWEEN two layouts' predictions: for every pair of rows with the same source (the
    citation before its first comma: one document), model and GPU and different :func:`layout_key`,
    ``|ln(pred_a / pub_a) - ln(pred_b / pub_b)|``; its ``mean``, ``p90`` (linear interpolation),
    ``max`` and the number of ``pairs`` (and the worst pair's ids)."""
    def doc(p: PricedRun) -> str:
        return p.run.source.split(",")[0]

    def model(p: PricedRun) -> str:
        return p.run.model if isinstance(p.run.model, str) else repr(p.run.model)

    diffs, worst = [], ("", "")
    for i, a in enumerate(priced):
        for b in priced[i + 1:]:
            if (doc(a), model(a), a.run.gpu) != (doc(b), model(b), b.run.gpu) or layout_key(a.run) == layout_key(b.run):
                continue
            d = abs(math.log(a.ratio) - math.log(b.ratio))
            if not diffs or d > max(diffs):
                worst = (a.run.id, b.run.id)
            diffs.append(d)
    if not diffs:
        return {"pairs": 0, "mean": float("nan"), "p90": float("nan"), "max": float("nan"), "worst_pair": []}
    return {"pairs": len(diffs), "mean": float(np.mean(diffs)), "p90": float(np.percentile(diffs, 90)),
            "max": float(max(diffs)), "worst_pair": list(worst)}


def guard_margin_from(held_out_stats: dict) -> float:
    """The never-worse-than-static guard's default margin (docs/cost-model.md's rule): the mean
    between-layout log error over HELD-OUT pairs (:func:`between_layout_error` of the rows no fitted
    constant saw) as a relative gain, ``exp(mean) - 1``, rounded to 3 decimals. A multi-layout plan must
    be predicted faster than the best static one by more than two layouts' typical relative error on
    unseen runs, the rule the old margin applied to the absolute held-out error."""
    if not held_out_stats.get("pairs"):
        raise ValueError("guard_margin_from: no layout pairs to derive a margin from")
    return round(math.exp(held_out_stats["mean"]) - 1.0, 3)
