"""Seeded weight initialization by tiles: any slice of a parameter can be generated alone.

Scheme ("tiled seeds"): a parameter, seen as a matrix (1-D: one row), is cut into fixed tiles of
``TILE`` = 64 x 64 elements (edge tiles smaller); tile (i, j) is filled by its own CPU generator seeded
from (seed, parameter name, i, j) through a stable hash. CPU ``randn`` cannot produce one slice of a
tensor alone, but a rank can generate just the tiles its shard overlaps: the tiles depend on the
parameter's shape only, never on the world size or the region asked for, so every rank's shard and
the single-process model agree exactly, and one rank's start-up costs its shard's elements (plus
edge tiles), not the full model's. Random init of sharded CPU DTensors is wrong (docs/DESIGN.md §7,
trap "random init of sharded DTensors"), which is why this exists. Values are generated on CPU in
fp32 whatever device the shard goes to.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import torch
from torch import Tensor

from .config import LlamaConfig
from .llama import Llama

__all__ = ["INIT_STD", "TILE", "build_llama", "init_parameter", "init_weights", "parameter_seed"]

INIT_STD = 0.02
_RESIDUAL_OUTPUTS = ("wo", "w2")  # projections that write into the residual stream
TILE = (64, 64)  # rows x columns of one seeded tile (64 divides every shard of the presets at 64 ranks)


def parameter_seed(seed: int, name: str) -> int:
    """A 63-bit seed from (seed, name), stable across processes and Python versions."""
    digest = hashlib.blake2b(f"{int(seed)}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def init_parameter(
    name: str,
    shape: Sequence[int],
    seed: int,
    *,
    n_layers: int,
    dtype: torch.dtype = torch.float32,
    dim: int | None = None,
    start: int = 0,
    stop: int | None = None,
) -> Tensor:
    """The initial value of parameter ``name`` (a name from ``Llama.named_parameters()``), or only
    its slice ``[start, stop)`` along ``dim`` (equal to that slice of the full value).

    Norm weights are ones; linears and the embedding are N(0, 0.02), with the residual output
    projections (wo, w2) scaled by 1/sqrt(2 * n_layers). Generated on CPU in fp32 by tiles (module
    docstring), so the values do not depend on the device the caller will move them to.
    """
    parts = name.split(".")
    if len(parts) < 2 or parts[-1] not in ("weight", "bias"):
        raise ValueError(f"init_parameter: unexpected parameter name {name!r}")
    shape = tuple(int(s) for s in shape)
    region = _region(shape, dim, start, stop)
    if parts[-1] == "bias":  # q / k / v biases (Qwen2-style configs) start at zero
        return torch.zeros(tuple(b - a for a, b in region), dtype=dtype)
    module = parts[-2]
    if module.endswith("norm"):
        return torch.ones(tuple(b - a for a, b in region), dtype=dtype)
    std = INIT_STD / math.sqrt(2 * n_layers) if module in _RESIDUAL_OUTPUTS else INIT_STD
    if len(shape) > 2:  # not in the Llama model: tile the full tensor as a matrix, then slice
        full = _tiled_normal(parameter_seed(seed, name), (math.prod(shape[:-1]), shape[-1]),
                             ((0, math.prod(shape[:-1])), (0, shape[-1])), std).view(shape)
        return full[tuple(slice(a, b) for a, b in region)].contiguous().to(dtype)
    matrix = shape if len(shape) == 2 else (1, shape[0])
    rect = region if len(shape) == 2 else ((0, 1), region[0])
    values = _tiled_normal(parameter_seed(seed, name), matrix, rect, std)
    return values.view(tuple(b - a for a, b in region)).to(dtype)


def _region(shape: tuple[int, ...], dim: int | None, start: int, stop: int | None) -> list[tuple[int, int]]:
    region = [(0, s) for s in shape]
    if dim is None:
        return region
    if not 0 <= dim < len(shape):
        raise ValueError(f"init_parameter: dim {dim} out of range for shape {shape}")
    stop = shape[dim] if stop is None else stop
    if not 0 <= start <= stop <= shape[dim]:
        raise ValueError(f"init_parameter: slice [{start}, {stop}) out of range for dim {dim} of shape {shape}")
    region[dim] = (start, stop)
    return region


def _tiled_normal(base_seed: int, matrix: tuple[int, int], rect: Sequence[tuple[int, int]],
                  std: float) -> Tensor:
    """Rows ``rect[0]`` x columns ``rect[1]`` of the tiled N(0, std) matrix of shape ``matrix``.

    Each tile is drawn into contiguous memory of its own shape (so its values never depend on the
    region asked for); one band of tiles is then copied out at once (per-tile copies cost more)."""
    (r0, r1), (c0, c1) = rect
    tr, tc = TILE
    out = torch.empty(r1 - r0, c1 - c0, dtype=torch.float32)
    if out.numel() == 0:
        return out
    generator = torch.Generator(device="cpu")
    j0, j1 = c0 // tc, -(-c1 // tc)
    for i in range(r0 // tr, -(-r1 // tr)):
        top, bottom = i * tr, min((i + 1) * tr, matrix[0])
        band = torch.empty(j1 - j0, bottom - top, tc)
        for j in range(j0, j1):
            generator.manual_seed(parameter_seed(base_seed, f"{i},{j}"))
            width = min(tc, matrix[1] - j * tc)
            if width == tc:
                band[j - j0].normal_(0.0, std, generator=generator)
            else:  # the edge tile: its own shape
                band[j - j0, :, :width] = torch.empty(bottom - top, width).normal_(0.0, std, generator=generator)
        rows = band.permute(1, 0, 2).reshape(bottom - top, -1)
        a, b = max(top, r0), min(bottom, r1)
        out[a - r0:b - r0] = rows[a - top:b - top, c0 - j0 * tc:c1 - j0 * tc]
    return out


@torch.no_grad()
def init_weights(model: Llama, seed: int) -> Llama:
    """Fill every parameter of ``model`` in place; meta parameters are materialized on CPU first.

    Names are relative to the :class:`Llama` module (``layers.0.attention.wq.weight``), so a
    wrapper must pass the inner model, not itself.
    """
    if any(p.is_meta for p in model.parameters()):
        model.to_empty(device="cpu")
    n_layers = model.config.n_layers
    for name, param in model.named_parameters():
        param.copy_(init_parameter(name, param.shape, seed, n_layers=n_layers))
    return model


def build_llama(
    config: LlamaConfig, seed: int, device: torch.device | str | None = None
) -> Llama:
    """A seeded model on ``device`` (default: the current default device).

    Built on meta first, so torch's own default init never runs (it would be thrown away, and
    costs minutes for a billion-parameter model). On a meta device the model stays empty.
    """
    device = torch.device(device) if device is not None else torch.empty(0).device
    with torch.device("meta"):
        model = Llama(config)
    if device.type == "meta":
        return model
    init_weights(model, seed)
    return model.to(device)
