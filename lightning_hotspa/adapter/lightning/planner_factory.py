"""``HotSPaStrategy(planner=...)``: a planner name, or a Planner, made into the step planner.

Names are checked when the strategy is constructed (a typo fails before any process starts); the
planner itself is built once the layouts are known. ``planner="cost"`` prices plans with the
hardware profile of the device the rank runs on (``cpu-gloo`` only on CPU) unless ``hardware=``
names one; an accelerator without a known profile is an error that says how to pass one.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from ...layout import Layout
from ...planner.base import Planner, check_planner

__all__ = ["PLANNER_NAMES", "build_planner", "check_planner_spec", "hardware_for"]

#: what ``planner=`` accepts by name (anything else must be a Planner instance)
PLANNER_NAMES = ("rule", "cost", "cost-profiled", "cost-measured")


def check_planner_spec(planner: Any, hardware: str | None) -> None:
    """Fails now on an unknown planner name, a non-planner object or an unknown profile name."""
    if isinstance(planner, str):
        if planner not in PLANNER_NAMES:
            raise ValueError(f"unknown planner {planner!r}; use one of {list(PLANNER_NAMES)} or a Planner instance")
    else:
        check_planner(planner, f"planner must be one of {list(PLANNER_NAMES)} or a Planner", ValueError)
    if hardware is not None and planner not in ("cost", "cost-profiled", "cost-measured"):
        shown = planner if isinstance(planner, str) else type(planner).__name__
        raise ValueError(f"hardware={hardware!r} prices plans for planner='cost' or 'cost-profiled' only; "
                         f"planner={shown!r} would ignore it: drop hardware= or choose planner='cost'")
    if hardware is not None:
        from ...planner.cost.hardware import get_profile

        get_profile(hardware)  # an unknown profile name fails here, naming the known ones


def hardware_for(hardware: str | None, device: torch.device) -> str:
    """The profile name to price plans with: ``hardware`` if given, else the device's own."""
    if hardware is not None:
        return hardware
    from ...planner.cost.hardware import PROFILES, profile_for_device

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    found = profile_for_device(device.type, name)
    if found is None:
        raise ValueError(f"planner='cost' has no hardware profile for this {device.type} device "
                         f"{name or str(device)!r}; pass one with HotSPaStrategy(hardware=NAME) (known: "
                         f"{', '.join(PROFILES)}) or add a HardwareProfile to "
                         f"lightning_hotspa/planner/cost/hardware.py")
    rank_zero_info(f"hotspa: planner='cost' prices plans for hardware profile {found!r} "
                   f"(the {device.type} device {name or str(device)!r})")
    return found


def build_planner(spec: Any, layouts: tuple[Layout, ...], *, tokens_per_rank: int, hardware: str | None,
                  device: torch.device, module: Any, activation_checkpointing: Any,
                  tp_regather: bool = True) -> Planner:
    """The planner ``spec`` names (checked by :func:`check_planner_spec`), over ``layouts``; a cost
    planner prices our runtime with the strategy's ``tp_regather``."""
    if spec == "rule":
        from ...planner.rule import ThresholdPlanner

        return ThresholdPlanner(layouts, tokens_per_rank=tokens_per_rank)
    if spec in ("cost", "cost-profiled", "cost-measured"):
        from ...planner.profiled.measured_planner import MeasuredCostPlanner
        from ...planner.solve.solver import CostModelPlanner

        config = getattr(module, "config", None)
        if config is None:
            raise ValueError("planner='cost' needs the LightningModule's model config (a `config` attribute, "
                             f"e.g. LlamaLM); {type(module).__name__} has none")
        import dataclasses

        from ...planner.cost.runtime_profile import HOTSPA

        kind = MeasuredCostPlanner if spec == "cost-measured" else CostModelPlanner  # its budget etc.: an instance
        return kind(layouts, model=config, hardware=hardware_for(hardware, device),
                    tokens_per_rank=tokens_per_rank, activation_checkpointing=activation_checkpointing,
                    profiled=spec != "cost",
                    runtime=HOTSPA if tp_regather else dataclasses.replace(HOTSPA, tp_regather=False))
    return spec  # a Planner instance (checked in the constructor)
