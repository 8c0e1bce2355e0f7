"""Kernel efficiencies as functions of shape: GEMMs by model width, attention by kernel family and head dim.

GEMM efficiency follows a saturating (roofline-like) curve in the model width ``h``:
``e(h) = e_max * h / (h + h_half)``, so ``1 / e(h) = (1 + h_half / h) / e_max`` is LINEAR in its two
unknowns and is fitted by least squares (``recipes/benchmark_published.py``). Narrow GEMMs (1B-2B
models) reach less of the peak than wide ones (70B), which one constant cannot say. ``h_half`` 0
gives a constant ``e_max`` (the cpu-gloo profile, calibrated by measurement, keeps that).

Attention efficiency is kept per (kernel family, head dim); a family or head dim with no entry
takes the nearest head dim of that family, else the profile's ``attention_efficiency``. It also
depends on how many query rows one call holds: a kernel benchmark's rate rises with the sequence
length and flattens (the FA3 paper's H100 curves, 512 to 16K tokens). The same saturating form,
``e(r) = e_inf * r / (r + r_half)`` per call of ``r`` query rows, makes a document of ``s`` tokens
cost ``(s^2 + r_half * s * s / r) / e_inf`` at the FLOP rate of ``e_inf``: a LINEAR term beside the
quadratic one (:func:`attention_half_length`, one ``r_half`` per kernel family; ``cost_model.py``
prices it with ``r = s / cp_kv``, the rows a rank's call holds once the KV-gather part splits them).

An UNFUSED attention (:data:`UNFUSED_KERNELS`: the score matrix materialized in memory, as
Megatron-LM's 2022 core attention) is not a fraction of peak: it computes the whole square (no
causal skipping) as batched GEMMs and moves every score element through HBM several times, so
:func:`unfused_attention_seconds` prices its FLOPs at the GEMM ceiling plus those bytes at the
device's memory bandwidth (a roofline sum; no fitted constant).
"""

from __future__ import annotations

from ...models.attention_kernels import KERNELS

__all__ = ["UNFUSED_KERNELS", "UNFUSED_SCORE_BYTES", "attention_efficiency", "attention_half_length",
           "check_attention_table", "check_half_length_table", "gemm_efficiency", "unfused_attention_seconds"]

#: kernel families that materialize the score matrix (priced by :func:`unfused_attention_seconds`)
UNFUSED_KERNELS = tuple(k.name for k in KERNELS.values() if k.priced_by_flops)

#: bytes moved through HBM per score element per head, forward + backward, by the unfused sequence
#: baddbmm -> fused scale-mask-softmax -> dropout -> bmm (bf16 scores, a 1-byte dropout mask):
#: forward 13 (write S 2; softmax read S, write P 4; dropout read P, write P' and mask 5; bmm read
#: P' 2), backward 19 (write dP' 2; dV reads P' 2; dropout backward 5; softmax backward reads P and
#: dP, writes dS 6; dQ and dK each read dS 4). A count of the kernels' operands, not a measurement.
UNFUSED_SCORE_BYTES = 32.0


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


def attention_half_length(table: tuple[tuple[str, float], ...], default: float, kernel: str) -> float:
    """Query rows per call at which ``kernel`` reaches half its long-sequence efficiency: its entry of
    ``table`` ((kernel, rows), ...), else ``default``."""
    return next((rows for k, rows in table if k == kernel), default)


def check_half_length_table(profile: str, value: object) -> tuple[tuple[str, float], ...]:
    """((kernel, half_length_rows), ...) validated, with a clear error naming the bad entry."""
    from .runtime_profile import ATTENTION_KERNELS

    try:
        rows = tuple((k, r) for k, r in value)  # type: ignore[union-attr]
    except (TypeError, ValueError):
        raise ValueError(f"HardwareProfile {profile!r}: attention_half_lengths must be (kernel, rows) pairs, "
                         f"got {value!r}") from None
    for k, r in rows:
        if k not in ATTENTION_KERNELS or k in UNFUSED_KERNELS:
            raise ValueError(f"HardwareProfile {profile!r}: attention_half_lengths names {k!r}, not a fused kernel "
                             f"of {tuple(x for x in ATTENTION_KERNELS if x not in UNFUSED_KERNELS)}")
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 <= r < float("inf"):
            raise ValueError(f"HardwareProfile {profile!r}: attention half length of {k!r} must be a finite "
                             f"number of rows >= 0, got {r!r}")
    kernels = [k for k, _ in rows]
    if len(set(kernels)) != len(kernels):
        raise ValueError(f"HardwareProfile {profile!r}: attention_half_lengths repeats a kernel: {kernels}")
    return tuple((str(k), float(r)) for k, r in rows)


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
        if k in UNFUSED_KERNELS:
            raise ValueError(f"HardwareProfile {profile!r}: attention kernel {k!r} takes no efficiency: it is priced "
                             f"by its FLOPs and score bytes (unfused_attention_seconds, hbm_bandwidth)")
        if isinstance(hd, bool) or not isinstance(hd, int) or hd < 1:
            raise ValueError(f"HardwareProfile {profile!r}: attention head_dim must be an int >= 1, got {hd!r}")
        if isinstance(e, bool) or not isinstance(e, (int, float)) or not 0 < e <= 1:
            raise ValueError(f"HardwareProfile {profile!r}: attention efficiency of {k!r} at head dim {hd} must "
                             f"be in (0, 1], got {e!r}")
    keys = [(k, hd) for k, hd, _ in rows]
    if len(set(keys)) != len(keys):
        raise ValueError(f"HardwareProfile {profile!r}: attention_kernels repeats an entry: {keys}")
    return tuple((str(k), int(hd), float(e)) for k, hd, e in rows)


def unfused_attention_seconds(layers: int, heads: float, head_dim: int, peak_flops: float, gemm_ceiling: float,
                              hbm_bandwidth: float) -> float:
    """Seconds per squared document length of an unfused attention's forward + backward on one rank.

    Args: ``layers``; ``heads`` (attention heads on the rank, after tp / cp); ``head_dim``;
    ``peak_flops``; ``gemm_ceiling`` (the GEMM curve's ``e_max``: the batched score GEMMs run at
    most there); ``hbm_bandwidth`` (bytes/s). FLOPs: the full square, ``12 s^2 head_dim`` per head
    (forward 4, backward 8); bytes: :data:`UNFUSED_SCORE_BYTES` per score element per head."""
    if hbm_bandwidth <= 0:
        raise ValueError("an unfused attention is priced by memory bandwidth: the hardware profile has no "
                         f"hbm_bandwidth (got {hbm_bandwidth!r})")
    flops = 12.0 * layers * heads * head_dim / (peak_flops * gemm_ceiling)
    return flops + UNFUSED_SCORE_BYTES * layers * heads / hbm_bandwidth
