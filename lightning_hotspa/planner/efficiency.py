"""Kernel efficiencies as functions of shape: GEMMs by model width, attention by kernel family and head dim.

GEMM efficiency follows a saturating (roofline-like) curve in the model width ``h``:
``e(h) = e_max * h / (h + h_half)``, so ``1 / e(h) = (1 + h_half / h) / e_max`` is LINEAR in its two
unknowns and is fitted by least squares (``recipes/benchmark_published.py``). Narrow GEMMs (1B-2B
models) reach less of the peak than wide ones (70B), which one constant cannot say. ``h_half`` 0
gives a constant ``e_max`` (the cpu-gloo profile, calibrated by measurement, keeps that).

Attention efficiency is kept per (kernel family, head dim); a family or head dim with no entry
takes the nearest head dim of that family, else the profile's ``attention_efficiency``.
"""

from __future__ import annotations

__all__ = ["attention_efficiency", "check_attention_table", "gemm_efficiency"]


def gemm_efficiency(e_max: float, h_half: float, width: float) -> float:
    """Fraction of peak a dense GEMM of model width ``width`` reaches: ``e_max * w / (w + h_half)``."""
    if h_half <= 0:
        return e_max
    return e_max * width / (width + h_half)


def attention_efficiency(table: tuple[tuple[str, int, float], ...], default: float, kernel: str,
                         head_dim: int) -> float:
    """The (kernel, head dim) entry of ``table``; else the same kernel's nearest head dim; else ``default``."""
    same = [(abs(hd - head_dim), eff) for k, hd, eff in table if k == kernel]
    return min(same)[1] if same else default


def check_attention_table(profile: str, value: object) -> tuple[tuple[str, int, float], ...]:
    """((kernel, head_dim, efficiency), ...) validated, with a clear error naming the bad entry."""
    from .runtime_profile import ATTENTION_KERNELS

    try:
        rows = tuple((k, hd, e) for k, hd, e in value)  # type: ignore[union-attr]
    except (TypeError, ValueError):
        raise ValueError(f"HardwareProfile {profile!r}: attention_kernels must be (kernel, head_dim, "
                         f"efficiency) triples, got {value!r}") from None
    for k, hd, e in rows:
        if k not in ATTENTION_KERNELS:
            raise ValueError(f"HardwareProfile {profile!r}: attention kernel {k!r} is not one of {ATTENTION_KERNELS}")
        if isinstance(hd, bool) or not isinstance(hd, int) or hd < 1:
            raise ValueError(f"HardwareProfile {profile!r}: attention head_dim must be an int >= 1, got {hd!r}")
        if isinstance(e, bool) or not isinstance(e, (int, float)) or not 0 < e <= 1:
            raise ValueError(f"HardwareProfile {profile!r}: attention efficiency of {k!r} at head dim {hd} must "
                             f"be in (0, 1], got {e!r}")
    keys = [(k, hd) for k, hd, _ in rows]
    if len(set(keys)) != len(keys):
        raise ValueError(f"HardwareProfile {profile!r}: attention_kernels repeats an entry: {keys}")
    return tuple((str(k), int(hd), float(e)) for k, hd, e in rows)
