"""Where a module a user's config may still name now lives: ``_target_`` hints (Hydra alone says only
"Error locating target").

:data:`MOVED` is generated from the repository's history (``git log --diff-filter=R``: every renamed
module of the package, followed to where it lives today; ``tests/unit/test_bad_input_table_3.py``
regenerates it and fails when a move is missing). A module missing from it that no longer exists is
looked up by the name the target asks for: the package's sources are searched for its definition.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["MOVED", "check_moved_targets", "now_lives_at"]

_PACKAGE = "lightning_hotspa"
#: old module -> module today, both relative to the package (generated, see the module doc)
MOVED = {
    "adapter.accumulation": "adapter.lightning.accumulation",
    "adapter.callbacks": "adapter.observability.callbacks",
    "adapter.checkpoint": "adapter.checkpoints.dcp_state",
    "adapter.checkpoint_hooks": "adapter.checkpoints.hooks",
    "adapter.checkpoint_trust": "adapter.checkpoints.trust",
    "adapter.checkpoint_upgrade": "adapter.checkpoints.upgrade",
    "adapter.compile_blocks": "adapter.lightning.compile_blocks",
    "adapter.consolidate": "adapter.checkpoints.single_file",
    "adapter.dcp_trust": "adapter.checkpoints.dcp_metadata",
    "adapter.grad_norms": "adapter.lightning.grad_norms",
    "adapter.guarded_collectives": "adapter.lightning.guarded_collectives",
    "adapter.hf_export": "adapter.checkpoints.hf_export",
    "adapter.home_state": "adapter.lightning.home_state",
    "adapter.launch_checks": "adapter.lightning.launch_checks",
    "adapter.layout_choice": "adapter.lightning.layout_choice",
    "adapter.lightning_compat": "adapter.lightning.lightning_compat",
    "adapter.lightning_step": "adapter.lightning.lightning_step",
    "adapter.metric_sync": "adapter.lightning.metric_sync",
    "adapter.module_layouts": "adapter.lightning.module_layouts",
    "adapter.nccl_runtime": "adapter.lightning.nccl_runtime",
    "adapter.node_checkpoint": "adapter.checkpoints.nodes",
    "adapter.node_merge": "adapter.checkpoints.node_merge",
    "adapter.nonfinite": "adapter.lightning.nonfinite",
    "adapter.planner_factory": "adapter.lightning.planner_factory",
    "adapter.precision": "adapter.lightning.precision",
    "adapter.profiling": "adapter.lightning.profiling",
    "adapter.quiet_logs": "adapter.observability.quiet_logs",
    "adapter.recipe": "adapter.recipes.hydra_recipe",
    "adapter.registration": "adapter.lightning.registration",
    "adapter.reliability": "adapter.lightning.reliability",
    "adapter.stats": "adapter.observability.stats",
    "adapter.strategy": "adapter.lightning.strategy",
    "adapter.telemetry": "adapter.observability.telemetry",
    "adapter.timeline": "adapter.observability.timeline_png",
    "adapter.wandb_utils": "adapter.observability.wandb_run",
    "callbacks": "adapter.observability.callbacks",
    "checkpoint": "adapter.checkpoints.dcp_state",
    "checkpointing": "activation_checkpointing",
    "cli": "tools.cli",
    "comm_bytes": "testing.comm_bytes",
    "parallel.attention": "parallel.core_attention",
    "planner.artifact_rule": "tools.artifact_rule",
    "planner.assign": "planner.solve.assign",
    "planner.calibration": "planner.profiled.calibration",
    "planner.cost_model": "planner.cost.cost_model",
    "planner.efficiency": "planner.cost.efficiency",
    "planner.exact": "planner.solve.exact",
    "planner.hardware": "planner.cost.hardware",
    "planner.kv_gather_memory": "planner.cost.kv_gather_memory",
    "planner.memory_model": "planner.cost.memory_model",
    "planner.milp": "tools.milp",
    "planner.mixed_rounds": "planner.solve.mixed_rounds",
    "planner.oracle_bound": "planner.solve.oracle_bound",
    "planner.packing": "planner.solve.packing",
    "planner.predict": "planner.cost.predict",
    "planner.profile_update": "planner.cost.profile_update",
    "planner.published_fit": "planner.cost.published_fit",
    "planner.published_pricing": "planner.cost.published_pricing",
    "planner.published_runs": "planner.cost.published_runs",
    "planner.runtime_profile": "planner.cost.runtime_profile",
    "planner.schedule": "planner.profiled.schedule",
    "planner.simulate": "tools.simulate",
    "planner.solver": "planner.solve.solver",
    "planner.static_guard": "planner.solve.static_guard",
    "planner.terms": "planner.cost.terms",
    "planner.timeline": "planner.cost.timeline",
    "precision": "adapter.lightning.precision",
    "recipe": "adapter.recipes.hydra_recipe",
    "reliability": "adapter.lightning.reliability",
    "spawn": "testing.spawn",
    "stats": "adapter.observability.stats",
    "strategy": "adapter.lightning.strategy",
    "switch": "engine.switch",
    "telemetry": "adapter.observability.telemetry",
    "testing.fp8_layouts": "tools.fp8_layouts",
    "timeline": "adapter.observability.timeline_png",
    "wandb_utils": "adapter.observability.wandb_run",
}


def _exists(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _defining(name: str) -> list[str]:
    """The package's modules that define ``name`` at their top level (class, def or assignment)."""
    root = Path(importlib.util.find_spec(_PACKAGE).origin).parent  # type: ignore[union-attr, arg-type]
    defines = re.compile(rf"^(?:class|def)\s+{re.escape(name)}\b|^{re.escape(name)}\s*[:=]", re.MULTILINE)
    found = []
    for file in sorted(root.rglob("*.py")):
        if defines.search(file.read_text(encoding="utf-8", errors="replace")):
            parts = file.relative_to(root.parent).with_suffix("").parts
            found.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return found


def now_lives_at(target: str) -> str | None:
    """Where the package's ``target`` (``module.Name``) lives now, or None (it exists, or is not ours).

    Args:
        target: a ``_target_`` value.
    """
    module, _, name = target.rpartition(".")
    if not module.startswith(_PACKAGE + ".") or _exists(module):
        return None
    moved = MOVED.get(module.removeprefix(_PACKAGE + "."))
    if moved is not None:
        return f"{_PACKAGE}.{moved}.{name}"
    found = _defining(name)
    same = [m for m in found if m.rpartition(".")[2] == module.rpartition(".")[2]]
    return f"{(same or found)[0]}.{name}" if found else None


def check_moved_targets(node: Any, key: str = "", error: type[Exception] = ValueError) -> None:
    """A ``_target_`` naming a module of the package that moved is an ``error`` naming the key, the
    value and where it lives now.

    Args:
        node: a config (``DictConfig``) or a plain container of one, walked recursively.
        key: its dotted key, for the message.
        error: the exception type (the recipe's ConfigError).
    """
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if isinstance(node, (DictConfig, ListConfig)):
        node = OmegaConf.to_container(node, resolve=False)
    if isinstance(node, Mapping):
        target = node.get("_target_")
        where = now_lives_at(target) if isinstance(target, str) else None
        if where is not None:
            raise error(f"{key or 'config'}._target_={target} names a module that moved: write {where}"
                        + (" (or lightning_hotspa.HotSPaStrategy)" if where.endswith(".HotSPaStrategy") else ""))
        for child, value in node.items():
            check_moved_targets(value, f"{key}.{child}" if key else str(child), error)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            check_moved_targets(value, f"{key}[{i}]", error)
