"""Fits a GPU's GEMM-width curve and attention efficiency to published runs (issue 30).

Per GPU, a run's predicted step is ``D1 * (1/e_max + (h_half/e_max) / h) + A1 / e_attn + O``: its
GEMM seconds at 100 % of peak ``D1`` over the width curve of :mod:`.efficiency`, its attention
seconds at 100 % ``A1`` over the attention efficiency of the runtime's kernel, and ``O`` the
rest (exposed communication, per-layer overheads) as the cost model prices it with the SOURCE
system's runtime. That is linear in ``x = (1/e_max, h_half/e_max, 1/e_attn)``; least squares on
the relative error ``step / measured - 1`` over the FIT rows gives ``x``. ``O`` depends on the GEMM
time through the overlap credit, so the fit re-prices and solves again (a few fixed-point passes).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .cost_model import AnalyticCostModel
from .hardware import HardwareProfile, get_profile
from .published_pricing import PricedRun, at_precision, price_run
from .published_runs import PublishedRun
from .runtime_profile import get_runtime

__all__ = ["FitResult", "Fp8AttentionFit", "fit_fp8_and_attention", "fit_profile", "measured_step_s", "with_constants"]


def measured_step_s(run: PublishedRun) -> float:
    """The step seconds the published tokens/s/GPU imply for the run's stated batch."""
    return run.dp * run.grad_accum * run.micro_batch * run.seq_len / (run.tokens_per_s_per_gpu * run.world)


def with_constants(profile: HardwareProfile, e_max: float, h_half: float, attn: float, kernel: str,
                   head_dim: int, note: str = "") -> HardwareProfile:
    """``profile`` with the GEMM curve and one attention (kernel, head dim) entry set."""
    kept = tuple(e for e in profile.attention_kernels if (e[0], e[1]) != (kernel, head_dim))
    table = kept + ((kernel, head_dim, attn),)
    return dataclasses.replace(profile, dense_efficiency=e_max, gemm_half_width=h_half, attention_kernels=table,
                               source=profile.source + note)


@dataclass(frozen=True)
class FitResult:
    """The fitted constants of one GPU and the rows' inputs and residuals (``rows``: id, width h,
    D1, A1, O, measured step, fitted step, residual = fitted / measured - 1)."""

    gpu: str
    e_max: float
    h_half: float
    attention: float
    kernel: str
    head_dim: int
    rows: tuple[dict, ...]


def _priced_on(model_for: Callable[[PublishedRun, HardwareProfile], AnalyticCostModel], profile: HardwareProfile,
               run: PublishedRun) -> AnalyticCostModel:
    """``model_for(run, profile)``: the cost model of a run on a candidate profile."""
    return model_for(run, profile)


def fit_profile(gpu: str, runs: Sequence[PublishedRun], model_for: Callable[[PublishedRun, HardwareProfile],
                AnalyticCostModel], passes: int = 4) -> FitResult:
    """Fits ``gpu``'s GEMM curve and attention efficiency on ``runs`` (all on that GPU, one kernel
    family and head dim), starting from the profile as written."""
    profile = get_profile(gpu)
    kernels = {model_for(r, profile).runtime.attention_kernel for r in runs}
    dims = {model_for(r, profile).model.head_dim for r in runs}
    if len(kernels) != 1 or len(dims) != 1:
        raise ValueError(f"fit_profile({gpu!r}): the fit rows mix attention kernels {kernels} / head dims {dims}; "
                         f"fit one (kernel, head dim) at a time")
    kernel, head_dim = kernels.pop(), dims.pop()
    e_max, h_half = profile.dense_efficiency, profile.gemm_half_width
    attn = profile.attention_efficiency_for(kernel, head_dim)
    for _ in range(passes):
        current = with_constants(profile, e_max, h_half, attn, kernel, head_dim)
        priced = [price_run(r, functools.partial(_priced_on, model_for, current)) for r in runs]
        mat, rhs, info = [], [], []
        for p in priced:
            h = model_for(p.run, current).model.hidden
            d1 = p.dense_s * current.gemm_efficiency(h)
            a1 = p.attention_s * attn
            t = measured_step_s(p.run)
            mat.append([d1 / t, d1 / (h * t), a1 / t])
            rhs.append(1.0 - p.other_s / t)
            info.append((p, h, d1, a1, t))
        x, *_ = np.linalg.lstsq(np.asarray(mat), np.asarray(rhs), rcond=None)
        if min(x[0], x[2]) <= 0:
            raise ValueError(f"fit_profile({gpu!r}): the fit is not physical (x = {x}); more or other rows needed")
        e_max, h_half, attn = 1.0 / x[0], max(0.0, x[1] / x[0]), min(1.0, 1.0 / x[2])
    rows = []
    for p, h, d1, a1, t in info:
        fitted = d1 * (1.0 / e_max) * (1 + h_half / h) + a1 / attn + p.other_s
        rows.append({"id": p.run.id, "h": h, "D1_s": d1, "A1_s": a1, "O_s": p.other_s, "measured_s": t,
                     "fitted_s": fitted, "residual": fitted / t - 1.0})
    return FitResult(gpu, float(e_max), float(h_half), float(attn), kernel, head_dim, tuple(rows))


def price_all(runs: Sequence[PublishedRun], model_for: Callable[[PublishedRun], AnalyticCostModel]) -> list[PricedRun]:
    """Every run priced with ``model_for``."""
    return [price_run(r, model_for) for r in runs]


@dataclass(frozen=True)
class Fp8AttentionFit:
    """One runtime's FP8 GEMM speed-up and one GPU's attention efficiency for its kernel, fitted together
    (``rows`` as :class:`FitResult`'s, with ``D1_s`` the GEMM seconds at the bf16 rate)."""

    system: str
    gpu: str
    fp8_gemm_speedup: float
    attention: float
    kernel: str
    head_dim: int
    rows: tuple[dict, ...]


def fit_fp8_and_attention(runs: Sequence[PublishedRun], model_for: Callable[[PublishedRun, HardwareProfile],
                          AnalyticCostModel]) -> Fp8AttentionFit:
    """Fits, on FP8 ``runs`` of one system on one GPU (one attention kernel and head dim, no sharded
    working copy), the system's FP8 GEMM speed-up ``s`` and the GPU's attention efficiency ``e`` of that
    kernel: a row's step is ``D1 / s + A1 / e + O`` (``D1``: its GEMM seconds at the bf16 rate, ``A1``:
    its attention seconds at 100 %, ``O``: the rest, which neither moves), least squares on the relative
    error ``step / measured - 1``. For a source that publishes FP8 rows only (no bf16 twin)."""
    systems, gpus = {r.system for r in runs}, {r.gpu for r in runs}
    if len(systems) != 1 or len(gpus) != 1 or any(r.precision != "fp8" or r.sharding != "none" for r in runs):
        raise ValueError(f"fit_fp8_and_attention: the rows must be FP8, unsharded, of one system on one GPU; got "
                         f"systems {systems}, GPUs {gpus}")
    profile, runtime = get_profile(gpus.pop()), get_runtime(systems.pop())
    bf16_rate = at_precision(profile, runtime, "fp8", 1.0)
    kernel = runtime.attention_kernel
    dims = {model_for(r, bf16_rate).model.head_dim for r in runs}
    if len(dims) != 1:
        raise ValueError(f"fit_fp8_and_attention: the rows mix head dims {dims}")
    head_dim = dims.pop()
    e_now = profile.attention_efficiency_for(kernel, head_dim)
    mat, rhs, info = [], [], []
    for r in runs:
        p = price_run(r, functools.partial(_priced_on, model_for, bf16_rate))
        d1, a1, t = p.dense_s, p.attention_s * e_now, measured_step_s(r)
        mat.append([d1 / t, a1 / t])
        rhs.append(1.0 - p.other_s / t)
        info.append((p, d1, a1, t))
    x, *_ = np.linalg.lstsq(np.asarray(mat), np.asarray(rhs), rcond=None)
    if min(x) <= 0:
        raise ValueError(f"fit_fp8_and_attention: the fit is not physical (x = {x}); more or other rows needed")
    s, e = 1.0 / x[0], min(1.0, 1.0 / x[1])
    rows = tuple({"id": p.run.id, "D1_s": d1, "A1_s": a1, "O_s": p.other_s, "measured_s": t,
                  "fitted_s": d1 / s + a1 / e + p.other_s, "residual": (d1 / s + a1 / e + p.other_s) / t - 1.0}
                 for p, d1, a1, t in info)
    return Fp8AttentionFit(runtime.name, profile.name, float(s), float(e), kernel, head_dim, rows)
