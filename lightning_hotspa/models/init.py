"""Seeded, per-parameter weight initialization.

Each parameter is generated IN FULL from its own generator, seeded by (seed, parameter name)
through a stable hash. A sharded owner therefore builds exactly the tensor the single-process
model has and keeps its shard; no parameter's values depend on which others exist, and only
one full parameter is in memory at a time (so even 7B initializes on a small host). Random
init of sharded CPU DTensors is wrong (docs/DESIGN.md §7, trap "random init of sharded
DTensors"), which is why this exists.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import torch
from torch import Tensor

from .config import LlamaConfig
from .llama import Llama

__all__ = ["INIT_STD", "build_llama", "init_parameter", "init_weights", "parameter_seed"]

INIT_STD = 0.02
_RESIDUAL_OUTPUTS = ("wo", "w2")  # projections that write into the residual stream


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
) -> Tensor:
    """The full initial value of parameter ``name`` (a name from ``Llama.named_parameters()``).

    Norm weights are ones; linears and the embedding are N(0, 0.02), with the residual output
    projections (wo, w2) scaled by 1/sqrt(2 * n_layers). Generated on CPU in fp32, so the
    values do not depend on the device the caller will move them to.
    """
    parts = name.split(".")
    if len(parts) < 2 or parts[-1] != "weight":
        raise ValueError(f"init_parameter: unexpected parameter name {name!r}")
    module = parts[-2]
    if module.endswith("norm"):
        return torch.ones(tuple(shape), dtype=dtype)
    std = INIT_STD / math.sqrt(2 * n_layers) if module in _RESIDUAL_OUTPUTS else INIT_STD
    generator = torch.Generator(device="cpu")
    generator.manual_seed(parameter_seed(seed, name))
    values = torch.empty(tuple(shape), dtype=torch.float32)
    values.normal_(0.0, std, generator=generator)
    return values.to(dtype)


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
