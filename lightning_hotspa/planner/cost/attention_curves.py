"""Published attention-kernel speeds by sequence length, and the half length each implies.

The FA3 paper (Shah et al. 2024, arXiv 2407.08608) times FlashAttention-2, cuDNN and FlashAttention-3 on
one H100 80GB SXM5 at head dim 128 for sequences of 512 to 16K tokens (batch x length 16K, 16 heads):
Figure 5's causal forward and Figure 6's backward, in TFLOP/s, are :data:`FA3_PAPER_H100_HD128`. A
training step runs both; the backward is counted 2.5x the forward's FLOPs, so the combined rate is
``3.5 / (1 / forward + 2.5 / backward)``. :func:`fit_half_length` fits ``e(s) = e_inf * s / (s + s_half)``
to it (``1 / e`` is linear in ``1 / s``: least squares), which the H100-class hardware profiles use as
``attention_half_lengths`` (planner/cost/efficiency.py); tests check the profile against this fit, and
recipes/gpu_check_hopper.py fits the same curve to the kernels' measured speeds on a GPU (:func:`fit_saturating`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

__all__ = ["FA3_PAPER_H100_HD128", "FA3_PAPER_LENGTHS", "HalfLengthFit", "fit_half_length", "fit_saturating",
           "training_rate"]

#: the sequence lengths of the paper's Figures 5 and 6
FA3_PAPER_LENGTHS = (512, 1024, 2048, 4096, 8192, 16384)
#: kernel -> (causal forward TFLOP/s, backward TFLOP/s) at :data:`FA3_PAPER_LENGTHS`, head dim 128, H100 SXM5
FA3_PAPER_H100_HD128: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "fa2": ((191, 260, 298, 319, 333, 335), (214, 260, 291, 310, 318, 322)),
    "cudnn": ((315, 410, 484, 518, 529, 539), (305, 408, 465, 499, 518, 516)),
    "fa3": ((292, 423, 521, 579, 602, 616), (316, 424, 501, 542, 559, 561)),
}


@dataclass(frozen=True)
class HalfLengthFit:
    """One kernel's fitted curve: ``e_inf_tflops`` (its long-sequence rate), ``half_length`` (tokens at half
    of it) and ``max_residual`` (the largest |fitted / published - 1| over the lengths)."""

    kernel: str
    e_inf_tflops: float
    half_length: float
    max_residual: float


def training_rate(forward: float, backward: float) -> float:
    """A forward + backward step's rate from the two passes' rates (backward counted 2.5x the forward FLOPs).

    Args: ``forward``, ``backward``: each pass's TFLOP/s."""
    return 3.5 / (1.0 / forward + 2.5 / backward)


def fit_saturating(kernel: str, lengths: Sequence[float], rates: Sequence[float]) -> HalfLengthFit:
    """``e(s) = e_inf * s / (s + s_half)`` fitted to measured ``rates`` at ``lengths`` (least squares on ``1 / e``).

    Args: ``kernel`` (a label); ``lengths``: tokens per sequence (two or more, distinct); ``rates``: TFLOP/s
    (or any rate unit: ``e_inf_tflops`` comes back in it)."""
    x, y = np.asarray(lengths, dtype=np.float64), np.asarray(rates, dtype=np.float64)
    if x.shape != y.shape or len(set(x.tolist())) < 2 or not (np.all(x > 0) and np.all(y > 0)):
        raise ValueError(f"fit_saturating({kernel!r}) needs two or more distinct positive lengths with a positive "
                         f"rate each, got lengths {list(lengths)} and rates {list(rates)}")
    design = np.stack([np.ones_like(x), 1.0 / x], axis=1)
    (inv_e, slope), *_ = np.linalg.lstsq(design, 1.0 / y, rcond=None)
    e_inf, half = 1.0 / inv_e, slope / inv_e
    fitted = e_inf * x / (x + half)
    return HalfLengthFit(kernel, float(e_inf), float(half), float(np.max(np.abs(fitted / y - 1.0))))


def fit_half_length(kernel: str) -> HalfLengthFit:
    """The saturating curve fitted to ``kernel``'s training rates in :data:`FA3_PAPER_H100_HD128`.

    Args: ``kernel``: ``"fa2"``, ``"cudnn"`` or ``"fa3"``."""
    if kernel not in FA3_PAPER_H100_HD128:
        raise ValueError(f"no published length curve for attention kernel {kernel!r}; known: "
                         f"{sorted(FA3_PAPER_H100_HD128)}")
    fwd, bwd = FA3_PAPER_H100_HD128[kernel]
    return fit_saturating(kernel, FA3_PAPER_LENGTHS, [training_rate(f, b) for f, b in zip(fwd, bwd)])
