"""Rotary position embeddings driven by explicit ``position_ids``.

Packed inputs hold several documents in one row, so positions cannot be ``arange(T)``: they
restart at every document boundary and are passed in. Nothing is cached, so the model has no
buffers to materialize after meta-device construction, and the cost (a [T, head_dim] table)
is small next to the projections.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

__all__ = ["rotary_cos_sin", "apply_rotary", "position_ids_from_cu_seqlens", "llama3_scaled"]


def llama3_scaled(inv_freq: Tensor, scaling: Any) -> Tensor:
    """Llama-3.1 frequency scaling: long wavelengths slowed by ``factor``, short ones kept, a smooth
    blend in between (the published rule; Hugging Face ``rope_type: "llama3"``)."""
    old = scaling.original_max_position_embeddings
    low, high, factor = scaling.low_freq_factor, scaling.high_freq_factor, scaling.factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old / low, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old / high) & (wavelen <= old / low)
    return torch.where(medium, blended, scaled)


def rotary_cos_sin(
    position_ids: Tensor, head_dim: int, theta: float, dtype: torch.dtype, scaling: Any = None
) -> tuple[Tensor, Tensor]:
    """cos and sin tables of shape [T, head_dim] (the two halves repeat), computed in fp32 (fp64 for fp64).

    ``scaling``: a :class:`~lightning_hotspa.models.config.Llama3RopeScaling` or None.
    """
    work = torch.float64 if dtype == torch.float64 else torch.float32
    exponent = torch.arange(0, head_dim, 2, device=position_ids.device, dtype=work)
    inv_freq = theta ** (-exponent / head_dim)
    if scaling is not None:
        inv_freq = llama3_scaled(inv_freq, scaling)
    angles = position_ids.to(work)[:, None] * inv_freq[None, :]
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` [T, heads, head_dim] (half-split convention); works for any local head count."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def position_ids_from_cu_seqlens(cu_seqlens: Tensor) -> Tensor:
    """Positions 0..len-1 for every document delimited by ``cu_seqlens`` (int64, shape [T])."""
    cu = cu_seqlens.to(torch.int64)
    lengths = cu[1:] - cu[:-1]
    total = int(cu[-1])
    starts = torch.repeat_interleave(cu[:-1], lengths, output_size=total)
    return torch.arange(total, device=cu.device) - starts
