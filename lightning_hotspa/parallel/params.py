"""Putting tensors in place of a module's parameters, by dotted name, without re-wrapping anything.

The strategy keeps the home parameters (DTensors the optimizer sees) installed outside a step and
swaps the active layout's working parameters in while a stage computes. Assigning into
``module._parameters`` keeps hooks, buffers and module identity untouched, so a switch costs only the
parameter move.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

__all__ = ["set_parameters", "parameter_owner"]


def parameter_owner(root: nn.Module, name: str) -> tuple[nn.Module, str]:
    """The submodule holding parameter ``name`` and the parameter's local name there."""
    module_path, _, leaf = name.rpartition(".")
    module = root.get_submodule(module_path) if module_path else root
    if leaf not in module._parameters:
        raise KeyError(f"{type(root).__name__} has no parameter named {name!r}")
    return module, leaf


def set_parameters(root: nn.Module, params: Mapping[str, torch.Tensor]) -> None:
    """Installs ``params`` (``nn.Parameter`` objects, used as they are) under their dotted names."""
    for name, tensor in params.items():
        module, leaf = parameter_owner(root, name)
        if not isinstance(tensor, nn.Parameter):
            raise TypeError(f"parameter {name!r} must be an nn.Parameter, got {type(tensor).__name__}")
        module._parameters[leaf] = tensor
